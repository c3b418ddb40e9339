"""A lease on a checkpoint location: one live run per location, taken over when its holder dies.

``CheckpointLease(uri, run_id)`` returns the kind of lease that the location's protocol needs:

* a local or network file system (an absolute path, ``file://``): :class:`~state.checkpoints.lease_file.FileLease`,
  an OS lock (``filelock``, ``flock``) that the kernel releases when the holder process dies, with
  the holder's record in a file beside it;
* anything else (``s3://``, ``gs://``, ``memory://``):
  :class:`~state.checkpoints.lease_object_store.ObjectStoreLease`, generations renewed within ``ttl_s``.

Both have one interface (``lease_base.py``): ``acquire``, ``check``, ``renew``, ``release``,
``held``, ``generation``, ``last_error``, ``failed_renewals`` and the context manager, and both are
instances of :class:`CheckpointLease`. :func:`read_holder` returns the holder's record (``run_id``,
``host``, ``pid``, ``released``...) for either kind, from any process.
"""

from __future__ import annotations

from typing import Any

from .transport import Location
from .config import check_checkpoint_uri
from .lease_base import DEFAULT_TTL_S, MAX_TTL_S, LeaseBase, uses_file_lock
from .lease_file import FileLease, read_record
from .lease_object_store import ObjectStoreLease, read_current

__all__ = ["CheckpointLease", "DEFAULT_TTL_S", "MAX_TTL_S", "read_holder"]


def read_holder(loc: Location) -> dict | None:
    """The record of the run holding ``loc`` (``run_id``, ``host``, ``pid``, ``released``...), or None
    if there is none (or it is being written)."""
    return read_record(loc) if uses_file_lock(loc) else read_current(loc)


class CheckpointLease(LeaseBase):
    """Exclusive use of the checkpoint location ``uri`` by the run ``run_id``, held by one process:
    ``CheckpointLease(uri, run_id, ttl_s=15.0, renew_every_s=ttl_s / 5)`` builds the location's kind.

    ``acquire()`` returns once this run holds the lease; it raises :class:`CheckpointError` naming
    the location and the other run if that run is alive. :meth:`check` raises
    :class:`CheckpointLeaseLost` once the lease is lost; ``release()`` lets the next run take over at
    once."""

    def __new__(cls, uri: str, run_id: str, **kwargs: Any) -> LeaseBase:  # type: ignore[misc]
        kind = FileLease if uses_file_lock(Location(check_checkpoint_uri(uri, "CheckpointLease uri"))) \
            else ObjectStoreLease
        return kind(uri, run_id, **kwargs)


CheckpointLease.register(FileLease)
CheckpointLease.register(ObjectStoreLease)
