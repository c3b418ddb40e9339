"""The errors of durable checkpoints (a module of their own so that every checkpoint module can raise them),
and the one rule that says which storage errors are worth retrying (:func:`is_transient`)."""

from __future__ import annotations

import errno

#: OS error numbers that a storage outage which heals by itself produces: a full disk or quota (space
#: comes back when something is deleted), an I/O error, a busy or unreachable server, a timeout.
#: Everything else (permissions, a read-only filesystem, a missing path, a name too long) needs a fix.
TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ENOSPC", "EDQUOT", "EIO", "EAGAIN", "EWOULDBLOCK", "EBUSY", "EINTR", "ETIMEDOUT", "ESTALE", "ENOLCK",
    "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE", "ENETDOWN", "ENETUNREACH", "ENETRESET",
    "EHOSTDOWN", "EHOSTUNREACH", "ENOBUFS") if hasattr(errno, name))

#: Parts of exception class names that object-store clients (botocore, aiohttp, google-auth, azure) give
#: their errors of a throttled, slow or unreachable service; fsspec passes many of them through unwrapped.
_TRANSIENT_NAMES = ("timeout", "throttl", "slowdown", "serviceunavailable", "connectionerror", "connectionreset",
                    "connectionclosed", "serverdisconnected", "clientconnector", "endpointconnection",
                    "toomanyrequests", "internalerror", "temporar")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file or location and the fix."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is damaged (unreadable manifest, data that does not match it): loading falls back
    to the previous valid checkpoint."""


class CheckpointRefused(CheckpointError):
    """A checkpoint is intact but must not be loaded here (another job's state, or objects that a
    ``weights_only`` load refuses): loading stops rather than silently resuming something older."""


class CheckpointPruneError(CheckpointError):
    """The checkpoint ``uri`` was written and verified, but removing older ones failed."""

    def __init__(self, message: str, uri: str) -> None:
        super().__init__(message)
        self.uri = uri


class CheckpointLeaseLost(CheckpointError):
    """This run no longer holds the lease on its checkpoint location.

    ``reason`` is ``"taken_over"`` (another run created a newer generation on an object store, or another run's
    record replaced this one's beside a file lock), ``"expired"`` (object stores: no renewal succeeded for the
    lease's whole ``ttl_s``, so another run may take over at any moment), ``"lock_file_replaced"`` (file systems:
    the lock file was removed or replaced, so the OS lock no longer guards the location) or
    ``"renewal_thread_died"``. ``silent_s`` is the time since the last successful renewal began,
    ``attempts`` the renewals that failed since, ``last_error`` the last one's error (or None),
    ``other_run`` the run that took over (``"taken_over"`` only)."""

    def __init__(self, message: str, *, reason: str, uri: str, run_id: str, silent_s: float, attempts: int,
                 last_error: str | None, other_run: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.uri, self.run_id = reason, uri, run_id
        self.silent_s, self.attempts, self.last_error, self.other_run = silent_s, attempts, last_error, other_run

    @classmethod
    def expired(cls, uri: str, run_id: str, ttl_s: float, silent_s: float, attempts: int,
                last_error: BaseException | None, writing_s: float | None) -> "CheckpointLeaseLost":
        """No renewal succeeded for ``ttl_s``: ``attempts`` failed (the last with ``last_error``), and a
        renewal write has been in flight for ``writing_s`` seconds (None: none is)."""
        error = describe(last_error) if attempts and last_error is not None else None
        detail = f"{attempts} renewal attempt(s) failed, the last with {error}" if attempts else "no renewal failed"
        if writing_s is not None:
            detail += f"; a renewal write has been in flight for {writing_s:.1f} s (storage slow or hanging)"
        elif not attempts:
            detail += ": this process or its renewal thread was paused"
        return cls(f"this run {run_id!r} lost the lease on checkpoint location {uri}: the lease could not be renewed "
                   f"for {silent_s:.1f} s, its whole ttl_s of {ttl_s:g} s ({detail}), so another run may take the "
                   "location over now and this run must stop writing there. Fix the storage (space, permissions, "
                   "reachability), or give the lease a ttl_s (ElasticTrainer lease_ttl_s) longer than the outages it "
                   "must ride out, then run again to resume from the newest checkpoint", reason="expired", uri=uri,
                   run_id=run_id, silent_s=round(silent_s, 3), attempts=attempts, last_error=error)

    @classmethod
    def taken_over(cls, uri: str, run_id: str, generation: int, other: dict, newest: int, silent_s: float,
                   attempts: int, last_error: BaseException | None) -> "CheckpointLeaseLost":
        """Run ``other["run_id"]`` created generation ``newest`` above this run's ``generation``."""
        error = describe(last_error) if attempts and last_error is not None else None
        return cls(f"this run {run_id!r} lost the lease on checkpoint location {uri} to run {other.get('run_id')!r} "
                   f"(host {other.get('host')}, pid {other.get('pid')}), which took it over as generation {newest} "
                   f"(this run held {generation}; its last successful renewal began {silent_s:.1f} s ago, {attempts} "
                   f"failed since, last error {error or 'none'}): the other run saw no renewal for its ttl_s (this "
                   "process paused, or storage unreachable from it). Stop this run: its checkpoints would now mix with "
                   "the other's", reason="taken_over", uri=uri, run_id=run_id, silent_s=round(silent_s, 3),
                   attempts=attempts, last_error=error, other_run=other.get("run_id"))


def describe(exc: BaseException | None) -> str:
    """``exc`` for a message: a CheckpointError's own text (it names the problem), else ``Class: text``."""
    if exc is None:
        return "none"
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` (or the storage error it wraps) may go away by itself, so the same write is worth retrying.

    Walks ``__cause__`` / ``__context__`` past :class:`CheckpointError` wrappers to the storage's own error.
    Never transient: a checkpoint that is corrupt or refused, the lease of another run, a value the state
    cannot save (TypeError, pickling errors), permissions, a missing path. Transient: ``OSError`` with an
    errno of :data:`TRANSIENT_ERRNOS` (ENOSPC, EDQUOT, EIO, EAGAIN, ETIMEDOUT, ECONNRESET...), any
    ``TimeoutError`` or ``ConnectionError`` (fsspec's ``FSTimeoutError`` is one), and object-store
    client errors whose class name says timeout, throttling, or an unreachable or unavailable service."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        if isinstance(current, (CheckpointCorrupt, CheckpointRefused, CheckpointLeaseLost)):
            return False
        if isinstance(current, (TimeoutError, ConnectionError)):
            return True
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno in TRANSIENT_ERRNOS
        name = type(current).__name__.lower()
        if not isinstance(current, CheckpointError) and any(part in name for part in _TRANSIENT_NAMES):
            return True
        if not isinstance(current, CheckpointError) and not isinstance(current, OSError):
            return False  # a TypeError of a state value, a pickling error, a bug: retrying changes nothing
        current = current.__cause__ or current.__context__
    return False
