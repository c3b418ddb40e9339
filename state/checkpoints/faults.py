"""Storage faults: which errors are worth retrying (:func:`is_transient`), how long to wait between attempts
(:func:`backoff_delay`), and how an error reads in a message (:func:`describe`). Pure functions, no I/O."""

from __future__ import annotations

import errno

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointLeaseLost, CheckpointRefused

#: Seconds a checkpoint write is retried after its first transient storage error (ENOSPC, EIO, a timeout...)
#: before it counts as failed: a full disk for 9 s heals within one write, and with the default
#: ``max_consecutive_failures`` a run stops only after about 90 s of storage failing without a break.
DEFAULT_WRITE_RETRY_S = 30.0
#: The first pause between two attempts of a failing write, doubled after each failure up to the second.
WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S = 0.2, 5.0

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


def backoff_delay(failures: int, first_s: float, max_s: float) -> float:
    """Seconds to wait after the ``failures``-th failed attempt in a row (1, 2, ...): ``first_s`` doubled
    each time, never above ``max_s``."""
    if failures < 1:
        raise ValueError(f"failures={failures} must be >= 1 (call it after a failed attempt)")
    return min(max_s, first_s * 2.0 ** min(failures - 1, 60))


def check_retry_budget(value: object, field_name: str = "retry_budget_s") -> float:
    """``value`` as seconds >= 0 (0: no retries), or ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"{field_name}={value!r} must be seconds in [0, 3600]: how long a checkpoint write that "
                         "fails with a transient storage error (full disk, I/O error, timeout) is retried; 0 retries "
                         "nothing")
    return float(value)
