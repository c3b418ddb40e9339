"""Writes checkpoints in a background thread: training never waits, at most one write in flight.

``submit(source)`` asks for a write of what ``source()`` returns, a ``(tree, meta)`` pair. The
source is called in the submitting thread when the writer is idle (at once, or at the next
``poll()``, ``flush()``) and its tree is copied into the writer's own host buffers, reused from one
write to the next; a request made while a write is in flight replaces any older waiting one, so
the newest state is always the one written, host memory holds one copy of the state at most, and
slow storage makes the writer skip states, never queue them.

A write that fails with a transient storage error (:func:`~state.checkpoint_errors.is_transient`:
a full disk, an I/O error, a timeout...) is retried with backoff for ``retry_budget_s`` after its
first error; slowness alone is never a failure. Nothing is lost silently: every exception of a
write is captured, becomes a ``checkpoint_failed`` event (and a ``checkpoint_written`` event on
success) passed to the listener installed with :func:`set_checkpoint_listener`, and ``flush()``
retries a transiently failed last write until its deadline, then raises. After
``max_consecutive_failures`` failed writes in a row, :meth:`BackgroundWriter.check` (called at
every commit) raises with the cause and the fix. ``flush()`` always has a deadline.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable

from elastic_ring.core.log import get_logger

from .checkpoint_errors import CheckpointError, CheckpointPruneError, is_transient
from .checkpoint_errors import describe as _describe
from .checkpoint_policy import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES, DEFAULT_WRITE_RETRY_S, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S, backoff_delay,
    check_retry_budget,
)
from .checkpoint_store import CheckpointStore
from .snapshot import SnapshotBuffer

_log = get_logger(__name__)

#: Seconds ``flush()`` waits by default before raising.
DEFAULT_FLUSH_TIMEOUT_S = 300.0
#: Seconds the interpreter's exit waits for pending writes.
EXIT_FLUSH_TIMEOUT_S = 60.0
#: A write in flight this long is logged as slow by ``check()`` (once per write; it is not a failure).
SLOW_WRITE_WARN_S = 120.0

Source = Callable[[], "tuple[Any, dict]"]

_listener: Callable[[dict], None] | None = None
_writers: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()
#: Other background checkpoint writes of this process (the reported checkpoints' uploads): called by
#: :func:`flush_checkpoints` and at exit with the seconds left (None: no limit), each returns its errors.
_flush_hooks: "list[Callable[[float | None], list[CheckpointError]]]" = []


def register_flush_hook(hook: Callable[[float | None], "list[CheckpointError]"]) -> None:
    """Make :func:`flush_checkpoints` (and the exit's flush) also call ``hook(seconds_left)``, which waits for
    other background checkpoint writes and returns their errors (``state.reported_uploads`` registers one)."""
    if not callable(hook):
        raise TypeError(f"register_flush_hook expects a function of the seconds left, got {hook!r}")
    if hook not in _flush_hooks:
        _flush_hooks.append(hook)


def set_checkpoint_listener(listener: Callable[[dict], None] | None) -> None:
    """Call ``listener(event)`` from the writer thread after every checkpoint write of this process.

    ``event`` is JSON-plain: ``{"kind": "checkpoint_written", "uri", "seq", "commits", "bytes", "seconds",
    "attempts", "superseded", "consecutive_failures": 0, "prune_error"}`` or ``{"kind": "checkpoint_failed",
    "uri" (the location), "seq" (None if none was claimed), "commits", "error", "attempts", "transient",
    "retried_s", "failing_s", "consecutive_failures"}``. A listener that raises is reported by the next
    ``commit()``."""
    global _listener
    if listener is not None and not callable(listener):
        raise TypeError(f"set_checkpoint_listener expects a function of one event dict or None, got {listener!r}")
    _listener = listener


class BackgroundWriter:
    """Writes ``store``'s checkpoints in a thread. ``retry_budget_s``: how long a write failing with
    transient storage errors is retried after its first one (0: never); ``max_consecutive_failures``:
    failed writes in a row after which :meth:`check` raises."""

    def __init__(self, store: CheckpointStore, max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES, *,
                 retry_budget_s: float = DEFAULT_WRITE_RETRY_S) -> None:
        if isinstance(max_consecutive_failures, bool) or not isinstance(max_consecutive_failures, int) \
                or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures={max_consecutive_failures!r} must be an int >= 1")
        self.store = store
        self.max_consecutive_failures = max_consecutive_failures
        self.retry_budget_s = check_retry_budget(retry_budget_s)
        self._cond = threading.Condition()
        self._buffer = SnapshotBuffer()
        self._waiting: tuple[Source, threading.Thread] | None = None  # a request and the thread that made it
        self._busy = False
        self._thread: threading.Thread | None = None
        self._last_ok: bool | None = None
        self._last_error: BaseException | None = None
        self._listener_error: BaseException | None = None
        self._retry_item: tuple[Any, dict] | None = None  # the last write (in the buffer) if it failed transiently
        self._in_flight: dict = {}  # the write in flight: started, attempts, last error, warned
        self._failing_since: float | None = None  # the first failed attempt of the current run of failures
        self._superseded = 0
        self.consecutive_failures = 0
        self.written: list[str] = []
        self.last_written_at = 0.0
        self.events: list[dict] = []
        _writers.add(self)

    # ------------------------------------------------------------ training thread
    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, source: Source) -> None:
        """Ask for a write of ``source()``; starts at once if idle, else replaces the waiting request."""
        if not callable(source):
            raise TypeError(f"submit expects a function returning (tree, meta), got {type(source).__name__}")
        with self._cond:
            if self._waiting is not None:
                self._superseded += 1  # slow storage: the older state is skipped, never queued
            self._waiting = (source, threading.current_thread())
        self.poll()

    def poll(self) -> bool:
        """Start the waiting request if the writer is idle (call from the submitting thread); True if started."""
        with self._cond:
            if self._busy or self._waiting is None or not self._startable():
                return False  # a request of a thread still committing into its buffers: that thread starts it
            source, _ = self._waiting
            self._waiting, self._busy, self._retry_item = None, True, None
        try:
            tree, meta = source()
            item = (self._buffer.take(tree), dict(meta))
        except BaseException as exc:  # a bad source or an uncopyable value: an event, like a failed write
            self._failed(exc, None, {}, attempts=1, transient=False, retried_s=0.0)
            self._finish()
            if not isinstance(exc, Exception):
                raise
            return False
        self._start(item, None)
        return True

    def _start(self, item: tuple[Any, dict], deadline: float | None) -> None:
        """Write ``item`` in a new thread (the caller set ``_busy``); retries end at ``deadline`` if given."""
        thread = threading.Thread(target=self._run, args=(*item, deadline), name="elastic-ring-checkpoint-writer",
                                  daemon=True)
        with self._cond:
            self._thread = thread
            self._in_flight = {"started": time.monotonic(), "attempts": 1, "error": None, "warned": False}
        try:
            thread.start()
        except BaseException as exc:  # no thread (resources exhausted): a failed write, not a stuck writer
            self._failed(exc, None, item[1], attempts=1, transient=False, retried_s=0.0)
            self._finish()
            raise

    def check(self) -> None:
        """Raise :class:`CheckpointError` after ``max_consecutive_failures`` failed writes in a row, or if
        the event listener raised (called at every commit). Logs a write in flight for over
        :data:`SLOW_WRITE_WARN_S` (slow storage is not a failure)."""
        with self._cond:
            listener_error, self._listener_error = self._listener_error, None
            failures, error = self.consecutive_failures, self._last_error
            failing_s = 0.0 if self._failing_since is None else time.monotonic() - self._failing_since
            flight = self._in_flight if self._busy else {}
            slow = flight and not flight["warned"] and time.monotonic() - flight["started"] > SLOW_WRITE_WARN_S
            if slow:
                flight["warned"] = True
        if slow:
            _log.warning("a checkpoint write to %s has been in flight for %.0f s (attempt %d): storage slow or "
                         "hanging? Training goes on; newer states replace each other until it ends", self.store.uri,
                         time.monotonic() - flight["started"], flight["attempts"])
        if listener_error is not None:
            raise CheckpointError(f"the checkpoint event listener raised {type(listener_error).__name__}: "
                                  f"{listener_error}") from listener_error
        if failures >= self.max_consecutive_failures:
            retried = (f"each write was retried for up to {self.retry_budget_s:g} s, and writes have failed for "
                       f"{failing_s:.0f} s" if is_transient(error) else "this error is not retried: it does not go "
                       "away by itself")
            raise CheckpointError(
                f"{failures} checkpoint writes in a row to {self.store.uri} failed; the last: {error} ({retried}). "
                "Training stops rather than go on without durable checkpoints: fix the cause (space, permissions, "
                "credentials, values the state cannot save), or set another checkpoint_uri, then run again to resume "
                f"from the newest valid checkpoint ({self.written[-1] if self.written else 'none written by this run'})"
            ) from error

    def flush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
        """Write what is waiting and wait for it; return the newest URI written (None if none).

        If the last write failed with a transient error, it is written again, retried with backoff until
        the deadline (``retry_budget_s`` when ``timeout_s`` is None). Raises :class:`CheckpointError` if
        the last write failed, or if a write is still in flight after ``timeout_s`` seconds (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        retried = False
        while True:
            self.poll()
            with self._cond:
                if not self._busy and self._waiting is None:
                    item = self._retry_item if self._last_ok is False and not retried else None
                    if item is None or _remaining(deadline) == 0:
                        break
                    self._retry_item, self._busy, retried = None, True, True
                else:
                    item = None
                    if not self._busy and self._startable():
                        continue
                    remaining = _remaining(deadline)
                    if remaining == 0:
                        raise CheckpointError(self._late_message(timeout_s))
                    self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            if item is not None:
                _log.warning("flush: writing the failed checkpoint again to %s, retrying until the deadline",
                             self.store.uri)
                self._start(item, deadline if deadline is not None else time.monotonic() + self.retry_budget_s)
        with self._cond:
            if self._last_ok is False:
                raise CheckpointError(f"the last checkpoint write failed: {self._last_error}") from self._last_error
            return self.written[-1] if self.written else None

    def _late_message(self, timeout_s: float | None) -> str:
        newest = self.written[-1] if self.written else "none yet"
        flight, now = self._in_flight, time.monotonic()
        doing = ""
        if self._busy and flight:
            doing = f"; the write in flight started {now - flight['started']:.1f} s ago, attempt {flight['attempts']}"
            if flight["error"] is not None:
                doing += f", retrying after {flight['error']}"
        within = "no limit" if timeout_s is None else f"{timeout_s:.1f} s"
        return (f"checkpoint writes to {self.store.uri} did not finish within {within} (storage slow or hanging?)"
                f"{doing}; the newest written checkpoint: {newest}")

    def _startable(self) -> bool:
        if self._waiting is None:
            return False
        owner = self._waiting[1]
        return owner is threading.current_thread() or not owner.is_alive()

    # ------------------------------------------------------------ writer thread
    def _run(self, tree: Any, meta: dict, deadline: float | None) -> None:
        started, attempts, first_failure, seq = time.monotonic(), 0, None, None
        try:
            while True:
                attempts += 1
                with self._cond:
                    self._in_flight["attempts"] = attempts
                try:
                    uri, prune_error = self._save(tree, meta)
                    break
                except Exception as exc:  # retried if transient and within budget; else the write failed
                    seq = getattr(exc, "seq", None)
                    now = time.monotonic()
                    first_failure = now if first_failure is None else first_failure
                    # a flush's deadline: the last attempt starts early enough to end before it on a failing disk
                    limit = first_failure + self.retry_budget_s if deadline is None else deadline - WRITE_RETRY_FIRST_S
                    delay = min(backoff_delay(attempts, WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S), limit - now)
                    transient = is_transient(exc)
                    if not transient or delay < WRITE_RETRY_FIRST_S:  # not worth it, or the budget is spent
                        self._failed(exc, seq, meta, attempts=attempts, transient=transient,
                                     retried_s=now - first_failure, item=(tree, meta) if transient else None,
                                     first_failure=first_failure)
                        return
                    with self._cond:
                        self._in_flight["error"] = _describe(exc)
                    _log.warning("checkpoint write to %s, attempt %d, failed (%s); retrying in %.1f s (for %.1f s "
                                 "more)", self.store.uri, attempts, _describe(exc), delay, limit - now)
                    time.sleep(delay)
            with self._cond:
                self.written.append(uri)
                self.last_written_at = time.monotonic()
                self.consecutive_failures, self._last_ok, self._last_error = 0, True, None
                self._failing_since, superseded, self._superseded = None, self._superseded, 0
            _log.info("checkpoint written: %s%s", uri, f" (attempt {attempts})" if attempts > 1 else "")
            self._emit({"kind": "checkpoint_written", "uri": uri, "seq": _seq_of(uri), "commits": meta.get("commits"),
                        "bytes": self._buffer.nbytes, "seconds": round(time.monotonic() - started, 3),
                        "attempts": attempts, "superseded": superseded, "consecutive_failures": 0,
                        "prune_error": prune_error})
        except BaseException as exc:  # every error, of any class, becomes an event and flush()'s error
            self._failed(exc, seq, meta, attempts=max(attempts, 1), transient=False,
                         retried_s=0.0 if first_failure is None else time.monotonic() - first_failure)
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _save(self, tree: Any, meta: dict) -> tuple[str, str | None]:
        try:
            return self.store.save(tree, meta), None
        except CheckpointPruneError as exc:  # written and verified; the pruning is reported with the event
            _log.error("%s", exc)
            return exc.uri, str(exc)

    def _failed(self, exc: BaseException, seq: int | None, meta: dict, *, attempts: int, transient: bool,
                retried_s: float, item: tuple[Any, dict] | None = None, first_failure: float | None = None) -> None:
        with self._cond:
            self.consecutive_failures += 1
            self._last_ok, self._last_error, self._retry_item = False, exc, item
            if self._failing_since is None:
                self._failing_since = time.monotonic() if first_failure is None else first_failure
            failures, failing_s = self.consecutive_failures, time.monotonic() - self._failing_since
        message = _describe(exc)
        _log.error("checkpoint write %d in a row failed after %d attempt(s) over %.1f s: %s", failures, attempts,
                   retried_s, message)
        self._emit({"kind": "checkpoint_failed", "uri": self.store.uri, "seq": seq, "commits": meta.get("commits"),
                    "error": message, "attempts": attempts, "transient": transient, "retried_s": round(retried_s, 3),
                    "failing_s": round(failing_s, 3), "consecutive_failures": failures})

    def _emit(self, event: dict) -> None:
        with self._cond:
            self.events.append(event)
            del self.events[:-100]
        listener = _listener
        if listener is None:
            return
        try:
            listener(dict(event))
        except BaseException as exc:  # of any class (a sys.exit too): reported at the next commit by check()
            _log.error("the checkpoint event listener raised %s: %s", type(exc).__name__, exc)
            with self._cond:
                self._listener_error = exc


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _seq_of(uri: str) -> int | None:
    tail = uri.rstrip("/").rsplit("ckpt-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def flush_checkpoints(timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
    """Flush every live checkpoint writer of this process, and the reported checkpoints' uploads, within
    ``timeout_s`` seconds in all.

    Call it from the thread that commits, or once training stopped (before a worker returns or
    leaves a draining node). A last write that failed with a transient storage error is written
    again, retried with backoff until the deadline. Returns the newest checkpoint URI written (None
    if none); raises :class:`CheckpointError` if a writer's last write still failed, or writes are
    still in flight at the deadline (naming the location, the error and the newest checkpoint)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
        raise ValueError(f"flush_checkpoints timeout_s={timeout_s!r} must be a number of seconds >= 0")
    deadline = time.monotonic() + timeout_s
    newest: tuple[float, str] | None = None
    errors = []
    for writer in list(_writers):
        try:
            uri = writer.flush(_remaining(deadline))
        except CheckpointError as exc:
            errors.append(exc)
            continue
        if uri is not None and (newest is None or writer.last_written_at > newest[0]):
            newest = (writer.last_written_at, uri)
    for hook in list(_flush_hooks):
        errors.extend(hook(_remaining(deadline)))
    if errors:
        raise CheckpointError(f"the final checkpoint flush (within {timeout_s:g} s) failed: "
                              + "; ".join(str(e) for e in errors)) from errors[0]
    return newest[1] if newest is not None else None


@atexit.register
def _flush_at_exit() -> None:
    """Writes still waiting or in flight when the interpreter exits get a bounded chance to finish."""
    deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT_S
    for writer in [w for w in list(_writers) if w.busy or w._waiting is not None]:
        try:
            writer.flush(_remaining(deadline))
        except CheckpointError as exc:
            _log.error("at exit: %s", exc)
    for hook in list(_flush_hooks):
        for exc in hook(_remaining(deadline)):
            _log.error("at exit: %s", exc)
