"""The NCCL watchdog: one daemon thread per process that keeps every collective's deadline.

A collective is registered when it is launched (:meth:`Watchdog.watch`) with
its deadline, a ``done()`` probe (its CUDA event's ``query``) and its
communicator (the *target*). Every ``interval_s`` the thread polls each
watched operation:

* ``done()`` is true: the operation is forgotten;
* the target reports an asynchronous NCCL error (a peer closed its socket, a
  CUDA error), or the deadline has passed: the target is failed with a
  :class:`CommError` that names the operation and its deadline. Failing the
  target aborts its NCCL communicator: the NCCL kernels exit, so every host
  call blocked behind them returns -- ``Work.wait()``'s event wait,
  ``torch.cuda.synchronize()`` (e.g. in a state snapshot), an allocator retry.
  The target's next ``Work.wait()`` or collective then raises the CommError.

Anything the probes raise fails the target too (with that exception in the
message). If the thread itself ever dies, it fails every target it watches
first, and :meth:`watch` refuses new work from then on: nobody is left waiting
on a deadline that nobody keeps.

The logic lives in :meth:`Watchdog.poll_once` with an injectable clock, so it
is tested deterministically on CPU with fake targets and probes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ...core.constants import NCCL_WATCHDOG_INTERVAL_S
from ...core.errors import CommError
from ...core.log import get_logger

_log = get_logger(__name__)

#: How often the thread polls. A deadline is kept to within this; an async
#: error is seen within this. Modest on purpose: it runs beside training.
WATCHDOG_INTERVAL_S = NCCL_WATCHDOG_INTERVAL_S


class WatchTarget(Protocol):
    """What the watchdog needs from a communicator."""

    @property
    def identity(self) -> str: ...

    def async_error(self) -> str | None:
        """A description of an asynchronous error of the communicator, or None while healthy."""

    def watchdog_failed(self, error: CommError) -> None:
        """Record ``error`` as the communicator's failure and abort it (idempotent, never blocks on a peer)."""


@dataclass
class Watched:
    """One operation in flight."""

    target: WatchTarget
    op: str
    done: Callable[[], bool]
    timeout_s: float
    deadline: float
    finished: bool = field(default=False)


class Watchdog:
    def __init__(self, interval_s: float = WATCHDOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 name: str = "elastic-ring-nccl-watchdog") -> None:
        if not interval_s > 0:
            raise ValueError(f"Watchdog interval_s={interval_s!r} must be > 0 seconds")
        self._interval_s, self._clock, self._name = interval_s, clock, name
        self._lock = threading.Lock()
        self._watched: list[Watched] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.crash: BaseException | None = None
        #: Exceptions raised while failing a target (they never stop the thread); newest last.
        self.errors: list[BaseException] = []

    # ------------------------------------------------------------ registration
    def watch(self, target: WatchTarget, op: str, done: Callable[[], bool], timeout_s: float) -> Watched:
        """Keep ``op``'s deadline (``timeout_s`` from now) until ``done()`` is true."""
        if self.crash is not None:
            raise CommError(f"[{target.identity}] the NCCL watchdog thread died earlier ({self.crash!r}); "
                            "no collective can run without it: restart the worker process")
        entry = Watched(target, op, done, timeout_s, self._clock() + timeout_s)
        with self._lock:
            self._watched.append(entry)
        return entry

    def forget(self, target: WatchTarget) -> None:
        """Stop watching every operation of ``target`` (it was aborted or closed)."""
        with self._lock:
            self._watched = [w for w in self._watched if w.target is not target]

    def pending(self, target: WatchTarget | None = None) -> int:
        with self._lock:
            return sum(1 for w in self._watched if target is None or w.target is target)

    # ------------------------------------------------------------ the logic
    def poll_once(self) -> None:
        """One pass over the watched operations (the thread calls this every interval)."""
        with self._lock:
            watched = list(self._watched)
        failures: dict[int, tuple[WatchTarget, CommError]] = {}
        now = self._clock()
        for w in watched:
            if id(w.target) not in failures:
                error = self._check(w, now)
                if error is not None:
                    failures[id(w.target)] = (w.target, error)
        for target, error in failures.values():
            self._fail(target, error)
        with self._lock:
            self._watched = [w for w in self._watched if not w.finished and id(w.target) not in failures]

    def _check(self, w: Watched, now: float) -> CommError | None:
        who = f"[{w.target.identity}] NCCL {w.op}"
        try:
            if w.done():
                w.finished = True
                return None
            problem = w.target.async_error()
        except Exception as exc:  # a CUDA error from the event, or NCCL's: fail the communicator with it
            return CommError(f"{who} failed while the watchdog checked it: {type(exc).__name__}: {exc}")
        if problem is not None:
            return CommError(f"{who} failed: NCCL reported an asynchronous error ({problem}); a peer is probably "
                             "lost; the watchdog aborted the communicator")
        if now > w.deadline:
            late = now - w.deadline
            return CommError(f"{who} did not finish within collective_timeout_s={w.timeout_s:g} (deadline passed "
                             f"{late:.2f} s ago); a peer is probably lost or stopped; the watchdog aborted the "
                             "communicator")
        return None

    def _fail(self, target: WatchTarget, error: CommError) -> None:
        _log.warning("%s", error)
        try:
            target.watchdog_failed(error)
        except Exception as exc:  # kept and logged; the thread goes on watching the others
            self.errors.append(exc)
            _log.error("[%s] aborting the NCCL communicator failed: %r", target.identity, exc)

    # ------------------------------------------------------------ the thread
    def ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                if self.crash is not None:
                    raise CommError(f"the NCCL watchdog thread died earlier ({self.crash!r})")
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"the NCCL watchdog thread did not stop within {timeout_s} s")

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                self.poll_once()
        except BaseException as exc:  # the thread dies: fail everything it watched, so no wait is left hanging
            self.crash = exc
            _log.error("the NCCL watchdog thread died: %r", exc)
            with self._lock:
                watched, self._watched = self._watched, []
            targets = {id(w.target): w.target for w in watched}
            for target in targets.values():
                self._fail(target, CommError(f"[{target.identity}] the NCCL watchdog thread died ({exc!r}); "
                                             "the communicator was aborted"))
            if not isinstance(exc, Exception):
                raise


class OrderedWatch:
    """One watchdog entry for operations launched one after the other on one stream (a step's gradient buckets),
    instead of one entry, and its lock, per operation: they complete in order, so the last launched is the one to
    watch. :meth:`launched` hands it over; while the entry lives, that only moves its ``done`` probe to the new
    operation and its deadline to ``timeout_s`` from now. Once the watchdog saw the last one complete (the entry
    is forgotten), the next launch registers a new entry. The probe and the hand-over share a lock, so an
    operation launched while the watchdog drops the entry is never left unwatched."""

    def __init__(self, watchdog: Watchdog, target: WatchTarget, op: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._watchdog, self._target, self._op, self._timeout_s, self._clock = watchdog, target, op, timeout_s, clock
        self._lock = threading.Lock()
        self._done: Callable[[], bool] | None = None
        self._entry: Watched | None = None
        #: entries registered so far (tests and benchmarks read it)
        self.registrations = 0

    def launched(self, done: Callable[[], bool]) -> None:
        """An operation was launched after every earlier one; ``done()`` says whether it completed."""
        with self._lock:
            self._done = done
            entry = self._entry
            if entry is None:
                self.registrations += 1
                self._entry = self._watchdog.watch(self._target, self._op, self._probe, self._timeout_s)
            else:
                entry.deadline = self._clock() + self._timeout_s

    def _probe(self) -> bool:
        with self._lock:
            if self._done is None or self._done():
                self._entry = None  # the watchdog forgets it now: the next launch registers anew
                return True
            return False


_process_watchdog: Watchdog | None = None
_process_lock = threading.Lock()


def process_watchdog() -> Watchdog:
    """The process's watchdog, started on first use."""
    global _process_watchdog
    with _process_lock:
        if _process_watchdog is None:
            _process_watchdog = Watchdog()
        watchdog = _process_watchdog
    watchdog.ensure_running()
    return watchdog
