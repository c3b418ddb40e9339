"""Durable checkpoints: the self-validating config and the pure decisions (where, what to prune).

Everything here is a plain function of its arguments (no I/O), tested with tables
in ``tests/test_checkpoint_policy.py``.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

#: Consecutive failed writes after which the next ``commit()`` raises (CheckpointConfig default).
DEFAULT_MAX_CONSECUTIVE_FAILURES = 3
#: Seconds a checkpoint write is retried after its first transient storage error (ENOSPC, EIO, a timeout...)
#: before it counts as failed: a full disk for 9 s heals within one write, and with the default
#: ``max_consecutive_failures`` a run stops only after about 90 s of storage failing without a break.
DEFAULT_WRITE_RETRY_S = 30.0
#: The first pause between two attempts of a failing write, doubled after each failure up to the second.
WRITE_RETRY_FIRST_S, WRITE_RETRY_MAX_S = 0.2, 5.0

_PROTOCOL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_DIR = re.compile(r"^ckpt-(\d{12})$")


def check_checkpoint_uri(uri: object, field: str = "checkpoint_uri") -> str:
    """``uri`` with trailing slashes removed, or ValueError naming ``field``, the value and the fix.

    Accepted: absolute paths (``/data/ckpt``), ``file:///data/ckpt`` and any fsspec URL with a path
    (``s3://bucket/job``, ``gs://bucket/job``, ``memory://job``; chained URLs such as
    ``simplecache::s3://b/j`` are checked on their last part). Refused: the filesystem root (every
    job's checkpoints would land among the system's files, and pruning walks it) and relative paths
    (each Ray worker would resolve them in its own working directory, so rank 0 of a later round, or
    the next run, would not find them)."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"{field}={uri!r} must be an absolute path or an fsspec URL "
                         "(e.g. /data/ckpt, file:///data/ckpt, s3://bucket/job)")
    last = uri.split("::")[-1]
    match = _PROTOCOL.match(last)
    if match is None or match.group(1) == "file":
        path = match.group(2) if match else last
        if not path.startswith("/"):
            raise ValueError(
                f"{field}={uri!r} is a relative path: each worker would resolve it in its own working "
                "directory, so a later rank 0 or the next run would not find the checkpoints; give an "
                "absolute path on storage every node shares (e.g. /shared/ckpt/job) or a URL (s3://bucket/job)")
        if posixpath.normpath(path) in ("/", "//"):
            raise ValueError(f"{field}={uri!r} is the filesystem root: checkpoints need a directory of "
                             "their own, which pruning may clean (e.g. /data/ckpt/job)")
    else:
        path = match.group(2).strip("/")
        if not path:
            raise ValueError(f"{field}={uri!r} names no bucket or directory: give one of this job's own, "
                             f"e.g. {match.group(1)}://bucket/job")
    stripped = uri.rstrip("/")
    return stripped if stripped and not stripped.endswith(":") else uri


def check_protocol_available(uri: str, field: str = "checkpoint_uri") -> None:
    """ValueError unless fsspec knows every protocol in ``uri`` and its package is installed here."""
    import fsspec  # a registry lookup; an implementation package is imported only to prove it is installed

    for part in uri.split("::"):
        match = _PROTOCOL.match(part)
        protocol = match.group(1) if match else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ValueError(f"{field}={uri!r}: fsspec knows no protocol {protocol!r}; use a local absolute path or "
                             "a URL such as s3://bucket/job, gs://bucket/job (see fsspec's known implementations)"
                             ) from None
        except ImportError as exc:
            raise ValueError(f"{field}={uri!r}: the package for {protocol}:// is not installed ({exc}); install it "
                             "on the driver and every worker (e.g. pip install s3fs for s3://, gcsfs for gs://)"
                             ) from None


@dataclass(frozen=True)
class CheckpointConfig:
    """Persist to ``uri`` every ``every_n_commits`` commits and/or every ``every_s`` seconds
    (whichever comes first); keep the newest ``keep_last`` checkpoints.

    ``run_id`` names the run in every manifest (the driver passes its job id; the holder of the
    location's :class:`~state.CheckpointLease` uses the same id). ``trusted``: load checkpoints with
    full unpickling (custom classes); by default only tensors, numbers, strings, containers and the
    state of optimizers, LR schedulers and samplers load, and a checkpoint holding anything else is
    refused. ``max_consecutive_failures``: after that many failed writes in a row, the next
    ``commit()`` raises with the cause (a write failing with a transient storage error counts as
    failed only once its retries, :data:`DEFAULT_WRITE_RETRY_S` by default, are spent).
    ``signing_key`` (optional, >= 16 bytes, kept out of repr): manifests are signed with HMAC-SHA256
    and only manifests signed with this key are loaded; it must outlive the run, since the next run
    verifies this run's checkpoints with it."""

    uri: str
    every_n_commits: int | None = None
    every_s: float | None = None
    keep_last: int = 3
    run_id: str | None = None
    trusted: bool = False
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES
    signing_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "uri", check_checkpoint_uri(self.uri, "CheckpointConfig.uri"))
        if self.every_n_commits is None and self.every_s is None:
            raise ValueError("CheckpointConfig needs every_n_commits or every_s (or both): say how often to persist")
        if self.every_n_commits is not None and (not _is_int(self.every_n_commits) or self.every_n_commits < 1):
            raise ValueError(f"CheckpointConfig.every_n_commits={self.every_n_commits!r} must be an int >= 1")
        if self.every_s is not None and (isinstance(self.every_s, bool) or not isinstance(self.every_s, (int, float))
                                         or not self.every_s > 0):
            raise ValueError(f"CheckpointConfig.every_s={self.every_s!r} must be a number of seconds > 0")
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last={self.keep_last!r} must be an int >= 1")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not re.fullmatch(r"[\w.\-]{1,128}", self.run_id)):
            raise ValueError(f"CheckpointConfig.run_id={self.run_id!r} must be None or 1-128 letters, digits, "
                             "'_', '-' or '.' (the driver passes its job id)")
        if not isinstance(self.trusted, bool):
            raise ValueError(f"CheckpointConfig.trusted={self.trusted!r} must be True or False")
        if not _is_int(self.max_consecutive_failures) or self.max_consecutive_failures < 1:
            raise ValueError(f"CheckpointConfig.max_consecutive_failures={self.max_consecutive_failures!r} "
                             "must be an int >= 1")
        check_signing_key(self.signing_key, "CheckpointConfig.signing_key")


def check_signing_key(key: object, field_name: str = "signing_key") -> None:
    """None, or bytes of at least 16; the error never shows the key."""
    if key is not None and (not isinstance(key, bytes) or len(key) < 16):
        shown = f"{len(key)} bytes" if isinstance(key, bytes) else f"a {type(key).__name__}"
        raise ValueError(f"{field_name} must be None or bytes of at least 16 (a secret that outlives the run, "
                         f"e.g. os.environ['CKPT_KEY'].encode()); got {shown}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_checkpoint_dir(name: str) -> int | None:
    """The sequence number of a checkpoint directory's base name (``ckpt-000000000007`` -> 7), else None.
    Anchored: ``old-ckpt-000000000005`` or ``ckpt-000000000005.bak`` are not checkpoints."""
    match = _DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory as pruning sees it: complete once its manifest exists."""

    seq: int
    run_id: str | None
    complete: bool


def plan_prune(entries: list[Entry], newest: int, run_id: str | None, keep_last: int,
               lease_held: bool) -> list[int]:
    """Sequence numbers to delete after checkpoint ``newest`` was written and verified.

    * Never ``newest`` itself, and never anything newer (another writer's, possibly in flight).
    * Candidates are this run's directories; with ``lease_held`` (the location's lease names this
      run, so no other run is live) every run's.
    * Among candidates up to ``newest``, the ``keep_last`` newest complete ones are kept; older
      complete ones are deleted, and so are incomplete ones (failed writes, interrupted prunes).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    candidates = [e for e in entries if e.seq <= newest and (lease_held or (run_id is not None and e.run_id == run_id))]
    complete = sorted(e.seq for e in candidates if e.complete)
    keep = set(complete[-keep_last:]) | {newest}
    return sorted(e.seq for e in candidates if e.seq < newest and e.seq not in keep)


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


def next_sequence(existing: list[int]) -> int:
    """The sequence number to claim next: one past every directory seen (complete or not)."""
    return max(existing, default=0) + 1
