"""Forming one round's communicator so that it can be interrupted.

A backend's own formation blocks in native code when a peer never comes: gloo's
``ProcessGroupGloo(...)`` waits in the store for every rank's address (for
``connect_timeout_s``), then connects its pairs (measured: a survivor waits five
times the timeout, 10 s at 2 s and 50 s at 10 s, for a lower rank that died
after publishing its address); NCCL's ranks wait for rank 0's unique id. When
the driver already knows that a member of the round is lost, that wait is pure
loss. A :class:`Formation`:

1. **Arrival barrier** (:mod:`.arrival`: each rank's key, a counter, one
   ``all_arrived`` key to wait for). The backend group is built only after it,
   so a rank that never comes is named in the error and no backend state exists
   when the wait is given up.
2. **Abandonable construction.** The barrier wait and the backend's construction
   run on a helper thread, with native blocking waits (a normal re-form pays a
   thread start and one store round trip, nothing polls). The caller waits on an
   event that the helper's end or :meth:`Formation.cancel` sets. On a
   cancellation, or ``ABANDON_GRACE_S`` past the connect deadline, the caller
   raises :class:`CommError` and abandons the helper: a result that comes later
   goes to the backend's ``discard`` (gloo: the reaper), an error to the log.

   Not short slices on the caller's thread: a timed-out ``TCPStore.wait`` prints
   two C++ warnings (per slice), polling ``check`` delays every normal re-form by
   up to its interval, and no slice reaches gloo's pair connection anyway.

The helper reads the store through :class:`_InterruptibleStore`: a wait blocks
natively for at most ``BLOCKING_WAIT_S`` (normal arrivals and address exchanges
end far sooner), then polls ``check`` every ``POLL_S`` and stops once the
formation is cancelled or abandoned. An abandoned helper therefore ends within
about a second, except inside gloo's pair connection (up to those five
timeouts). While it runs it may hold its store connection's lock:
:attr:`Formation.store_held` tells the runtime to open a new connection for the
next round. At exit, helpers still running get ``EXIT_DRAIN_S``.

Arrival keys and the counter are existence hints (:mod:`.arrival`); what the
backend reads next (gloo's addresses, NCCL's unique id) stays authenticated. A
stranger who overwrites the counter with something that is not a number fails
that round (the server drops the adding rank's connection: :class:`CommError`,
and :attr:`Formation.store_broken` tells the runtime to open a new one).
Errors name the round, the ranks that had not arrived
(learnt on a fresh connection within ``DIAGNOSE_S``) and the cause: the driver's
reason, or ``connect_timeout_s``.
"""

from __future__ import annotations

import _thread
import atexit
import datetime
import threading
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch.distributed as dist

from ..core.errors import CommError
from ..core.log import get_logger
from ..core.spec import RingSpec
from .arrival import _first_line, absent_ranks, all_arrived_key, announce_arrival

_log = get_logger(__name__)

T = TypeVar("T")

#: How long the caller waits past the connect deadline for the helper's own timeout error before it abandons it.
ABANDON_GRACE_S = 1.0
#: How long an error path may spend learning which ranks did not arrive (on a fresh store connection).
DIAGNOSE_S = 0.25
#: Missing ranks named in one message.
MAX_NAMED = 16
#: A store wait of the helper blocks natively this long, then polls (see the module docstring).
BLOCKING_WAIT_S = 1.0
POLL_S = 0.1
#: How long the exit hook waits for helpers still running.
EXIT_DRAIN_S = 2.0

_running_lock = threading.Lock()
_running: "set[Formation]" = set()  # formations whose helper has not finished (for the exit hook)


def _drain_at_exit() -> None:
    deadline = time.monotonic() + EXIT_DRAIN_S
    with _running_lock:
        running = list(_running)
    for form in running:
        form._finished.wait(max(0.0, deadline - time.monotonic()))
    left = [form.spec.identity for form in running if not form._finished.is_set()]
    if left:
        _log.warning("exiting while %d abandoned formation(s) still block in the backend: %s%s", len(left),
                     "; ".join(left[:MAX_NAMED]), "; ..." if len(left) > MAX_NAMED else "")


atexit.register(_drain_at_exit)


class _Outcome:
    __slots__ = ("done", "result", "error", "phase")

    def __init__(self) -> None:
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.phase = "arrival"  # then "build"


class Formation(Generic[T]):
    """The formation of one round in this process. :meth:`cancel` may be called from any thread."""

    def __init__(self, spec: RingSpec, store: Any) -> None:
        self.spec = spec
        self._store = store
        self.deadline = time.monotonic() + spec.connect_timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._reason: str | None = None
        self._hooks: list[Callable[[str], None]] = []
        self._running = False  # a helper thread has not finished
        self._announced = False
        self._released = False  # this rank's arrival completed the barrier
        self.store_broken = False  # the store connection failed: the runtime must not reuse it
        self._finished = threading.Event()  # the helper ended
        self._abandoned = False
        self._outcome = _Outcome()
        self._job: tuple[Callable[[float], T], Callable[[list], None] | None, str] | None = None

    # ------------------------------------------------------------ cancellation
    def cancel(self, reason: str) -> None:
        """Interrupt the formation: a caller blocked in :meth:`run` (or a backend that checks
        :meth:`check`) raises CommError naming ``reason``. Idempotent; the first reason wins."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            hooks = list(self._hooks)
        self._wake.set()
        for hook in hooks:
            try:
                hook(reason)
            except Exception as exc:  # noqa: BLE001 - a hook must not stop the cancellation; logged
                _log.warning("[%s] a cancellation hook of the formation failed: %s: %s", self.spec.identity,
                             type(exc).__name__, exc)

    def on_cancel(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` when the formation is cancelled (at once if it already was)."""
        with self._lock:
            reason = self._reason
            if reason is None:
                self._hooks.append(hook)
                return
        hook(reason)

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    def check(self) -> None:
        """Raise CommError if the formation was cancelled."""
        if self._reason is not None:
            raise self.cancelled_error()

    def _check_wanted(self) -> None:
        """On the helper: raise CommError once the formation was cancelled or given up by its caller."""
        self.check()
        if self._abandoned:
            raise CommError(f"[{self.spec.identity}] the caller gave up forming round {self.spec.round_id}")

    def cancelled_error(self, detail: str = "") -> CommError:
        return CommError(f"[{self.spec.identity}] forming round {self.spec.round_id} was aborted: {self._reason}"
                         + (f"; {detail}" if detail else ""))

    @property
    def store_held(self) -> bool:
        """True while an abandoned helper may still hold the store connection (do not reuse it)."""
        with self._lock:
            return self._abandoned and self._running

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    # ------------------------------------------------------------ forming
    def run(self, build: Callable[[float], T], discard: Callable[[list], None] | None, what: str) -> T:
        """Announce this rank; on a helper thread, wait for every rank's arrival, then
        ``build(seconds_left)``; return its result.

        CommError at once when cancelled, and when the barrier or ``build`` fails or outlives the
        connect deadline. ``discard([result])`` tears down a result that comes after the caller gave up:
        the one-element list holds the only reference, which ``discard`` takes (gloo hands it to the
        reaper); it runs on the helper thread (on the caller's when the result came with the abort).
        """
        self.check()
        with self._lock:
            if self._job is not None:
                raise RuntimeError("a Formation runs one build")
            self._job = (build, discard, what)
            self._running = True
        with _running_lock:
            _running.add(self)
        try:
            self.announce()
            # A bare thread: threading.Thread.start() waits until the new thread runs, a handoff that
            # cost 0.4-0.7 ms per re-form on this 2-core machine (measured); _helper catches everything.
            _thread.start_new_thread(self._helper, ())
        except BaseException:
            self._ended()
            raise
        outcome = self._outcome
        hard_deadline = self.deadline + ABANDON_GRACE_S
        while True:
            self._wake.wait(max(0.0, hard_deadline - time.monotonic()))
            with self._lock:
                if outcome.done and self._reason is None:
                    if outcome.error is not None:
                        raise self._failed(outcome.phase, outcome.error, what)
                    result, outcome.result = outcome.result, None
                    return result
                if self._reason is None and time.monotonic() < hard_deadline:
                    continue  # only the helper or a cancellation sets the event; be safe anyway
                self._abandoned = True
                late, outcome.result = outcome.result, None  # done just as it was cancelled
                phase, error = outcome.phase, outcome.error
            if late is not None and discard is not None:
                box, late = [late], None  # the box holds the only reference: discard takes it
                self._discard(discard, box, what)
            if self._reason is not None:
                raise self._aborted(phase, what)
            raise self._timed_out(phase, what, error)

    def _helper(self) -> None:
        outcome = self._outcome
        build, discard, what = self._job  # type: ignore[misc]
        result: Any = None
        error: BaseException | None = None
        try:
            try:
                self._arrive()
                outcome.phase = "build"
                result = build(max(self.remaining_s(), 0.001))
            except Exception as exc:  # noqa: BLE001 - handed to the caller (or logged if it gave up)
                error = exc
                if isinstance(exc, dist.DistNetworkError) and outcome.phase == "arrival":
                    self.store_broken = True  # the barrier's connection failed: the next round opens another
            with self._lock:
                abandoned = self._abandoned
                if not abandoned:
                    outcome.done, outcome.result, outcome.error = True, result, error
                    result = None
        finally:
            self._ended()
        if not abandoned:
            return
        if error is not None:
            _log.debug("[%s] an abandoned %s ended with %s: %s", self.spec.identity, what, type(error).__name__, error)
        elif result is not None and discard is not None:
            _log.debug("[%s] an abandoned %s formed late; tearing it down", self.spec.identity, what)
            box, result = [result], None
            self._discard(discard, box, what)

    def _ended(self) -> None:
        with self._lock:
            self._running = False
        self._finished.set()
        with _running_lock:
            _running.discard(self)
        self._wake.set()  # last: the caller wakes to a helper that has nothing left to do under the GIL

    def _discard(self, discard: Callable[[list], None], box: list, what: str) -> None:
        try:
            discard(box)
        except Exception as exc:  # noqa: BLE001 - nobody waits for a late result: log it
            _log.warning("[%s] tearing down a late %s failed: %s: %s", self.spec.identity, what,
                         type(exc).__name__, exc)

    def interruptible_store(self) -> "_InterruptibleStore":
        """The store as the helper sees it: waits end soon after a cancellation."""
        return _InterruptibleStore(self._store, self)

    def announce(self) -> None:
        """Announce this rank's arrival in the round (idempotent; :meth:`run` does it)."""
        if not self._announced:
            try:
                self._released = announce_arrival(self._store, self.spec)
            except CommError:
                self.store_broken = True
                raise
            self._announced = True

    def _arrive(self) -> None:
        self.announce()
        if not self._released:  # the last rank to arrive has nothing to wait for
            _interruptible_wait(self._store, [all_arrived_key(self.spec)], max(self.remaining_s(), 0.001), self)

    # ------------------------------------------------------------ errors
    def _missing(self) -> str:
        """``"; ranks [2] had not arrived"``, learnt on a fresh connection within DIAGNOSE_S, or ``""``."""
        spec = self.spec
        found: list[list[int]] = []

        def probe() -> None:
            raw = getattr(self._store, "inner", self._store)
            clone = getattr(raw, "clone", None)
            if clone is None:
                return
            conn = clone()
            conn.set_timeout(datetime.timedelta(seconds=DIAGNOSE_S))
            found.append(absent_ranks(conn, spec, MAX_NAMED + 1))

        def guarded() -> None:
            try:
                probe()
            except Exception as exc:  # noqa: BLE001 - only a diagnosis: the error is raised without it
                _log.debug("[%s] could not learn which ranks arrived: %s: %s", spec.identity, type(exc).__name__, exc)

        thread = threading.Thread(target=guarded, name="elastic-ring-form-probe", daemon=True)
        thread.start()
        thread.join(DIAGNOSE_S)
        if not found:
            return ""
        missing = found[0]
        if not missing:
            return f"; all {spec.world_size} ranks had arrived"
        named = ", ".join(map(str, missing[:MAX_NAMED])) + (", ..." if len(missing) > MAX_NAMED else "")
        return f"; rank(s) {named} of {spec.world_size} had not arrived"

    def _aborted(self, phase: str, what: str) -> CommError:
        if phase == "build":
            return self.cancelled_error(f"every rank had arrived; the {what} was abandoned")
        return self.cancelled_error(self._missing().lstrip("; "))

    def _timed_out(self, phase: str, what: str, error: BaseException | None) -> CommError:
        spec = self.spec
        where = "in the arrival barrier" if phase == "arrival" else f"building the {what}"
        cause = f": {type(error).__name__}: {error}" if error is not None else ""
        return CommError(f"[{spec.identity}] could not form round {spec.round_id} within connect_timeout_s="
                         f"{spec.connect_timeout_s} ({where}, abandoned){cause}{self._missing()}")

    def _failed(self, phase: str, error: BaseException, what: str) -> CommError:
        spec = self.spec
        if isinstance(error, CommError):
            return error
        if phase == "arrival":
            return CommError(f"[{spec.identity}] could not form round {spec.round_id} within connect_timeout_s="
                             f"{spec.connect_timeout_s}: {type(error).__name__}: {_first_line(error)}"
                             f"{self._missing()}")
        return CommError(f"[{spec.identity}] could not form the {what} of round {spec.round_id} within "
                         f"connect_timeout_s={spec.connect_timeout_s}: {type(error).__name__}: {_first_line(error)}")


def _interruptible_wait(store: Any, keys: Sequence[str], timeout_s: float, formation: Formation) -> None:
    """``store.wait(keys)`` within ``timeout_s``: natively for up to BLOCKING_WAIT_S, then by polling
    ``check`` (a timed-out native wait prints C++ warnings; a poll does not), raising CommError once
    ``formation`` is cancelled or given up, and DistStoreError at the deadline."""
    keys = list(keys)
    deadline = time.monotonic() + timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=min(timeout_s, BLOCKING_WAIT_S)))
        return
    except dist.DistStoreError:
        if timeout_s <= BLOCKING_WAIT_S:
            raise
    while not store.check(keys):
        formation._check_wanted()
        left = deadline - time.monotonic()
        if left <= 0:
            raise dist.DistStoreError(f"wait timeout after {timeout_s:g} s, keys: {', '.join(keys)}")
        time.sleep(min(POLL_S, left))


class _InterruptibleStore(dist.Store):
    """What the backend's own rendezvous (gloo's address exchange: set, wait, get) reads through:
    the wrapped store, with waits that end once the formation is cancelled (:func:`_interruptible_wait`)."""

    def __init__(self, store: Any, formation: Formation) -> None:
        super().__init__()
        self._inner = store
        self._formation = formation

    def set(self, key: str, value: str | bytes) -> None:
        self._formation._check_wanted()
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._formation._check_wanted()
        return self._inner.get(key)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._formation._check_wanted()
        if timeout is None or timeout.total_seconds() <= 0:  # c10d's kNoTimeout is zero: the store's own
            timeout = self._inner.timeout
        timeout_s = timeout.total_seconds()
        _interruptible_wait(self._inner, keys, timeout_s, self._formation)

    def check(self, keys: Sequence[str]) -> bool:
        return self._inner.check(list(keys))

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout
