"""``hvd.init`` and ``hvd.shutdown``: join the launcher's ring and register the script's process sets; the launch of
the session's ``_async`` operations (queued in call order, or parked to be paired by name) and the names they hold
(Horovod's duplicate-name error)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from elastic_ring.collectives import negotiation
from elastic_ring.collectives.handles import Handle
from elastic_ring.core.errors import NotInitializedError
from elastic_ring.ring import process_sets as _process_sets
from elastic_ring.ring import runtime

from .errors import _LAUNCH
from .process_sets import ProcessSet, _GlobalProcessSet, _on, _register, _Registry, remove_process_set
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
    negotiation.cancel_all("hvd.init() started a new session: a named _async operation of the previous one was "
                           "never paired (synchronize named operations before hvd.init())")
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
    The ring belongs to the launcher and stays (Horovod scripts call this at exit). As Horovod's, the named
    ``_async`` operations not paired yet fail (their ``synchronize`` raises ``ValueError``)."""
    _Session.shut = True
    negotiation.cancel_all("hvd.shutdown() was called while this named _async operation waited to be paired")


def launch_async(prefix: str, call: str, name: Any, process_set: Any, start: Callable[[], Any]) -> Handle:
    """Launch an ``_async`` operation whose collective ``start()`` runs: unnamed, on its communicator's ordered
    queue, in call order (:mod:`elastic_ring.collectives.ordered`); named, parked until every rank submitted
    ``"{prefix}.{name}"`` and this rank synchronizes it, paired by name as Horovod's coordinator pairs them
    (:mod:`elastic_ring.collectives.negotiation`). ``prefix`` is Horovod's op prefix (``allreduce``,
    ``allgather``, ...): the same name under two prefixes does not collide, as in Horovod.

    As Horovod, a ``name`` that an operation of this process (same prefix and process set, this ring's round)
    still holds raises a ``ValueError`` naming the name and the fix, at once, before anything is sent (so all
    ranks raise alike when they all make the same mistake, and the ring stays usable). The name is held until
    :func:`release_name` (``hvd.synchronize`` of its handle), not until the operation completes: completion is
    timing, which could differ between ranks; the call order is the same on all. ``name=None`` holds nothing; a
    re-formed ring (its operations failed) or ``hvd.init()`` frees every name."""
    named = isinstance(name, str)
    set_id = getattr(process_set, "process_set_id", None)
    key = (0 if set_id is None else set_id, prefix, name)
    round_id = runtime.current().spec.round_id
    held = _Session.in_flight.get(key) if named else None
    if held is not None and held[0] == round_id:
        where = "" if key[0] == 0 else f" on process set {key[0]}"
        raise ValueError(
            f"hvd.{call}: name={name!r} is already the name of an _async {prefix} of this process{where} that "
            "is not synchronized yet, and Horovod refuses two in flight with the same name; call "
            "hvd.synchronize(handle) on the first one before reusing its name, or give this one another name "
            "(or name=None). Nothing was sent: the ring stays usable")
    with _on(process_set):  # the ring's communicator, or the set's sub-ring (formed on its first use)
        comm = _process_sets.current()
    if not named:
        return Handle.queued(comm, start)
    handle = negotiation.park(comm, f"{prefix}.{name}", start)
    _Session.in_flight[key] = (round_id, id(handle))
    return handle


def release_name(handle: Any) -> None:
    """``handle`` was synchronized: the name its operation held is free again."""
    for key, (_, handle_id) in list(_Session.in_flight.items()):
        if handle_id == id(handle):
            del _Session.in_flight[key]
