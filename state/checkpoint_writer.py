"""Writes checkpoints in a background thread: training never waits, at most one write in flight.

``submit(source)`` asks for a write of what ``source()`` returns, a ``(tree, meta)`` pair. The
source is called in the submitting thread when the writer is idle (at once, or at the next
``poll()``, ``flush()``) and its tree is copied into the writer's own host buffers, reused from one
write to the next; a request made while a write is in flight replaces any older waiting one, so
the newest state is always the one written and host memory holds one copy of the state at most.

Nothing is lost silently: every exception of a write is captured, becomes a
``checkpoint_failed`` event (and a ``checkpoint_written`` event on success) passed to the listener
installed with :func:`set_checkpoint_listener`, and ``flush()`` raises if the last write failed.
After ``max_consecutive_failures`` failed writes in a row, :meth:`BackgroundWriter.check` (called
at every commit) raises with the cause and the fix. ``flush()`` always has a deadline.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable

from elastic_ring.log import get_logger

from .checkpoint_errors import CheckpointError, CheckpointPruneError
from .checkpoint_policy import DEFAULT_MAX_CONSECUTIVE_FAILURES
from .checkpoint_store import CheckpointStore
from .snapshot import SnapshotBuffer

_log = get_logger(__name__)

#: Seconds ``flush()`` waits by default before raising.
DEFAULT_FLUSH_TIMEOUT_S = 300.0
#: Seconds the interpreter's exit waits for pending writes.
EXIT_FLUSH_TIMEOUT_S = 60.0

Source = Callable[[], "tuple[Any, dict]"]

_listener: Callable[[dict], None] | None = None
_writers: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


def set_checkpoint_listener(listener: Callable[[dict], None] | None) -> None:
    """Call ``listener(event)`` from the writer thread after every checkpoint write of this process.

    ``event`` is JSON-plain: ``{"kind": "checkpoint_written", "uri", "seq", "commits", "bytes", "seconds",
    "consecutive_failures": 0, "prune_error"}`` or ``{"kind": "checkpoint_failed", "uri" (the location),
    "seq" (None if none was claimed), "commits", "error", "consecutive_failures"}``. A listener that raises
    is reported by the next ``commit()``."""
    global _listener
    if listener is not None and not callable(listener):
        raise TypeError(f"set_checkpoint_listener expects a function of one event dict or None, got {listener!r}")
    _listener = listener


class BackgroundWriter:
    def __init__(self, store: CheckpointStore, max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        if isinstance(max_consecutive_failures, bool) or not isinstance(max_consecutive_failures, int) \
                or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures={max_consecutive_failures!r} must be an int >= 1")
        self.store = store
        self.max_consecutive_failures = max_consecutive_failures
        self._cond = threading.Condition()
        self._buffer = SnapshotBuffer()
        self._waiting: tuple[Source, threading.Thread] | None = None  # a request and the thread that made it
        self._busy = False
        self._thread: threading.Thread | None = None
        self._last_ok: bool | None = None
        self._last_error: BaseException | None = None
        self._listener_error: BaseException | None = None
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
            self._waiting = (source, threading.current_thread())
        self.poll()

    def poll(self) -> bool:
        """Start the waiting request if the writer is idle (call from the submitting thread); True if started."""
        with self._cond:
            if self._busy or self._waiting is None or not self._startable():
                return False  # a request of a thread still committing into its buffers: that thread starts it
            source, _ = self._waiting
            self._waiting = None
            self._busy = True
        try:
            tree, meta = source()
            item = (self._buffer.take(tree), dict(meta))
        except BaseException as exc:  # a bad source or an uncopyable value: an event, like a failed write
            self._failed(exc, None, {})
            self._finish()
            if not isinstance(exc, Exception):
                raise
            return False
        thread = threading.Thread(target=self._run, args=item, name="elastic-ring-checkpoint-writer", daemon=True)
        with self._cond:
            self._thread = thread
        try:
            thread.start()
        except BaseException as exc:  # no thread (resources exhausted): a failed write, not a stuck writer
            self._failed(exc, None, item[1])
            self._finish()
            raise
        return True

    def check(self) -> None:
        """Raise :class:`CheckpointError` after ``max_consecutive_failures`` failed writes in a row, or if
        the event listener raised (called at every commit)."""
        with self._cond:
            listener_error, self._listener_error = self._listener_error, None
            failures, error = self.consecutive_failures, self._last_error
        if listener_error is not None:
            raise CheckpointError(f"the checkpoint event listener raised {type(listener_error).__name__}: "
                                  f"{listener_error}") from listener_error
        if failures >= self.max_consecutive_failures:
            raise CheckpointError(
                f"{failures} checkpoint writes in a row to {self.store.uri} failed; the last: {error}. Training stops "
                "rather than go on without durable checkpoints: fix the cause (space, permissions, credentials, "
                "values the state cannot save), or set another checkpoint_uri, then run again to resume from the "
                "newest valid checkpoint") from error

    def flush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
        """Write what is waiting and wait for it; return the newest URI written (None if none).

        Raises :class:`CheckpointError` if the last write failed, or if writes are still in flight after
        ``timeout_s`` seconds (None waits without limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll()
            with self._cond:
                if not self._busy and self._waiting is None:
                    break
                if not self._busy and self._startable():
                    continue
                remaining = _remaining(deadline)
                if remaining == 0:
                    newest = self.written[-1] if self.written else "none yet"
                    raise CheckpointError(f"checkpoint writes to {self.store.uri} did not finish within {timeout_s} s "
                                          f"(storage slow or hanging?); the newest written checkpoint: {newest}")
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
        with self._cond:
            if self._last_ok is False:
                raise CheckpointError(f"the last checkpoint write failed: {self._last_error}") from self._last_error
            return self.written[-1] if self.written else None

    def _startable(self) -> bool:
        if self._waiting is None:
            return False
        owner = self._waiting[1]
        return owner is threading.current_thread() or not owner.is_alive()

    # ------------------------------------------------------------ writer thread
    def _run(self, tree: Any, meta: dict) -> None:
        started = time.monotonic()
        try:
            uri, prune_error = self._save(tree, meta)
            with self._cond:
                self.written.append(uri)
                self.last_written_at = time.monotonic()
                self.consecutive_failures, self._last_ok, self._last_error = 0, True, None
            _log.info("checkpoint written: %s", uri)
            self._emit({"kind": "checkpoint_written", "uri": uri, "seq": _seq_of(uri), "commits": meta.get("commits"),
                        "bytes": self._buffer.nbytes, "seconds": round(time.monotonic() - started, 3),
                        "consecutive_failures": 0, "prune_error": prune_error})
        except BaseException as exc:  # every error, of any class, becomes an event and flush()'s error
            self._failed(exc, getattr(exc, "seq", None), meta)
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

    def _failed(self, exc: BaseException, seq: int | None, meta: dict) -> None:
        with self._cond:
            self.consecutive_failures += 1
            self._last_ok, self._last_error = False, exc
            failures = self.consecutive_failures
        message = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        _log.error("checkpoint write %d in a row failed: %s", failures, message)
        self._emit({"kind": "checkpoint_failed", "uri": self.store.uri, "seq": seq, "commits": meta.get("commits"),
                    "error": message, "consecutive_failures": failures})

    def _emit(self, event: dict) -> None:
        with self._cond:
            self.events.append(event)
            del self.events[:-100]
        listener = _listener
        if listener is None:
            return
        try:
            listener(dict(event))
        except Exception as exc:  # reported at the next commit by check()
            _log.error("the checkpoint event listener raised %s: %s", type(exc).__name__, exc)
            with self._cond:
                self._listener_error = exc


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _seq_of(uri: str) -> int | None:
    tail = uri.rstrip("/").rsplit("ckpt-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def flush_checkpoints(timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
    """Flush every live checkpoint writer of this process within ``timeout_s`` seconds in all.

    Call it from the thread that commits, or once training stopped (before a worker returns or
    leaves a draining node). Returns the newest checkpoint URI written (None if none); raises
    :class:`CheckpointError` if a writer's last write failed or writes are still in flight at the
    deadline (naming the location)."""
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
    if errors:
        raise CheckpointError("; ".join(str(e) for e in errors)) from errors[0]
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
