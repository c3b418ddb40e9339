"""Gradients as views into fusion buckets (DDP's ``gradient_as_bucket_view``).

A :class:`GradLayout` holds one flat buffer per bucket, in the gradients' own
dtype, and gives every parameter a view of its slice. Once a parameter's
``.grad`` *is* that view, backward accumulates straight into the bucket and
the bucket's allreduce runs on it in place: no pack before, no unpack after.

* ``zero_grad(set_to_none=False)`` zeroes the views in place; autograd then
  adds into them, and nothing is copied.
* ``zero_grad(set_to_none=True)`` (torch's default) drops them; autograd hands
  each parameter a fresh gradient, which the reducer moves into the view with
  one copy that also divides by the world size for an average, a division the
  average needs anyway (:mod:`elastic_ring.reduction.adoption`). So each
  gradient is touched once either way.
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

from ..core import timeline
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

    def wire_for(self, b: int, divisor: int | None) -> torch.Tensor:
        """Bucket ``b``'s tensor to send: its buffer, or the wire buffer it is cast into (``divisor``: divided while
        cast, so a float16 sum of an average cannot overflow when the average is representable)."""
        buffer, wire = self.buffers[b], self.wire[b]
        if self.casts[b]:
            part = wire[:buffer.numel()]
            with timeline.span("cast", "fusion", bytes=part.numel() * part.element_size()):
                if divisor is None:
                    part.copy_(buffer)
                else:
                    torch.div(buffer, divisor, out=part)
        return wire

    def finish(self, b: int) -> None:
        """After bucket ``b``'s allreduce: cast the result back into the gradients."""
        buffer, wire = self.buffers[b], self.wire[b]
        if self.casts[b]:
            with timeline.span("cast", "fusion", bytes=buffer.numel() * buffer.element_size()):
                buffer.copy_(wire[:buffer.numel()])
