"""The configuration of durable checkpoints: the self-validating :class:`CheckpointConfig`, the checks of a location
(:func:`check_checkpoint_uri`) and of a signing key, and this process's default (:func:`set_default_checkpointing`:
the worker runtime installs ElasticTrainer's, and every new ``State`` takes it). No I/O but the registry lookup of
:func:`check_protocol_available`; tested with tables in ``tests/test_checkpoint_policy.py``.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

#: Consecutive failed writes after which the next ``commit()`` raises (CheckpointConfig default).
DEFAULT_MAX_CONSECUTIVE_FAILURES = 3

_PROTOCOL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)


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
    location's :class:`~state.checkpoints.lease.CheckpointLease` uses the same id). ``trusted``: load checkpoints with
    full unpickling (custom classes); by default only tensors, numbers, strings, containers and the
    state of optimizers, LR schedulers and samplers load, and a checkpoint holding anything else is
    refused. ``max_consecutive_failures``: after that many failed writes in a row, the next
    ``commit()`` raises with the cause (a write failing with a transient storage error counts as
    failed only once its retries, :data:`DEFAULT_WRITE_RETRY_S` by default, are spent).
    ``signing_key`` (optional, >= 16 bytes, kept out of repr): manifests are signed with HMAC-SHA256
    and only manifests signed with this key are loaded; it must outlive the run, since the next run
    verifies this run's checkpoints with it. ``lease_generation`` (None, or an int >= 1): the generation of the
    lease its run holds on ``uri`` (the driver's :class:`~state.checkpoints.lease.CheckpointLease`); a writer given
    it publishes only while that generation is the location's current one (reported checkpoints use it today)."""

    uri: str
    every_n_commits: int | None = None
    every_s: float | None = None
    keep_last: int = 3
    run_id: str | None = None
    trusted: bool = False
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES
    signing_key: bytes | None = field(default=None, repr=False)
    lease_generation: int | None = None

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
        check_lease_generation(self.lease_generation, "CheckpointConfig.lease_generation")


def check_signing_key(key: object, field_name: str = "signing_key") -> None:
    """None, or bytes of at least 16; the error never shows the key."""
    if key is not None and (not isinstance(key, bytes) or len(key) < 16):
        shown = f"{len(key)} bytes" if isinstance(key, bytes) else f"a {type(key).__name__}"
        raise ValueError(f"{field_name} must be None or bytes of at least 16 (a secret that outlives the run, "
                         f"e.g. os.environ['CKPT_KEY'].encode()); got {shown}")


def check_lease_generation(generation: object, field_name: str = "lease_generation") -> None:
    """None, or an int >= 1 (a lease's generation)."""
    if generation is not None and (not _is_int(generation) or generation < 1):
        raise ValueError(f"{field_name}={generation!r} must be None or an int >= 1 (the generation of the lease "
                         "the run holds on the location)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- this process's default
#: Checkpointing that every new State of this process gets (set by the worker runtime from ElasticTrainer's
#: checkpoint options), so users write no code for it; ``report(checkpoint=...)`` uploads to its location too.
_default: CheckpointConfig | None = None


def set_default_checkpointing(config: CheckpointConfig | None) -> None:
    """Make every State created afterwards in this process persist with ``config`` (None: off)."""
    global _default
    if config is not None and not isinstance(config, CheckpointConfig):
        raise TypeError(f"expected a CheckpointConfig or None, got {type(config).__name__}")
    _default = config


def default_checkpointing() -> CheckpointConfig | None:
    """The checkpointing this process was given (:func:`set_default_checkpointing`: location, keep_last, run id,
    lease generation), or None when the run has no ``checkpoint_uri``."""
    return _default
