"""Horovod's process sets: ``ProcessSet``, ``global_process_set``, ``add_process_set`` / ``remove_process_set``,
and how a call runs on a set's sub-ring (:mod:`elastic_ring.ring.process_sets`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

from elastic_ring.collectives.agreement import loose_entries as _loose_entries
from elastic_ring.collectives.agreement import refuse as _refuse
from elastic_ring.ring import process_sets as _process_sets

from .topology import rank, size


class ProcessSet:
    """Horovod's process set: collectives of some ranks only, on a sub-ring of those ranks.

    ``ProcessSet(ranks)`` names ranks of the current ring; register it on every rank (``hvd.init(process_sets=
    [...])`` or ``hvd.add_process_set``, in the same order everywhere), then pass it as ``process_set=`` to a
    collective that only its members call. Roots (``root_rank``) stay global ranks, as in Horovod;
    :meth:`rank` and :meth:`size` are within the set. The sub-ring forms at its members' first collective in a
    round and is re-formed in every new round over the processes that hold those ranks then (a set names ranks,
    not processes); a set naming a rank the new ring does not have raises ``ValueError`` when used (remove it,
    add one that fits). See :mod:`elastic_ring.ring.process_sets`.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not isinstance(ranks_or_comm, Iterable):
            raise ValueError("ProcessSet takes a list of ranks; elastic_ring has no MPI communicators")
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """How many ranks the set has (None until it is registered)."""
        return None if self.process_set_id is None else len(self.ranks or ())

    def rank(self) -> int | None:
        """This rank's position in the set (None until it is registered, -1 when this rank is not in it)."""
        if self.process_set_id is None:
            return None
        me = rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this rank is in the set (None without ranks)."""
        return None if self.ranks is None else rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank of the current ring (its ranks follow the ring across re-forms)."""

    process_set_id = 0

    def __init__(self) -> None:  # noqa: D401 - no ranks of its own
        pass

    @property
    def ranks(self) -> list[int] | None:  # type: ignore[override]
        try:
            return list(range(size()))
        except ValueError:  # before hvd.init(), as Horovod's: no ranks yet
            return None

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True


global_process_set = _GlobalProcessSet()


class _Registry:
    """The registered process sets of this process, by id (0 is the global one)."""

    sets: dict[int, ProcessSet] = {}
    next_id = 1


def _register(process_set: ProcessSet) -> ProcessSet:
    if process_set.ranks is None:
        raise ValueError("a process set needs ranks")
    for registered in _Registry.sets.values():
        if registered.ranks == process_set.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = _Registry.next_id
    _Registry.next_id += 1
    _Registry.sets[process_set.process_set_id] = process_set
    return process_set


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (every rank, in the same order) and return it, as Horovod's."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if isinstance(process_set, _GlobalProcessSet):
        raise ValueError("the global process set is always there")
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (and drop its sub-ring); False for the global one or an unregistered set."""
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id in (None, 0):
        return False
    _Registry.sets.pop(process_set.process_set_id, None)
    ranks = process_set.ranks
    process_set._invalidate()
    if ranks:
        _process_sets.release(ranks)
    return True


@contextlib.contextmanager
def _on(process_set: Any) -> Iterator[list[int] | None]:
    """Run the block's collectives on ``process_set``'s sub-ring; yields its ranks (None: the whole ring)."""
    if process_set is None or process_set is global_process_set:
        yield None
        return
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set={process_set!r} is not a process set: pass hvd.global_process_set or a "
                        "hvd.ProcessSet(ranks) registered by hvd.init(process_sets=[...]) or hvd.add_process_set")
    if process_set.process_set_id is None or _Registry.sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set} is not registered: register it on every rank with "
                         "hvd.init(process_sets=[...]) or hvd.add_process_set(...) first")
    with _process_sets.scope(process_set.ranks):
        yield list(process_set.ranks)


def _agreed(kind: str, tensors: Any, process_set: Any, validate: Callable[[], Any]) -> Any:
    """``validate()``'s result; when it raises (``average=`` and ``op=`` both, ``op=Adasum``, a root outside the
    process set...), every rank raises, not only this one: the error rides in the call's signature check on the
    ring (or the set's sub-ring), as :func:`elastic_ring.collectives.tensors.agree` does for elastic_ring's own
    arguments. The peers, which made a valid call, raise ``TensorMismatchError`` naming this rank's problem."""
    try:
        return validate()
    except (TypeError, ValueError, NotImplementedError) as exc:
        with _on(process_set):
            _refuse(_process_sets.current(), kind, _loose_entries(tensors, kind), None, exc)


def _root(root_rank: Any, ranks: list[int] | None) -> Any:
    """A global root rank as the sub-ring's rank (Horovod's roots are global ranks)."""
    if ranks is None or not isinstance(root_rank, int):
        return root_rank
    if root_rank not in ranks:
        raise ValueError(f"root_rank={root_rank} is not a member of the process set {ranks}")
    return ranks.index(root_rank)
