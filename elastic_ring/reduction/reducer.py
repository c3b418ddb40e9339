"""Overlapped allreduce of gradients that live in their fusion buckets.

The reducer owns the hooks that :class:`DistributedOptimizer` registers. Its
contract:

* Parameters are bucketed in reverse registration order (the order in which
  backward usually produces their gradients) by
  :func:`elastic_ring.reduction.fusion.plan_buckets`, with an early first bucket
  (``first_bucket_bytes``) so the first allreduce starts early in backward.
  Each parameter's ``.grad`` becomes a view of its bucket
  (:mod:`elastic_ring.reduction.buckets`): no pack or unpack copy.
* When a parameter's gradient has been accumulated ``backward_passes_per_step``
  times it is ready: it is moved into its view if autograd put it elsewhere
  (``zero_grad(set_to_none=True)``) and divided by the world size for an
  average (:mod:`elastic_ring.reduction.adoption`: one ``div_`` per bucket when
  every gradient already lives in its view). Bucket *k* is launched as soon as
  it and every bucket before it are ready, so all ranks launch buckets in the
  same order while communication overlaps the rest of the backward pass.
  Buckets go out through the ring's :class:`~elastic_ring.backends.base.BucketPath`.
* **The lean hook.** Once a step's first gradient has found that the step's
  agreement rides in its last bucket (no check, no helper thread), the step's
  other hooks take no lock and look nothing up: a countdown per parameter and
  per bucket, the tables of :meth:`_layout_for_step`, one comparison with the
  current ring (a module global, no call). A step's first gradient, a ring's
  first steps, re-forms, join and autotuning take the locked path
  (``ELASTIC_RING_LEAN_HOOKS=0``: always).
* :meth:`synchronize` launches what is left (a parameter without a gradient
  contributes zeros), waits for every bucket, and resets for the next step.
* Each step's ranks agree (same point, parameters, bucket plan, optimizer
  step; a step boundary) before its update is applied: by a leading check at
  its first gradient, read before any bucket goes out (or, on CUDA, in
  :meth:`synchronize`), or by a trailer that rides in the last bucket
  (:mod:`elastic_ring.reduction.agreement`). A mismatch raises
  :class:`TensorMismatchError` on every rank.
* A :class:`CommError` anywhere drops everything in flight and the buckets,
  sets every parameter's ``.grad`` to None (a retried step starts from clean
  gradients) and is tagged ``live_state_consistent = True``: it was raised
  before the wrapped optimizer applied anything. At world size 1 the hooks
  return at once and nothing is copied.
* A new ring gets new buckets (and, with autotuning, a new tuning run).
* Consumed steps, step boundaries and pass weights:
  :mod:`elastic_ring.reduction.step_accounting`. What ``join()`` asks of the
  reducers (:func:`join_blockers`, :func:`after_join`):
  :mod:`elastic_ring.reduction.joinable`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Sequence

import torch

from ..backends.base import BucketPath, Communicator, Work
from ..core import constants, timeline
from ..core.errors import CommError
from ..core.log import get_logger
from ..core.ops import ReduceOp
from ..ring import runtime
from . import fusion, step_trailer
from .adoption import BucketAdoption
from .agreement import StepAgreement
from .autotune import AutotuneResult, Autotuner, distinct_candidates
from .compression import Compressor
from .joinable import JoinAnswering, after_join, join_blockers
from .signature import PendingCheck, describe, signature_hash, start_check
from .step_accounting import StepAccounting
from .verdict import VerdictWaiter

__all__ = ["GradReducer", "after_join", "join_blockers"]

_log = get_logger(__name__)


class GradReducer(BucketAdoption, StepAccounting, StepAgreement, JoinAnswering):
    """Reduces the gradients of ``named_params`` across the current ring, overlapped with backward."""

    #: The backend's bucket path to use (NCCL: ``constants.NCCL_BUCKET_PATHS``; None: the backend's default,
    #: ``ELASTIC_RING_NCCL_BUCKETS``). Read when a ring is bound; benchmarks set it per optimizer.
    bucket_mode: str | None = None

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        op: ReduceOp,
        compressor: Compressor,
        bucket_bytes: int,
        backward_passes_per_step: int,
        first_bucket_bytes: int = 0,
        autotune: bool = False,
        strict_checks: bool = False,
    ) -> None:
        ordered = list(reversed(named_params))
        self._names = [n for n, _ in ordered]
        self._params = [p for _, p in ordered]
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._metas = [(p.numel(), p.dtype, p.device) for p in self._params]
        self._nbytes = [p.numel() * p.element_size() for p in self._params]
        self._op = op
        self._compressor = compressor
        self._passes = backward_passes_per_step
        self._first_bytes = first_bucket_bytes
        self._default_bytes = bucket_bytes
        self._autotune = autotune
        self._strict = strict_checks
        self._agreed_digest: int | None = None  # the plan a leading check of this ring agreed on
        self._join_active = False  # this ring's last check saw a joined rank: every step leads with a check
        self._check_digest: int | None = None  # the plan the check in flight asks about
        self._world = 1
        self._tuner: Autotuner | None = None
        self._tuned = False  # the tuner of this ring has chosen (its per-step calls end)
        self.autotune_result: AutotuneResult | None = None
        self.applied_steps = 0
        #: Called after every consumed step as ``fn(passes, applied)``: applied by ``step()``, or reduced
        #: and then skipped (e.g. GradScaler on overflow: noticed when the next step begins).
        self.step_listeners: list = []
        #: Called with no arguments whenever a step's reduction completed (before it is applied or skipped).
        self.reduced_listeners: list = []
        #: ``ask() -> bool``: this rank has something to do at the next step boundary; rides in the step's check
        #: (MAX over ranks), so every rank learns at the same step whether any rank asked.
        self.boundary_ask = None
        #: ``act()``: run on every rank before the next step's work once a boundary is due (may raise).
        self.boundary_act = None
        self.boundary_due = False
        #: ``share(j) -> (n, total)``: backward pass ``j`` of a step holds n of the step's total samples (None: off).
        self.pass_scale = None
        self._boundary_seen = False
        self.micro_calls = 0  # accumulate mode: step() calls of this step so far (= the backward pass running)
        self._synced_pending = False  # a step was reduced and neither applied nor skipped yet
        self._pre_hooks: list = []
        self._step_armed = True
        self._armed_ref: weakref.ref | None = None
        self._entries = [(n, describe(p)) for n, p in zip(self._names, self._params)]
        self._lock = threading.RLock()
        self._comm_ref: weakref.ref | None = None
        self._path: BucketPath | None = None
        self._on_cpu = True
        self._layout = None
        self._ring_steps = 0
        self._last_step_end: float | None = None
        self.check_wait_s = 0.0  # total time the training thread waited for checks
        self.first_bucket_delay_s = 0.0  # total time ready first buckets waited for their step's verdict
        self._use_plan(bucket_bytes)
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
        self._track_for_join()

    # ------------------------------------------------------------ plan and state
    def _plan(self, bucket_bytes: int) -> list[fusion.Bucket]:
        return fusion.plan_buckets(self._metas, bucket_bytes, self._compressor, self._first_bytes, split_source_dtypes=True)

    def _use_plan(self, bucket_bytes: int) -> None:
        """Switch to the buckets of ``bucket_bytes``; their buffers are made at the next gradient."""
        self.bucket_bytes = bucket_bytes
        self.buckets = self._plan(bucket_bytes)
        self._bucket_of = [0] * len(self._params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.indices:
                self._bucket_of[i] = b
        self._layout = None
        self._new_plan_tables()
        self._kind = (f"DistributedOptimizer step (op={self._op.value}, compression={self._compressor.name}, "
                      f"backward_passes_per_step={self._passes}, fusion_threshold_bytes={bucket_bytes}, "
                      f"first_bucket_bytes={self._first_bytes}, {len(self.buckets)} buckets"
                      f"{', strict_checks=True' if self._strict else ''})")
        self._digest = signature_hash(self._kind, self._entries)

    def _reset(self) -> None:
        self._pass_factors: dict[int, float] = {}
        self._check: PendingCheck | None = None
        self._verdict: VerdictWaiter | None = None
        self._gated_since: float | None = None
        self._verified = False
        self._in_bucket = False  # this step's agreement rides in its last bucket (no leading check)
        self._lean: Communicator | None = None  # the ring this step's lean hooks serve (None: locked path)
        self._remaining = [self._passes] * len(self._params)
        self._unready = len(self._params)  # parameters whose gradient is not final yet this step
        self._touched = False  # a gradient of this step arrived
        self._left = list(self._sizes)  # per bucket: parameters whose gradient is not final yet
        self._divided = [0] * len(self._sizes)  # per bucket: gradients divided on their way into their views
        for lists in (self._copy_to, self._copy_from, self._divide):
            for pending in lists:
                pending.clear()
        self._next = 0
        self._in_flight: list[Work] = []

    @property
    def pending(self) -> bool:
        """True between the first ready gradient of a step and its synchronize()."""
        return self._touched or bool(self._in_flight)

    def remove_hooks(self) -> None:
        for handle in self._hooks + self._pre_hooks:
            handle.remove()
        self._hooks, self._pre_hooks = [], []

    # ------------------------------------------------------------ the ring
    def _bind(self, comm: Communicator) -> None:
        """Start using ``comm``: on a new ring, drop what was in flight, new buckets, tune again."""
        if self._comm_ref is not None and self._comm_ref() is comm:
            return
        self._reset()
        # applied_steps is compared across ranks in a reducer's first ring (every rank starts at 0) and
        # in a ring on which the state layer re-based it (set_applied_steps after a sync or a restore)
        self._step_armed = self._comm_ref is None or (self._armed_ref is not None and self._armed_ref() is comm)
        self._comm_ref = weakref.ref(comm)
        comm.before_check.append(weakref.WeakMethod(self._launch_gated))
        self._path = comm.bucket_path(self.bucket_mode)
        self._world = comm.size
        self._agreed_digest = None  # a new ring's first step is checked before any bucket is sent
        self._join_active = False
        self._on_cpu = comm.device.type == "cpu"
        self._ring_steps = 0
        self._last_step_end = None
        self._tuner = None
        self._tuned = False
        size = self._default_bytes
        if self._autotune:
            candidates = distinct_candidates(constants.AUTOTUNE_CANDIDATE_BYTES, self._default_bytes,
                                             lambda s: tuple(b.indices for b in self._plan(s)))
            self._tuner = Autotuner(candidates, self._default_bytes, constants.AUTOTUNE_WARMUP_STEPS,
                                    constants.AUTOTUNE_SAMPLE_STEPS, constants.AUTOTUNE_MARGIN)
            size = self._tuner.current
            self._record_tuning()
        self._use_plan(size)
        self._reset()

    # ------------------------------------------------------------ hooks and bucket launching
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated. The lean path inlines the common cases of ``_adopt`` and
        ``_ready_one`` (adoption.py): no call per parameter but this one while the step stays on its ring."""
        comm = self._lean
        if comm is None or runtime._current is not comm or self._synced_pending or self.boundary_due:
            return self._on_grad_ready_locked(param)  # (runtime._current: the module global, no call)
        self._touched = True
        i = self._position[id(param)]
        remaining = self._remaining[i] - 1
        self._remaining[i] = remaining
        if remaining:
            if remaining < 0:
                raise self._too_many_passes(i)
            return
        self._unready -= 1
        b = self._bucket_of[i]
        grad = param.grad
        view = self._views[i]
        if grad is view:  # accumulated into the bucket: nothing moves
            self._divide[b].append(view)
        elif grad is None or grad.requires_grad or grad.is_sparse:
            self._adopt(i, b)
        elif self._large[i]:
            divisor = self._divisors[b]
            if divisor is None:
                view.copy_(grad)
            else:
                torch.div(grad, divisor, out=view)
                self._divided[b] += 1
            param.grad = view
        else:  # small: copied with the rest of its bucket when it is complete
            self._copy_to[b].append(view)
            self._copy_from[b].append(grad)
            self._divide[b].append(view)
            param.grad = view
        left = self._left[b] - 1
        self._left[b] = left
        if not left:
            try:
                self._launch_ready(comm, b)
            except CommError as exc:
                self._on_comm_error(exc)
                raise

    def _on_grad_ready_locked(self, param: torch.Tensor) -> None:
        if self._lean is not None and not self._touched:  # a step armed lean by the last one starts as any step
            self._lean = None
            self._in_bucket = self._verified = False
        if self.boundary_due:  # nobody ran it before this step's forward: run it now, before anything is sent
            self.run_boundary(in_step=True)
        if self._synced_pending:
            self._skipped_if_pending()
        comm = runtime.current_or_none()
        if comm is None or comm.size == 1:
            return
        with self._lock:
            try:
                self._bind(comm)
                self._raise_if_verdict_failed()
                self._start_check(comm, helper=self._on_cpu and not self._deferred(comm))
                self._count_ready(self._position[id(param)], comm)
            except CommError as exc:
                self._on_comm_error(exc)
                raise

    def _start_check(self, comm: Communicator, helper: bool) -> None:
        """Once per step, at its first gradient: ask whether all ranks are here, with the same model, at the
        same step. With ``helper``, the answer is awaited on a helper thread (backward goes on meanwhile)."""
        if self._check is not None or self._verified or self._verdict is not None:
            return
        self._boundary_seen = False
        if self._agree_in_bucket():
            self._in_bucket = self._verified = True
            if constants.LEAN_HOOKS:  # the step's other hooks take the lean path
                self._lean = comm
            return
        value = self._tuner.outgoing() if self._tuner is not None else 0
        boundary = int(bool(self.boundary_ask is not None and self.boundary_ask()))
        step = self.applied_steps if self._step_armed else None
        self._check_digest = self._digest  # what this check agrees on (the plan cannot change before its answer)
        buckets, op = self.buckets, ReduceOp.SUM if self._op is ReduceOp.AVERAGE else self._op
        slots = step_trailer.SLOTS if self._trailer_fits() else 0
        check = start_check(comm, self._kind, self._entries, None, values=[value, boundary], step=step,
                            digest=self._digest, step_slots=True,
                            join_plan=lambda: {"run": "buckets", "op": op.value, "buckets": [
                                [str(b.wire_dtype).replace("torch.", ""), b.numel + (slots if i == len(buckets) - 1
                                                                                     else 0)]
                                for i, b in enumerate(buckets)]})
        if helper:
            self._verdict = VerdictWaiter(check, lambda waiter, values: self._on_verdict(comm, waiter, values),
                                          comm.spec.collective_timeout_s + 10.0)
        else:
            self._check = check

    # ------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Finish this step's reduction: every parameter's ``.grad`` holds the reduced value."""
        if self.boundary_due:
            self.run_boundary(in_step=True)
        comm = runtime.current()
        if comm.spec.world_size == 1:
            self._reset()
            self._reduced()
            return
        waiter = self._verdict
        if waiter is not None:  # outside the lock: the helper takes it to launch what became ready
            started = time.perf_counter()
            try:
                waiter.settle()
            except CommError as exc:
                with self._lock:
                    self._on_comm_error(exc)
                raise
            finally:
                self.check_wait_s += time.perf_counter() - started
        with self._lock:
            in_bucket = False
            try:
                if self._lean is not comm:  # a lean step is bound to its ring and agrees in its last bucket
                    self._bind(comm)
                    if self._verdict is waiter:
                        self._raise_if_verdict_failed()
                    self._start_check(comm, helper=False)  # no gradient arrived this step: check here
                if self._unready:
                    for i, remaining in enumerate(self._remaining):
                        if remaining != 0:  # no gradient this step (or fewer passes): send what .grad holds, or zeros
                            self._remaining[i] = 0
                            b = self._ready_one(i)
                            if b >= 0:
                                self._launch_ready(comm, b)
                    self._unready = 0
                self._launch_ready(comm)  # what waited for a check's verdict
                if self._next != len(self.buckets):
                    raise RuntimeError(f"internal error: {len(self.buckets) - self._next} gradient buckets were not launched")
                if not self._verified:
                    self._finish_check(comm)  # deferred: the verdict comes before any result is used
                layout = self._layout or self._layout_for_step()
                self._path.wait(self._in_flight)
                for b, cast in enumerate(layout.casts):
                    if cast:
                        layout.finish(b)
                in_bucket = self._in_bucket
                if in_bucket:
                    self._read_trailer(comm, layout)
            except CommError as exc:
                self._on_comm_error(exc)
                raise
            finally:
                self._reset()
            self._reduced()
            self._end_step()
            if in_bucket and constants.LEAN_HOOKS and self._layout is layout and not self._join_active:
                # the same ring, plan and layout: the next step agrees in its last bucket too, its hooks start lean
                self._in_bucket = self._verified = True
                self._lean = comm

    def _end_step(self) -> None:
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        self._ring_steps += 1
        tuner = self._tuner
        if tuner is not None and not self._tuned:
            switch = tuner.end_step(seconds)
            if switch is not None:
                self._use_plan(switch)
                self._reset()
            self._record_tuning()
            self._tuned = tuner.done

    def _record_tuning(self) -> None:
        tuner = self._tuner
        if tuner is None or tuner.result is None or tuner.result is self.autotune_result:
            return
        self.autotune_result = result = tuner.result
        timeline.instant("autotune", "fusion", chosen_bytes=result.chosen_bytes, candidates=list(result.candidates),
                         step_ms=[round(t, 3) for t in result.step_ms])
        times = ", ".join(f"{c >> 10} KiB: {t:.1f} ms" for c, t in zip(result.candidates, result.step_ms)) or "one candidate"
        _log.info("autotune: DistributedOptimizer uses fusion_threshold_bytes=%d (median step per bucket size: %s; "
                  "tuned over %d steps)", result.chosen_bytes, times, result.tuning_steps)

    def _on_comm_error(self, exc: CommError) -> None:
        """Drop everything of this step; gradients become None, and the buckets are rebuilt next time."""
        self.discard_step()
        self._layout = None
        self._boundary_seen = False
        setattr(exc, "live_state_consistent", True)
