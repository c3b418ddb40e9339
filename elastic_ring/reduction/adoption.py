"""A step's buckets: a ready gradient into its view, a complete bucket launched (a mixin of the reducer).

A :class:`~elastic_ring.reduction.reducer.GradReducer` mixin (it uses the reducer's state). A parameter's
gradient is *final* for a step once it was accumulated ``backward_passes_per_step`` times. Then:

* if ``.grad`` already *is* its view (``zero_grad(set_to_none=False)``, or every pass after the first of a
  step), autograd accumulated into the bucket: nothing moves;
* a large fresh gradient (>= ``GRAD_BATCH_BELOW_BYTES``) is copied into its view at once, divided by the world
  size in the same pass for an average (``torch.div(grad, n, out=view)``);
* a small fresh gradient is remembered and copied with the others of its bucket in one ``_foreach_copy_``
  when the bucket is complete;
* a missing gradient (only in ``synchronize()``) becomes zeros: every rank must send the bucket.

``.grad`` becomes the view at once. When the bucket's countdown reaches zero it is *complete*
(:meth:`BucketAdoption._launch_ready`, which then launches it): the batched copy runs, and the average's division is **one** ``div_``
over the whole bucket when no gradient of it was divided on its way in (the usual case), else one
``_foreach_div_`` over the views that still need it. Division and copy are elementwise, so every grouping
gives bit-identical results.

Everything a hook needs is computed once per ring and bucket plan (:meth:`BucketAdoption._layout_for_step`):
each parameter's bucket, view and size class, each bucket's divisor and countdown. The reducer's lean hook
inlines the common cases of :meth:`BucketAdoption._adopt` (which stays the reference for every case) and
calls nothing per parameter but itself.
"""

from __future__ import annotations

import time

import torch

from ..backends.base import Communicator
from ..core import constants
from ..core.ops import ReduceOp
from . import step_trailer
from .buckets import GradLayout


class BucketAdoption:
    """Per-layout tables and per-step bucket state of the reducer's gradients."""

    # ------------------------------------------------------------ per ring and plan
    def _new_plan_tables(self) -> None:
        """After the bucket plan changed: the per-bucket countdown sizes and pending lists (kept, cleared per step)."""
        self._sizes = [len(b.indices) for b in self.buckets]
        self._copy_to: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        self._copy_from: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        self._divide: list[list[torch.Tensor]] = [[] for _ in self.buckets]

    def _layout_for_step(self) -> GradLayout:
        """The buckets' buffers of this ring and plan (made at the first need), and the hooks' tables for them."""
        layout = self._layout
        if layout is None:
            layout = GradLayout(self._params, self.buckets, step_trailer.SLOTS if self._trailer_fits() else 0)
            average = self._op is ReduceOp.AVERAGE
            #: per bucket: the average's divisor of the gradients in their views (None: no division there)
            self._divisors = [self._world if average and not cast else None for cast in layout.casts]
            #: per bucket: the divisor applied while casting into the wire buffer (compression)
            self._cast_divisors = [self._world if average and cast else None for cast in layout.casts]
            below = constants.GRAD_BATCH_BELOW_BYTES
            self._large = [nbytes >= below for nbytes in self._nbytes]
            self._views = layout.views
            self._layout = layout
        return layout

    # ------------------------------------------------------------ per step
    def _adopt(self, i: int, b: int) -> None:
        """Parameter ``i``'s final gradient into its view (see the module's docstring); every case."""
        layout = self._layout or self._layout_for_step()
        param, view = self._params[i], self._views[i]
        grad = param.grad
        divisor = self._divisors[b]
        if grad is view:
            self._divide[b].append(view)
            return
        if grad is not None and grad.is_sparse:
            raise ValueError(f"DistributedOptimizer reduces dense gradients; parameter {self._names[i]!r} has a sparse "
                             "gradient (e.g. nn.Embedding(sparse=True)); use sparse=False")
        if grad is None:
            view.zero_()
            self._divide[b].append(view)
        elif grad.data_ptr() == view.data_ptr() and layout.owns(i, grad):  # the view under another tensor object
            self._divide[b].append(view)
        elif grad.requires_grad or self._large[i]:  # create_graph=True: no batched copy of a graph's tensor
            with torch.no_grad():
                if divisor is None:
                    view.copy_(grad)
                else:
                    torch.div(grad, divisor, out=view)
                    self._divided[b] += 1
        else:
            self._copy_to[b].append(view)
            self._copy_from[b].append(grad)
            self._divide[b].append(view)
        param.grad = view

    def _ready_one(self, i: int) -> int:
        """Parameter ``i``'s gradient is final for this step: adopt it and count it. Its bucket if that is complete
        now (:meth:`_launch_ready` then completes and launches it), else -1."""
        b = self._bucket_of[i]
        self._adopt(i, b)
        left = self._left[b] - 1
        self._left[b] = left
        return -1 if left else b

    def _too_many_passes(self, i: int) -> RuntimeError:
        return RuntimeError(
            f"gradient of {self._names[i]!r} was computed more than backward_passes_per_step="
            f"{self._passes} times before optimizer.step(); raise backward_passes_per_step "
            "or call step() after every backward pass"
        )

    def _count_ready(self, i: int, comm: Communicator) -> None:
        self._touched = True
        remaining = self._remaining[i] - 1
        self._remaining[i] = remaining
        if remaining < 0:
            raise self._too_many_passes(i)
        if remaining == 0:
            self._unready -= 1
            b = self._ready_one(i)
            if b >= 0:
                self._launch_ready(comm, b)

    def _launch_ready(self, comm: Communicator, complete: int = -1) -> None:
        """Complete bucket ``complete`` (its countdown reached zero; -1: none), then launch, in order, every bucket
        that is ready and allowed to go. Completing (adoption.py): the batched copy of its small gradients, then
        the average's division, one ``div_`` over the bucket when every gradient already lives in its view."""
        if complete >= 0:
            copy_to = self._copy_to[complete]
            if copy_to:
                torch._foreach_copy_(copy_to, self._copy_from[complete])
                copy_to.clear()
                self._copy_from[complete].clear()
            divisor = self._divisors[complete]
            if divisor is not None:
                if not self._divided[complete]:
                    self._layout.buffers[complete].div_(divisor)
                elif self._divide[complete]:
                    torch._foreach_div_(self._divide[complete], divisor)
            self._divide[complete].clear()
        left = self._left
        count = len(left)
        while self._next < count and not left[self._next]:
            b = self._next
            if not self._verified and not self._deferred(comm):
                if self._verdict is not None:  # the helper launches it once the answer is in
                    if self._gated_since is None:
                        self._gated_since = time.perf_counter()
                    return
                self._finish_check(comm)
            if self._gated_since is not None:
                self.first_bucket_delay_s += time.perf_counter() - self._gated_since
                self._gated_since = None
            layout = self._layout
            wire = layout.wire_for(b, self._cast_divisors[b]) if layout.casts[b] else layout.wire[b]
            if self._in_bucket and b == count - 1:
                self._fill_trailer(layout)
            if self._op is ReduceOp.AVERAGE or self._op is ReduceOp.SUM:
                self._in_flight.append(self._path.launch(wire))
            else:
                self._in_flight.append(comm.allreduce(wire, self._op))
            self._next = b + 1
