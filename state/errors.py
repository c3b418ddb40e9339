"""The public errors of ``state``, in one hierarchy under :class:`StateError`.

::

    elastic_ring.ElasticRingError
    └── StateError
        ├── TrainingStopped            (a signal, not a failure: the run stops at this commit)
        └── CheckpointError            (also a RuntimeError, as it always was)
            ├── CheckpointCorrupt
            ├── CheckpointRefused
            └── CheckpointLeaseLost

A leaf module: it imports nothing of ``state`` (every module of the package may import it).
"""

from __future__ import annotations

from elastic_ring.core.errors import ElasticRingError


class StateError(ElasticRingError):
    """Base class of every error raised by ``state``."""


class TrainingStopped(StateError):
    """Raised by ``commit()`` on every rank when the job was asked to stop (e.g. the driver got SIGTERM): the commit
    is complete and, with checkpoints enabled, durable. Not a failure (as ``elastic_ring.RingStopped``): the elastic
    loop lets it through (it is neither a ``CommError`` nor a ``MembershipChanged``) and the worker runtime ends
    quietly."""


class CheckpointError(StateError, RuntimeError):
    """A checkpoint could not be written or read; the message names the file or location and the fix. Also a
    ``RuntimeError``, as it always was (``except RuntimeError`` keeps catching it)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is damaged (unreadable manifest, data that does not match it): loading falls back
    to the previous valid checkpoint."""


class CheckpointRefused(CheckpointError):
    """A checkpoint is intact but must not be loaded here (another job's state, or objects that a
    ``weights_only`` load refuses): loading stops rather than silently resuming something older."""


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
