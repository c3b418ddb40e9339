"""``hvd.init`` and ``hvd.shutdown``: join the launcher's ring and register the script's process sets; the names
of the session's ``_async`` operations in flight (Horovod's duplicate-name error)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

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
    _Session.in_flight = {}  # a new session: no operation of an older one holds a name
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


H = TypeVar("H")


def named_async(call: str, name: Any, process_set: Any, launch: Callable[[], H]) -> H:
    """Launch an ``_async`` operation (``launch()`` gives its handle), refusing a ``name`` that an operation of
    this process started on the same process set, in this ring's round, and not synchronized yet still holds: as
    Horovod, a ``ValueError`` naming the name and the fix, raised here at once, before anything is sent (so all
    ranks raise alike when they all make the same mistake, and the ring stays usable). The name is held until
    :func:`release_name` (``hvd.synchronize`` of its handle), not until the operation completes: completion is
    timing, which could differ between ranks; the call order is the same on all. ``name=None`` holds nothing; a
    re-formed ring (its in-flight operations failed) or ``hvd.init()`` frees every name."""
    if not isinstance(name, str):
        return launch()
    set_id = getattr(process_set, "process_set_id", None)
    key = (0 if set_id is None else set_id, name)
    round_id = runtime.current().spec.round_id
    held = _Session.in_flight.get(key)
    if held is not None and held[0] == round_id:
        where = "" if key[0] == 0 else f" on process set {key[0]}"
        raise ValueError(
            f"hvd.{call}: name={name!r} is already the name of an _async operation of this process{where} that "
            "is not synchronized yet, and Horovod refuses two in flight with the same name; call "
            "hvd.synchronize(handle) on the first one before reusing its name, or give this one another name "
            "(or name=None). Nothing was sent: the ring stays usable")
    handle = launch()
    _Session.in_flight[key] = (round_id, id(handle))
    return handle


def release_name(handle: Any) -> None:
    """``handle`` was synchronized: the name its operation held is free again."""
    for key, (_, handle_id) in list(_Session.in_flight.items()):
        if handle_id == id(handle):
            del _Session.in_flight[key]
