"""How a step's ranks agree before its update: a leading check, or the trailer in its last bucket.

A mixin of :class:`elastic_ring.reduction.reducer.GradReducer` (it uses the reducer's state):

* A ring's first step (and any step after the bucket plan changed, every step
  while autotuning, and every step with ``strict_checks=True``) starts with
  one 48-byte allreduce at its first gradient (``GradReducer._start_check``)
  that checks that all ranks are at the same point with the same parameters and
  bucket plan, and at the same optimizer step (``applied_steps`` rides in it as
  a transaction id, compared in a reducer's first ring and in rings on which it
  was re-based); it also carries the autotuner's agreed numbers. Its answer is
  awaited on a helper thread (:mod:`elastic_ring.reduction.verdict`), so
  backward never blocks on it; no bucket is sent before it is yes. A mismatch
  therefore raises :class:`TensorMismatchError` on every rank before any bucket
  of a mismatched size is sent (gloo would abort the process).
* Every other step has no collective of its own: the same agreement (plan,
  step, boundary flag) rides as exact small integers at the end of the last
  bucket (:mod:`elastic_ring.reduction.step_trailer`) and is read in
  ``synchronize()``, before the update is applied. Ranks at different steps
  (or with different plans of the same sizes) raise the full message on every
  rank and the ring stays usable; a bucket that met another collective (slots
  that are not this rank's plan) aborts the ring. On CUDA, a leading check
  after a ring's first step (autotuning, a plan change, op Min/Max, a wire dtype
  that cannot sum the world size exactly) does not hold the buckets back: its
  verdict is read in ``synchronize()``; CPU waits for it, and so does
  ``strict_checks=True`` everywhere.
"""

from __future__ import annotations

import time

from ..backends.base import Communicator
from ..core.errors import CommError, TensorMismatchError
from ..core.ops import ReduceOp
from . import step_trailer
from .buckets import GradLayout
from .signature import PendingCheck, exchange_message
from .verdict import VerdictWaiter


class StepAgreement:
    """The reducer's leading check and verdict, and the agreement that rides in the last bucket."""

    #: Read the check's verdict in synchronize() instead of before the first bucket. On by itself
    #: on CUDA after a ring's first step; tests set it to exercise that path over gloo.
    defer_check_on_cpu = False

    # ------------------------------------------------------------ which way this step agrees
    def _trailer_fits(self) -> bool:
        """Whether the last bucket's wire buffer has room for the step trailer (its size, every step)."""
        return (self._op in (ReduceOp.AVERAGE, ReduceOp.SUM) and not self._strict and bool(self.buckets)
                and step_trailer.supports(self.buckets[-1].wire_dtype, self._world))

    def _deferred(self, comm: Communicator) -> bool:
        """Whether buckets go out before this step's verdict, which is then read in synchronize()."""
        if self._ring_steps == 0 or self._strict or self._join_active:
            return False  # a ring's first step checks first: different models fail with a full message
        return not self._on_cpu or self.defer_check_on_cpu

    def _agree_in_bucket(self) -> bool:
        """Whether this step's agreement rides in its last bucket instead of a leading check: after a leading
        check of this ring agreed on the current plan, once autotuning is done, unless ``strict_checks``, and
        when the last bucket's wire dtype sums the slots exactly (op Average or Sum). The same on every rank."""
        return (not self._strict and not self._join_active and self._agreed_digest == self._digest
                and (self._tuner is None or self._tuner.done) and self._layout_for_step().trailer is not None)

    # ------------------------------------------------------------ the leading check's verdict
    def _launch_gated(self) -> None:
        """Before another collective is checked (the loop's own, between backward() and step()): let the helper
        launch the buckets that wait for this step's verdict, so that they precede it on every rank (which
        buckets are ready is the same on every rank once backward is done). What the verdict met is raised later
        by the hooks or synchronize()."""
        waiter = self._verdict
        if waiter is None or waiter.done:
            return
        try:
            waiter.settle()
        except CommError:
            pass  # the deadline passed: synchronize() raises it

    def _on_verdict(self, comm: Communicator, waiter: VerdictWaiter, values: list[int]) -> None:
        """On the helper thread, once every rank said yes: launch what became ready meanwhile."""
        with self._lock:
            if self._verdict is not waiter:  # this step was abandoned (a failure, a new ring)
                return
            self._accept(values, waiter.joined)
            self._launch_ready(comm)

    def _accept(self, values: list[int], joined: list[int]) -> None:
        self._verified = True
        self._join_active = bool(joined)  # while a rank waits in join(), every step leads with a check
        self._agreed_digest = self._check_digest
        self._boundary_seen = bool(values[1])
        if self._tuner is not None:
            self._tuner.incoming(values[0])

    def _raise_if_verdict_failed(self) -> None:
        """Raise, on the training thread, what the helper thread met (nothing was sent before its answer)."""
        waiter = self._verdict
        if waiter is None or not waiter.done or waiter.error is None:
            return
        self._reset()
        raise waiter.error

    def _finish_check(self, comm: Communicator) -> None:
        """The verdict must be yes before data that depends on it moves (deferred: before the step's results are used)."""
        if self._verified:
            return
        check, self._check = self._check, None
        assert check is not None, "a step's check is started before its first launch"
        deferred = bool(self._in_flight)
        started = time.perf_counter()
        try:
            values = check.finish(exchange=not deferred)
        except TensorMismatchError:
            self._after_mismatch(comm, check)
            raise
        self.check_wait_s += time.perf_counter() - started
        self._accept(values, check.joined)

    def _after_mismatch(self, comm: Communicator, check: PendingCheck) -> None:
        """Buckets launched before a deferred verdict may not match the peers' (a different model, an
        extra collective). If only the steps differ the buckets matched: drain them, then swap
        descriptions so every rank's message lists every rank's step. Otherwise abort the ring."""
        in_flight = self._in_flight
        self._reset()
        if not in_flight:
            return
        if check.same_call:
            self._path.wait(in_flight)
            raise TensorMismatchError(check.exchange_message()) from None
        self._layout = None
        comm.abort()

    # ------------------------------------------------------------ the agreement in the last bucket
    def _fill_trailer(self, layout: GradLayout) -> None:
        """Write this rank's agreement (plan, step, boundary flag) behind the last bucket's gradients, and the sums
        to expect when every rank wrote the same (read back by :meth:`_read_trailer`)."""
        boundary = bool(self.boundary_ask is not None and self.boundary_ask())
        values = step_trailer.encode(self._digest, self.applied_steps if self._step_armed else None, boundary)
        self._path.fill_trailer(layout.trailer, values)
        world = self._world
        self._expected_tail = [world * v for v in values[2:]]

    def _read_trailer(self, comm: Communicator, layout: GradLayout) -> None:
        """After the last bucket: every rank reads the same sums, so all agree, or all raise the same way. The sums
        are compared with what this rank's own slots add up to on every rank; only a difference is decoded."""
        sums = self._path.read_trailer(layout.trailer)
        world = comm.size
        if (sums[0] == world and sums[2:] == self._expected_tail and 0 <= sums[1] <= world
                and float(sums[1]).is_integer()):
            self._boundary_seen = sums[1] > 0
            return
        step = self.applied_steps if self._step_armed else None
        verdict = step_trailer.decode(sums, world, self._digest, step)
        if verdict.agreed:
            self._boundary_seen = verdict.boundary
            return
        if verdict.foreign or not verdict.same_plan:  # a bucket met another collective: the ring is not trusted
            self._layout = None
            comm.abort()
            raise TensorMismatchError(
                f"{self._kind}: the step's last gradient bucket met a different collective on some rank (a "
                "collective called by only some ranks, or ranks with different models); this was found by the "
                "agreement carried in that bucket, after the buckets were sent, so the ring was aborted. Every "
                "rank must make the same calls in the same order; DistributedOptimizer(strict_checks=True) checks "
                "before sending anything and names the call each rank made")
        # only the steps differ (the plan is this rank's on every rank): the buckets matched, the ring is usable
        raise TensorMismatchError(exchange_message(comm, self._kind, self._entries, step,
                                                   comm.spec.collective_timeout_s))
