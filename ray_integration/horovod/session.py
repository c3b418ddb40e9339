"""``hvd.init`` and ``hvd.shutdown``: join the launcher's ring and register the script's process sets."""

from __future__ import annotations

from typing import Any, Iterable

from elastic_ring.core.errors import NotInitializedError
from elastic_ring.ring import runtime

from .errors import _LAUNCH
from .process_sets import ProcessSet, _GlobalProcessSet, _register, _Registry, remove_process_set
from .topology import _Session


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Form (or join) this worker's ring. There is nothing to configure: the launcher or ElasticTrainer did.
    ``process_sets``: a list of :class:`ProcessSet` to register (in this order on every rank), or
    ``"dynamic"`` (sets are added later with :func:`add_process_set`; always allowed here)."""
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) takes an MPI communicator; elastic_ring has no MPI: " + _LAUNCH)
    if process_sets not in (None, "dynamic") and (isinstance(process_sets, (str, bytes, ProcessSet))
                                                  or not isinstance(process_sets, Iterable)):
        raise ValueError(f"process_sets={process_sets!r} must be a list of hvd.ProcessSet or 'dynamic'")
    try:
        runtime.current()
    except NotInitializedError:
        raise NotInitializedError("hvd.init() found no ring to join: " + _LAUNCH) from None
    _Session.shut = False
    for registered in list(_Registry.sets.values()):  # as Horovod's init: the sets given now, nothing older
        remove_process_set(registered)
    _Registry.next_id = 1  # a fresh table: ids count from 1 again, as after Horovod's init
    if process_sets not in (None, "dynamic"):
        for process_set in process_sets:
            if not isinstance(process_set, ProcessSet) or isinstance(process_set, _GlobalProcessSet):
                raise ValueError(f"process_sets holds {process_set!r}, not a hvd.ProcessSet(ranks)")
            if any(registered.ranks == process_set.ranks for registered in _Registry.sets.values()):
                process_set._invalidate()  # Horovod: a second set of the same ranks stays unregistered
                continue
            _register(process_set)


def shutdown() -> None:
    """As Horovod's, for this script: ``is_initialized()`` is False and ``rank()`` raises until ``init()``.
    The ring belongs to the launcher and stays (Horovod scripts call this at exit)."""
    _Session.shut = True
