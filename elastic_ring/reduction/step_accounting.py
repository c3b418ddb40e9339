"""A reducer's step accounting: consumed steps, step boundaries, backward passes and their weights.

A mixin of :class:`elastic_ring.reduction.reducer.GradReducer` (it uses the reducer's state). A step is
consumed when ``step()`` applied it, or when it was reduced and a new step began without an apply (GradScaler
skipped it): ``step_listeners`` hear both. ``applied_steps`` counts the applied ones; it rides in the step's
agreement as a transaction id (:mod:`elastic_ring.reduction.agreement`) and is re-based by the state layer
after a sync or a restore. A step boundary that any rank asked for in a step's agreement is run on every rank
before the next step's work.
"""

from __future__ import annotations

import weakref

import torch

from ..core.ops import ReduceOp
from ..ring import runtime


class StepAccounting:
    """Counting, skipping and discarding the reducer's steps; their boundaries and pass weights."""

    # ------------------------------------------------------------ applied steps
    @property
    def reduced_unapplied(self) -> bool:
        """A step was reduced by synchronize() and neither applied nor skipped since (nothing new reduced)."""
        return self._synced_pending and not self.pending

    def set_applied_steps(self, n: int) -> None:
        """Re-base the applied-step count, agreed by every rank of the current ring (after a state sync or
        restore): from now on this ring compares it in every step's check."""
        self.applied_steps = n
        with self._lock:  # a verdict helper of an abandoned step must not accept after this reset
            self._reset()  # a step in flight when the state was synced or restored is discarded on every rank
        self.micro_calls = 0
        self._synced_pending = False  # a step reduced before the sync and not applied is discarded, not consumed
        self._boundary_seen = False
        self.boundary_due = False
        comm = runtime.current_or_none()
        self._armed_ref = weakref.ref(comm) if comm is not None else None
        if comm is not None and self._comm_ref is not None and self._comm_ref() is comm:
            self._step_armed = True

    def note_applied(self) -> None:
        """``step()`` applied the reduced gradients: count the step and tell the listeners."""
        self.applied_steps += 1
        self._synced_pending = False
        self.micro_calls = 0
        for listener in list(self.step_listeners):
            listener(self._passes, True)

    def _skipped_if_pending(self) -> None:
        """A step reduced but never applied, and a new one begins: it was skipped (GradScaler did that)."""
        if self._synced_pending:
            self._synced_pending = False
            self.micro_calls = 0
            self._consumed(applied=False)

    def _consumed(self, applied: bool) -> None:
        for listener in list(self.step_listeners):
            listener(self._passes, applied)

    def _reduced(self) -> None:
        self._synced_pending = True
        for listener in list(self.reduced_listeners):
            listener()

    def settle_skipped(self) -> None:
        """Count a step that was reduced and not applied as skipped now."""
        self._skipped_if_pending()

    def discard_step(self) -> None:
        """Forget the step in flight (after a failure discarded it); in-flight buckets are dropped unwaited."""
        with self._lock:
            self._reset()
        self._synced_pending = False
        self.micro_calls = 0
        for p in self._params:
            p.grad = None

    # ------------------------------------------------------------ backward passes and their weights
    @property
    def passes(self) -> int:
        """Backward passes accumulated per step."""
        return self._passes

    def set_passes(self, passes: int) -> None:
        """Change the backward passes per step (between steps only; every rank of a ring must agree)."""
        if passes == self._passes:
            return
        if self.pending:
            raise RuntimeError("backward passes per step can change only between steps, not after loss.backward()")
        self._passes = passes
        self._use_plan(self.bucket_bytes)
        self._reset()
        self.micro_calls = 0

    def set_pass_scale(self, share) -> None:
        """Weight each backward pass by its share ``share(j) -> (n, total)`` of the step's samples (None: off)."""
        if share is not None and self._op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"weighting backward passes needs op=Average or op=Sum, this optimizer reduces with "
                             f"op={self._op.value}")
        self.pass_scale = share
        if share is not None and not self._pre_hooks:
            self._pre_hooks = [p.register_hook(self._scale_pass) for p in self._params]
        self._pass_factors = {}

    def _scale_pass(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter's pre-accumulation hook: weight this backward pass's gradient by its share."""
        scale = self.pass_scale
        if scale is None:
            return None
        if self._synced_pending:  # a skipped step is consumed before this step's weights are read
            self._skipped_if_pending()
        j = self.micro_calls  # accumulate mode: step() follows every pass
        factor = self._pass_factors.get(j)
        if factor is None:  # once per pass and step, not per parameter
            n, total = scale(j)
            comm = runtime.current_or_none()
            world = comm.size if comm is not None and self._op is ReduceOp.AVERAGE else 1
            factor = self._pass_factors[j] = (n * world) / total  # one rounding: exact when representable
        if factor == 1.0:
            return None
        return torch.zeros_like(grad) if factor == 0.0 else grad * factor

    # ------------------------------------------------------------ step boundaries
    def take_boundary(self) -> None:
        """After an applied step: a boundary is due when any rank asked for one in this step's check."""
        comm = runtime._current  # (the module global: no call on every step)
        if comm is None or comm.spec.world_size == 1:  # no check runs: this rank decides alone
            seen = bool(self.boundary_ask is not None and self.boundary_ask())
        else:
            seen, self._boundary_seen = self._boundary_seen, False
        self.boundary_due = self.boundary_due or (seen and self.boundary_act is not None)

    def run_boundary(self, in_step: bool = False) -> None:
        """Run the due boundary's ``act()`` before the next step's work. ``in_step``: called from inside that
        step (its backward or synchronize), where nothing of it was sent yet: if ``act()`` raises, the step's
        gradients are dropped (the step is redone after the re-form); if it returns, the step goes on."""
        if not self.boundary_due:
            return
        self.boundary_due = False
        try:
            self.boundary_act()
        except BaseException:
            if in_step:
                self.discard_step()
            raise
