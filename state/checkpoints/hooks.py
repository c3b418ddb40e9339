"""This process's checkpoint writers, seen together: the listener every write reports to
(:func:`set_checkpoint_listener`), :func:`flush_checkpoints`, and the bounded flush at the interpreter's exit.
Every :class:`~state.checkpoints.background.BackgroundWriter` registers here when it is made."""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any, Callable

from elastic_ring.core.log import get_logger

from ..errors import CheckpointError

_log = get_logger(__name__)

#: Seconds ``flush()`` waits by default before raising.
DEFAULT_FLUSH_TIMEOUT_S = 300.0
#: Seconds the interpreter's exit waits for pending writes.
EXIT_FLUSH_TIMEOUT_S = 60.0

_listener: Callable[[dict], None] | None = None
_writers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def set_checkpoint_listener(listener: Callable[[dict], None] | None) -> None:
    """Call ``listener(event)`` from the writer thread after every checkpoint write of this process.

    ``event`` is JSON-plain: ``{"kind": "checkpoint_written", "uri", "seq", "commits", "bytes", "seconds",
    "attempts", "superseded", "consecutive_failures": 0, "prune_error"}`` or ``{"kind": "checkpoint_failed", "uri"
    (the location), "seq" (None if none was claimed), "commits", "error", "attempts", "transient", "retried_s",
    "failing_s", "consecutive_failures"}``; a reported checkpoint's: ``"reported_checkpoint_written"`` (the files'
    URL, no ``commits``), or ``"checkpoint_failed"`` with ``"reported": True, "seq": None``. A listener that
    raises is reported by the next ``check()`` (``commit()``)."""
    global _listener
    if listener is not None and not callable(listener):
        raise TypeError(f"set_checkpoint_listener expects a function of one event dict or None, got {listener!r}")
    _listener = listener


def listener() -> Callable[[dict], None] | None:
    """The listener of :func:`set_checkpoint_listener`, or None."""
    return _listener


def register(writer: Any) -> None:
    """Count ``writer`` among this process's writers (held weakly: a writer nobody holds is gone)."""
    _writers.add(writer)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def flush_checkpoints(timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> str | None:
    """Flush every checkpoint writer of this process (the state's and the reported checkpoints' uploads) within
    ``timeout_s`` seconds in all.

    Call it from the thread that commits, or once training stopped (before a worker returns or
    leaves a draining node). A last write that failed with a transient storage error is written
    again, retried with backoff until the deadline. Returns the newest state checkpoint URI written (None
    if none); raises :class:`CheckpointError` if a writer's last write still failed, or writes are
    still in flight at the deadline (naming the location, the error and the newest checkpoint)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
        raise ValueError(f"flush_checkpoints timeout_s={timeout_s!r} must be a number of seconds >= 0")
    deadline = time.monotonic() + timeout_s
    newest: tuple[float, str] | None = None
    errors = []
    for writer in sorted(_writers, key=lambda w: not w.policy.newest_of_process):  # the state's first, as always
        try:
            uri = writer.flush(_remaining(deadline))
        except CheckpointError as exc:
            errors.append(exc)
            continue
        if writer.policy.newest_of_process and uri is not None and (newest is None or writer.last_written_at > newest[0]):
            newest = (writer.last_written_at, uri)
    if errors:
        raise CheckpointError(f"the final checkpoint flush (within {timeout_s:g} s) failed: "
                              + "; ".join(str(e) for e in errors)) from errors[0]
    return newest[1] if newest is not None else None


@atexit.register
def _flush_at_exit() -> None:
    """Writes still waiting or in flight when the interpreter exits get a bounded chance to finish."""
    deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT_S
    writers = sorted(_writers, key=lambda w: not w.policy.newest_of_process)
    for writer in [w for w in writers if w.busy or w._waiting is not None or w.policy.flush_all_at_exit]:
        try:
            writer.flush(_remaining(deadline))
        except CheckpointError as exc:
            _log.error("at exit: %s", exc)
