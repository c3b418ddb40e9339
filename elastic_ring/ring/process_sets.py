"""Process sets: the collectives of a subset of the ring's ranks, on a sub-ring of their own.

``with process_sets.scope(ranks):`` runs every collective of :mod:`elastic_ring`
(allreduce, allgather, broadcast, reducescatter, alltoall, the object
collectives, barrier, the ``_async`` calls) on a communicator of only those
ranks of the current ring: ``ranks`` are ranks of the current ring, the
collective's ranks, sizes and roots inside the scope are positions in the
sorted ``ranks`` (0 .. len(ranks) - 1), and only members may enter it. Only
the members call; the other ranks are not involved and may run other
collectives meanwhile.

The sub-ring is formed the first time its members use it in a round, on its
own store keys (the job's, suffixed with a hash of the ranks and a count of
the sub-rings of those ranks this process formed in the round), over the
ring's backend, authenticated with the job's secret. It belongs to its round:
when the ring is torn down (a re-form, a shutdown) it is aborted with it, and
the next use in a new round forms a new one over whichever processes hold
those ranks then. A failure of one of its collectives (a lost member, a
timeout) fails it for the rest of the round (:class:`~elastic_ring.CommError`
on every later use, as for the ring itself): the elastic loop's re-form makes
a new one. A set that names a rank the new ring does not have (it shrank)
raises ``ValueError`` on use.

The gradient reduction of :class:`~elastic_ring.DistributedOptimizer` always
runs on the whole ring (its hooks fire outside any scope).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import threading
import weakref
from typing import Iterator, Sequence

from ..backends.base import Communicator
from ..core.errors import CommError
from ..core.log import get_logger
from ..core.spec import PLACEMENT_FIELDS
from . import runtime

_log = get_logger(__name__)

_local = threading.local()  # .comm: the communicator collectives use on this thread (None: the ring's)
_lock = threading.Lock()
#: ranks -> (the ring's communicator it was formed in, its own communicator)
_subrings: dict[tuple[int, ...], tuple["weakref.ref[Communicator]", Communicator]] = {}
#: (ring communicator's id, ranks) -> how many sub-rings of those ranks this process formed in that round
_formed: dict[tuple[int, tuple[int, ...]], int] = {}


def current() -> Communicator:
    """The communicator a collective called now uses: the scope's sub-ring, or the current ring."""
    comm = getattr(_local, "comm", None)
    return comm if comm is not None else runtime.current()


def active() -> Communicator | None:
    """The scope's sub-ring on this thread (None outside a scope): autograd functions keep it for backward."""
    return getattr(_local, "comm", None)


@contextlib.contextmanager
def scope_of(comm: Communicator | None) -> Iterator[None]:
    """Run collectives on ``comm`` (None: the current ring) within the block, on this thread."""
    previous = getattr(_local, "comm", None)
    _local.comm = comm
    try:
        yield
    finally:
        _local.comm = previous


def check_ranks(ranks: Sequence[int], world_size: int, rank: int) -> tuple[int, ...]:
    """``ranks`` sorted and validated against the current ring; ValueError names the problem."""
    if isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ValueError(f"a process set is a list of ranks (ints), got {ranks!r}")
    members = tuple(sorted(ranks))
    if not members:
        raise ValueError("a process set needs at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"process set {list(members)} names a rank twice")
    outside = [r for r in members if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"process set {list(members)} names rank(s) {outside} that the current ring (world size "
                         f"{world_size}) does not have: after a re-form a set names ranks of the new ring; remove it "
                         "or add one that fits")
    if rank not in members:
        raise ValueError(f"rank {rank} is not a member of process set {list(members)}: only its members call its "
                         "collectives")
    return members


@contextlib.contextmanager
def scope(ranks: Sequence[int]) -> Iterator[Communicator]:
    """Run the collectives of the block on the sub-ring of ``ranks`` (ranks of the current ring; this rank
    must be one of them). Yields the sub-ring's communicator (its ``rank`` / ``size`` are within the set)."""
    comm = subring(ranks)
    with scope_of(comm):
        yield comm


def subring(ranks: Sequence[int]) -> Communicator:
    """The communicator of ``ranks`` in the current round, formed now if this is its first use (every
    member must be making the same call). A set of every rank is the ring itself."""
    ring = runtime.current()
    members = check_ranks(ranks, ring.size, ring.rank)
    if len(members) == ring.size:
        return ring
    with _lock:
        entry = _subrings.get(members)
    if entry is not None and entry[0]() is ring:
        comm = entry[1]
        if ring.errored or ring.closed:
            comm.abort()
        comm.check_usable()  # a failed sub-ring stays failed for its round, as the ring does
        return comm
    if entry is not None:
        _retire(entry[1])
    comm = _form(ring, members)
    with _lock:
        _subrings[members] = (weakref.ref(ring), comm)
    return comm


def _form(ring: Communicator, members: tuple[int, ...]) -> Communicator:
    spec = ring.spec
    with _lock:
        key = (id(ring), members)
        count = _formed.get(key, 0)
        _formed[key] = count + 1
    digest = hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=6).hexdigest()
    replaced = {
        "job_id": f"{spec.job_id}.ps{digest}.{count}",
        "rank": members.index(spec.rank),
        "world_size": len(members),
        # the sub-ring's placement: derived from the members' node ids where the spec has the node table (a ring
        # formed by hand); the Ray driver's specs carry only their own rank's, so a sub-ring of theirs has none
        "node_ids": None if spec.node_ids is None else tuple(spec.node_ids[r] for r in members),
        **{name: None for name in PLACEMENT_FIELDS},
    }
    names = {f.name for f in dataclasses.fields(spec)}
    for parent_field in ("parent_round", "parent_ranks"):  # a sub-ring is always formed afresh
        if parent_field in names:
            replaced[parent_field] = None
    sub = dataclasses.replace(spec, **replaced)
    store = _store(sub)
    if sub.backend == "gloo":
        from ..backends.gloo import GlooCommunicator

        return GlooCommunicator(sub, store)
    from ..backends.nccl.communicator import NcclCommunicator

    return NcclCommunicator(sub, store)


def _store(spec) -> object:
    """A connection of its own to the rendezvous store (a formation may keep a connection's lock)."""
    import torch.distributed as dist

    from ..core.auth import AuthenticatedStore

    try:
        client = dist.TCPStore(spec.store.host, spec.store.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=spec.connect_timeout_s))
    except (RuntimeError, OSError) as exc:
        raise CommError(f"[{spec.identity}] cannot reach the rendezvous store at {spec.store.host}:"
                        f"{spec.store.port} to form a process set's sub-ring: {exc}") from exc
    return AuthenticatedStore(client, spec.auth_key)


def _retire(comm: Communicator) -> None:
    try:
        comm.abort()
        getattr(comm, "release", lambda: None)()
    except Exception as exc:  # noqa: BLE001 - tearing down must not fail the caller
        _log.warning("tearing down a process set's sub-ring failed: %s", exc)


def release(ranks: Sequence[int] | None = None) -> None:
    """Abort the sub-ring of ``ranks`` (None: every sub-ring); the next use forms a new one."""
    with _lock:
        if ranks is None:
            dropped = list(_subrings.values())
            _subrings.clear()
            _formed.clear()
        else:
            entry = _subrings.pop(tuple(sorted(ranks)), None)
            dropped = [] if entry is None else [entry]
    for _, comm in dropped:
        _retire(comm)


runtime.add_teardown_hook(release)  # a torn-down ring takes its process sets' sub-rings with it
