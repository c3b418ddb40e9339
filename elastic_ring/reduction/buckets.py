"""Gradients as views into fusion buckets (DDP's ``gradient_as_bucket_view``).

A :class:`GradLayout` holds one flat buffer per bucket, in the gradients' own
dtype, and gives every parameter a view of its slice. Once a parameter's
``.grad`` *is* that view, backward accumulates straight into the bucket and
the bucket's allreduce runs on it in place: no pack before, no unpack after.

* ``zero_grad(set_to_none=False)`` zeroes the views in place; autograd then
  adds into them, and nothing is copied.
* ``zero_grad(set_to_none=True)`` (torch's default) drops them; autograd hands
  each parameter a fresh gradient, which :meth:`adopt` moves into the view with
  one copy that also divides by the world size for an average, a division the
  average needs anyway. So each gradient is touched once either way.
* With compression (a wire dtype other than the gradients'), the bucket is
  cast into a wire buffer while it is divided (so a float16 sum cannot
  overflow when the average is representable) and cast back after the
  allreduce: one pass each way over the whole bucket.

A layout belongs to one ring and one bucket plan; the reducer builds a new one
when either changes (a collective of a failed ring may still be writing into
the old buffers, so they are never reused).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends.base import Communicator, Work
from ..core import timeline
from ..core.ops import ReduceOp
from .fusion import Bucket


class GradLayout:
    """Bucket buffers for ``params`` (in bucket-plan order) and each parameter's view into them."""

    def __init__(self, params: Sequence[torch.Tensor], buckets: Sequence[Bucket], trailer: int = 0) -> None:
        self.buckets = list(buckets)
        self.buffers: list[torch.Tensor] = []
        self.wire: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        #: ``trailer`` extra elements at the end of the last bucket's wire buffer, reduced with it (the step's
        #: agreement rides there: :mod:`elastic_ring.reduction.step_trailer`); None without them.
        self.trailer: torch.Tensor | None = None
        #: Whether bucket b goes out through a wire buffer of another dtype (compression): cast there and back.
        self.casts: list[bool] = []
        last = len(self.buckets) - 1
        for b, bucket in enumerate(self.buckets):
            dtype = bucket.source_dtype
            if dtype is None:
                raise ValueError("gradient buckets must be planned with split_source_dtypes=True")
            extra = trailer if b == last else 0
            same = bucket.wire_dtype == dtype
            buffer = torch.empty(bucket.numel + (extra if same else 0), dtype=dtype, device=bucket.device)
            wire = buffer if same else torch.empty(bucket.numel + extra, dtype=bucket.wire_dtype, device=bucket.device)
            if extra:
                self.trailer = wire[bucket.numel:]
                self.trailer.zero_()
                buffer = buffer[:bucket.numel]  # the gradients' part: casts and views never touch the trailer
            self.buffers.append(buffer)
            self.wire.append(wire)
            self.casts.append(not same)
            for i, chunk in zip(bucket.indices, buffer.split(bucket.numels)):
                self.views[i] = chunk.view(params[i].shape)

    def owns(self, i: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is parameter ``i``'s view (then autograd has accumulated into the bucket)."""
        view = self.views[i]
        return (
            grad is not None
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
            and grad.dtype == view.dtype
            and grad.device == view.device
        )

    def adopt(self, i: int, param: torch.Tensor, divisor: int | None) -> None:
        """Make ``param.grad`` parameter ``i``'s view holding its gradient (divided by ``divisor``).

        A missing gradient becomes zeros, as in Horovod: every rank must send the bucket.
        """
        view = self.views[i]
        grad = param.grad
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self.owns(i, grad):
                if divisor is not None:
                    view.div_(divisor)
                return
            elif grad.is_sparse:
                raise ValueError(
                    f"DistributedOptimizer reduces dense gradients; parameter #{i} has a sparse gradient "
                    "(e.g. nn.Embedding(sparse=True)); use sparse=False"
                )
            elif divisor is not None:
                torch.div(grad, divisor, out=view)
            else:
                view.copy_(grad)
        param.grad = view

    def adopt_many(self, indices: Sequence[int], params: Sequence[torch.Tensor], divisor: int | None) -> None:
        """:meth:`adopt` for several small gradients at once: one ``_foreach`` copy and one ``_foreach``
        division instead of two Python-level tensor calls each (which cost more than the bytes they move)."""
        copy_to, copy_from, zero, scale = [], [], [], []
        for i in indices:
            grad = params[i].grad
            view = self.views[i]
            scale.append(view)
            if grad is None:
                zero.append(view)
            elif not self.owns(i, grad):
                if grad.is_sparse:
                    raise ValueError(
                        f"DistributedOptimizer reduces dense gradients; parameter #{i} has a sparse gradient "
                        "(e.g. nn.Embedding(sparse=True)); use sparse=False"
                    )
                copy_to.append(view)
                copy_from.append(grad)
        with torch.no_grad():
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)
            if zero:
                torch._foreach_zero_(zero)
            if divisor is not None and scale:
                torch._foreach_div_(scale, divisor)
        for i in indices:
            params[i].grad = self.views[i]

    def launch(self, b: int, comm: Communicator, op: ReduceOp, divisor: int | None) -> Work:
        """Start bucket ``b``'s allreduce (``divisor``: divide while casting to the wire dtype)."""
        buffer, wire = self.buffers[b], self.wire[b]
        if self.casts[b]:
            part = wire[:buffer.numel()]
            with torch.no_grad(), timeline.span("cast", "fusion", bytes=part.numel() * part.element_size()):
                if divisor is None:
                    part.copy_(buffer)
                else:
                    torch.div(buffer, divisor, out=part)
        return comm.allreduce(wire, op)

    def finish(self, b: int) -> None:
        """After bucket ``b``'s allreduce: cast the result back into the gradients."""
        buffer, wire = self.buffers[b], self.wire[b]
        if self.casts[b]:
            with torch.no_grad(), timeline.span("cast", "fusion", bytes=buffer.numel() * buffer.element_size()):
                buffer.copy_(wire[:buffer.numel()])
