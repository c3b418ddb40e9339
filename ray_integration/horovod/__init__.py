"""Horovod's PyTorch API over elastic_ring: ``import ray_integration.horovod as hvd``.

A Horovod (elastic) PyTorch script runs with only its import line changed, under
``python -m ray_integration.launch`` (or inside ``ElasticTrainer(...).run``). The
calls keep Horovod's names, signatures, defaults and semantics (``average=`` or
``op=``, ``prescale_factor`` / ``postscale_factor``, ``root_rank`` positional,
mismatches as ``RuntimeError``); each maps onto ``elastic_ring`` and ``state``
(docs/migration.md has the table). The ``_async`` calls are launched at the call and
paired by call order (:mod:`elastic_ring.collectives.handles`). Process sets run on sub-rings of their ranks
(:mod:`elastic_ring.ring.process_sets`); sparse tensors are reduced by an allgather of their indices and
values as in Horovod, and sparse gradients of ``DistributedOptimizer`` are reduced dense and handed
back sparse. A failed collective raises :class:`HorovodInternalError`, a ``RuntimeError`` (as
Horovod's) and an :class:`elastic_ring.CommError` (the elastic loop's "roll back and re-form").
What elastic_ring does not offer is refused with an error that says so and what to use instead,
never ignored: Adasum, ``join``, ``gradient_predivide_factor``, ``num_groups`` / ``groups`` and a
``DistributedOptimizer`` over a process set.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

import elastic_ring as er
from elastic_ring.ring import process_sets as _process_sets
from elastic_ring.ring import runtime
from elastic_ring.collectives.tensors import loose_entries as _loose_entries
from elastic_ring.collectives.tensors import refuse as _refuse
from elastic_ring.reduction.compression import Compression
from elastic_ring.core.errors import NotInitializedError, TensorMismatchError
from elastic_ring.collectives.handles import Handle
from elastic_ring.reduction.optimizer import _DistributedMixin
from elastic_ring.core.ops import Average, Max, Min, Product, ReduceOp, Sum
from elastic_ring.collectives.sync_batch_norm import SyncBatchNorm

from . import elastic

__all__ = [
    "Adasum", "Average", "Product", "Compression", "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "ProcessSet", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "alltoall_async", "ccl_built", "ddl_built",
    "join", "remove_process_set", "sparse_allreduce_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter_async", "reducescatter_async", "allgather_async", "allreduce_async", "allreduce_async_", "alltoall",
    "broadcast_async", "broadcast_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "poll", "reducescatter", "synchronize", "allgather_object", "allreduce", "allreduce_", "barrier", "broadcast",
    "broadcast_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank", "cross_size",
    "cuda_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allreduce",
    "grouped_allreduce_", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
]

#: Horovod's ops that elastic_ring does not have: accepted as names, refused with a clear error where used.
Adasum = "adasum"


class HorovodInternalError(er.CommError, RuntimeError):
    """Horovod's ``HorovodInternalError``: a collective failed (a lost peer, a timeout, a broken connection).

    A ``RuntimeError``, as Horovod's, so ``except RuntimeError`` in a Horovod script catches it; and an
    :class:`elastic_ring.CommError`, so the elastic loop rolls back and re-forms as for any failed collective.
    Every call of this module (collectives, ``synchronize``, ``broadcast_parameters``, the
    ``DistributedOptimizer``'s ``step`` / ``synchronize`` and its bucket launches inside ``loss.backward()``)
    raises it in place of a ``CommError``; the state's
    own methods (``state.commit()``, ``state.sync()``) raise the plain ``elastic_ring.CommError``, its base
    class (``except er.CommError`` catches both). A membership change stays a separate exception
    (:data:`HostsUpdatedInterrupt`), as in Horovod."""


#: Horovod's "the hosts changed": the membership changes at a commit (re-form without rolling back).
HostsUpdatedInterrupt = er.MembershipChanged


def _internal_error(exc: er.CommError) -> HorovodInternalError:
    """``exc`` as a :class:`HorovodInternalError` with the same message and attributes (``live_state_consistent``
    and what the loop reads)."""
    if isinstance(exc, HorovodInternalError):
        return exc
    error = HorovodInternalError(*exc.args)
    error.__dict__.update(exc.__dict__)
    return error


@contextlib.contextmanager
def _horovod_errors() -> Iterator[None]:
    """Raise a failed collective's ``CommError`` as :class:`HorovodInternalError`."""
    try:
        yield
    except er.CommError as exc:
        if isinstance(exc, RuntimeError):
            raise
        raise _internal_error(exc) from exc


def _hvd_call(fn: Callable) -> Callable:
    """Decorate a call of this module: a failed collective raises :class:`HorovodInternalError`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _horovod_errors():
            return fn(*args, **kwargs)

    return call


_LAUNCH = ("run the script with `python -m ray_integration.launch [--min-workers N] [--max-workers M] script.py "
           "[args]` (or call it inside ElasticTrainer(...).run(fn)): elastic_ring forms the ring for you")


# ------------------------------------------------------------------ process sets
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


# ------------------------------------------------------------------ init and topology
class _Session:
    """Whether this script called hvd.shutdown() since its last hvd.init() (Horovod's is_initialized() then says
    False and rank() raises; the ring itself belongs to the launcher and stays)."""

    shut = False


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


def is_initialized() -> bool:
    return er.is_initialized() and not _Session.shut


def _spec():
    if _Session.shut:
        raise ValueError("Horovod has not been initialized; use hvd.init() (it was shut down)")
    try:
        return runtime.current().spec
    except NotInitializedError:
        raise ValueError("Horovod has not been initialized; use hvd.init(), and " + _LAUNCH) from None


def rank() -> int:
    return _spec().rank


def size() -> int:
    return _spec().world_size


def local_rank() -> int:
    return _spec().local_rank


def local_size() -> int:
    return _spec().local_size


def _cross() -> tuple[int, int]:
    """This rank's index among the ranks with its local rank (one per node), and how many there are."""
    spec = _spec()
    seen: dict[str, int] = {}
    local = []
    for node in spec.node_ids:
        local.append(seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    peers = [r for r, lr in enumerate(local) if lr == local[spec.rank]]
    return peers.index(spec.rank), len(peers)


def cross_rank() -> int:
    return _cross()[0]


def cross_size() -> int:
    return _cross()[1]


def is_homogeneous() -> bool:
    spec = _spec()
    counts = [spec.node_ids.count(n) for n in set(spec.node_ids)]
    return len(set(counts)) == 1


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    """Horovod returns NCCL's version as an int (e.g. 23203), 0 without NCCL."""
    if not er.nccl_available():
        return 0
    from elastic_ring.backends.nccl import lib as nccl_lib

    major, minor, patch = nccl_lib.version_tuple(nccl_lib.load().version())
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


# ------------------------------------------------------------------ collectives
def _op(average: bool | None, op: ReduceOp | str | None) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average; please provide only one of them.")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if isinstance(op, str) and op.lower() == "adasum":
        raise NotImplementedError("op=Adasum is not supported by elastic_ring; use hvd.Average (and the learning "
                                  "rate scaled by hvd.size())")
    return ReduceOp.parse(op)


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: integers in float64 and back (truncating), half precision in float32 and back."""
    if factor == 1.0:
        return t
    if not t.is_floating_point():
        return (t.to(torch.float64) * factor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * factor).to(t.dtype)
    return t * factor


def _scaled(tensors: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    return [_scale(t, factor) for t in tensors]


def _sparse_op(average: bool | None, op: ReduceOp | str | None) -> ReduceOp:
    reduce_op = _op(average, op)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"a sparse tensor is reduced with op=Sum or op=Average, not op={reduce_op.value}")
    return reduce_op


@_hvd_call
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Horovod's allreduce (differentiable): ``postscale * reduce(prescale * tensor)``. A sparse tensor is
    reduced as :func:`sparse_allreduce_async` does (Sum or Average; the result is sparse)."""
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        reduce_op = _agreed("sparse_allreduce", [], process_set, lambda: _sparse_op(average, op))
        scaled = tensor if prescale_factor == 1.0 else tensor * prescale_factor
        out = sparse_allreduce_async(scaled, name, reduce_op, process_set)()
        return out if postscale_factor == 1.0 else out * postscale_factor
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


@_hvd_call
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    return grouped_allreduce_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)[0]


@_hvd_call
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    reduce_op = _agreed("grouped_allreduce", tensors, process_set, lambda: _op(average, op))
    with _on(process_set):
        reduced = er.grouped_allreduce(_scaled(tensors, prescale_factor), op=reduce_op, name=name,
                                       compression=compression)
    return _scaled(reduced, postscale_factor)


@_hvd_call
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    reduce_op = _agreed("grouped_allreduce_", tensors, process_set, lambda: _op(average, op))
    with torch.no_grad(), _on(process_set):
        for t in tensors:
            t.copy_(_scale(t, prescale_factor))
        er.grouped_allreduce_(list(tensors), op=reduce_op, name=name)
        for t in tensors:
            t.copy_(_scale(t, postscale_factor))
    return list(tensors)


@_hvd_call
def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    with _on(process_set):
        return er.allgather(tensor, name=name)


@_hvd_call
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    with _on(process_set):
        return [er.allgather(t, name=None if name is None else f"{name}.{i}") for i, t in enumerate(tensors)]


@_hvd_call
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    with _on(process_set) as ranks:
        return er.broadcast(tensor, _agreed("broadcast", tensor, process_set, lambda: _root(root_rank, ranks)),
                            name=name)


@_hvd_call
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    with torch.no_grad(), _on(process_set) as ranks:
        return er.broadcast_(tensor, _agreed("broadcast_", tensor, process_set, lambda: _root(root_rank, ranks)),
                             name=name)


@_hvd_call
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none,
                  op: ReduceOp | str = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


@_hvd_call
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression=Compression.none,
                          op: ReduceOp | str = Average, process_set: Any = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    def validate() -> ReduceOp:
        if compression is not Compression.none:
            raise NotImplementedError("reducescatter with compression is not supported by elastic_ring; leave it out")
        return _op(None, op)

    reduce_op = _agreed("grouped_reducescatter", tensors, process_set, validate)
    with _on(process_set):
        out = er.grouped_reducescatter(_scaled(tensors, prescale_factor), op=reduce_op, name=name)
    return _scaled(out, postscale_factor)


@_hvd_call
def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set: Any = global_process_set):
    with _on(process_set):
        return er.alltoall(tensor, splits, name=name)


# ------------------------------------------------------------------ handles
@_hvd_call
def poll(handle: Any) -> bool:
    """Whether the handle's collective is done (:func:`synchronize` will not block)."""
    if isinstance(handle, _SparseHandle):
        return handle.done()
    return er.poll(handle)


@_hvd_call
def synchronize(handle: Any) -> Any:
    """Wait for the handle's collective and return its output, or raise the error it met. As Horovod's, a handle
    that was synchronized already gives None. A :func:`sparse_allreduce_async` handle gives its sparse result."""
    if isinstance(handle, _SparseHandle):
        return handle()
    if isinstance(handle, Handle) and handle._taken:
        return None
    return er.synchronize(handle)


@_hvd_call
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async", tensor, process_set, lambda: _op(average, op))
    if prescale_factor == postscale_factor == 1.0 and not (isinstance(tensor, torch.Tensor) and tensor.is_sparse):
        with _on(process_set):  # launched now, runs while the script works
            return er.allreduce_async(tensor, op=reduce_op, name=name)
    return Handle(lambda: allreduce(tensor, None, name, Compression.none, reduce_op, prescale_factor,
                                    postscale_factor, process_set))


@_hvd_call
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async_", tensor, process_set, lambda: _op(average, op))
    if prescale_factor == postscale_factor == 1.0:
        with _on(process_set):
            return er.allreduce_async_(tensor, op=reduce_op, name=name)
    return Handle(lambda: allreduce_(tensor, None, name, reduce_op, prescale_factor, postscale_factor, process_set))


@_hvd_call
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async", tensors, process_set, lambda: _op(average, op))
    if prescale_factor == postscale_factor == 1.0:
        with _on(process_set):
            return er.grouped_allreduce_async(list(tensors), op=reduce_op, name=name)
    return Handle(lambda: grouped_allreduce(tensors, None, name, Compression.none, reduce_op, prescale_factor,
                                            postscale_factor, process_set))


@_hvd_call
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async_", tensors, process_set, lambda: _op(average, op))
    if prescale_factor == postscale_factor == 1.0:
        with _on(process_set):
            return er.grouped_allreduce_async_(list(tensors), op=reduce_op, name=name)
    return Handle(lambda: grouped_allreduce_(tensors, None, name, reduce_op, prescale_factor, postscale_factor,
                                             process_set))


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set):
    return Handle(lambda: allgather(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set):
    return Handle(lambda: grouped_allgather(tensors, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0):
    return Handle(lambda: reducescatter(tensor, name, Compression.none, op, process_set, prescale_factor,
                                        postscale_factor))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | str = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    return Handle(lambda: grouped_reducescatter(tensors, name, Compression.none, op, process_set, prescale_factor,
                                                postscale_factor))


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: Any = global_process_set):
    return Handle(lambda: alltoall(tensor, splits, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set):
    return Handle(lambda: broadcast(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set):
    return Handle(lambda: broadcast_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ sparse tensors
class _SparseHandle:
    """What :func:`sparse_allreduce_async` returns: call it (or pass it to :func:`synchronize`) for the result."""

    def __init__(self, tensor: torch.Tensor, start: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 divisor: int | None) -> None:
        self._tensor, self._divisor = tensor, divisor
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        try:  # both allgathers now, in order (as elastic_ring's allgathers complete at the call); an error (a
            # mismatch with a peer) stops before the second, so that it cannot pair with the peer's next call
            self._parts: tuple[torch.Tensor, torch.Tensor] | None = start()
        except Exception as exc:  # noqa: BLE001 - delivered by the call, as Horovod's handles do
            self._parts, self._error = None, exc

    def done(self) -> bool:
        return True

    def __call__(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        if self._result is None:
            indices, values = self._parts
            if self._divisor is not None:
                values = values / self._divisor
            self._result = torch.sparse_coo_tensor(indices.transpose(0, 1), values, self._tensor.size(),
                                                   device=self._tensor.device, check_invariants=False)
        return self._result


@_hvd_call
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp | str,
                           process_set: Any = global_process_set) -> _SparseHandle:
    """Horovod's sparse allreduce: every rank's indices and values are allgathered, so the result holds every
    rank's entries (uncoalesced: entries at the same index add up), the values divided by the set's size for
    ``op=Average``. Returns a handle: call it (as Horovod's) or pass it to :func:`synchronize`."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async reduces a sparse COO tensor (tensor.is_sparse); use allreduce_async "
                         "for a dense one")
    reduce_op = _agreed("sparse_allreduce", [], process_set, lambda: _sparse_op(None, op))

    def start() -> tuple[torch.Tensor, torch.Tensor]:
        indices = allgather(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                            process_set=process_set)
        values = allgather(tensor._values().contiguous(), name=f"{name}.values", process_set=process_set)
        return indices, values

    members = size() if process_set is None or process_set is global_process_set else len(process_set.ranks or ())
    return _SparseHandle(tensor, start, members if reduce_op is ReduceOp.AVERAGE else None)


# ------------------------------------------------------------------ objects, barrier, join
@_hvd_call
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    with _on(process_set) as ranks:
        return er.broadcast_object(obj, _agreed("broadcast_object", [], process_set, lambda: _root(root_rank, ranks)),
                                   name=name)


@_hvd_call
def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list:
    with _on(process_set):
        return er.allgather_object(obj, name=name)


@_hvd_call
def barrier(process_set: Any = global_process_set) -> None:
    with _on(process_set):
        er.barrier()


def join(device: int = -1) -> int:
    """Horovod's ``join`` is not offered: elastic_ring's collectives pair by call order, and the gradient
    reduction of a step after a ring's first carries its agreement inside its buckets, with no exchange that a
    rank waiting in ``join()`` could answer with zeros. Give every rank the same number of steps instead (an
    ``ElasticSampler`` / ``DistributedSampler`` with ``drop_last=True``, or a constant global batch)."""
    raise NotImplementedError(
        "hvd.join() is not supported by elastic_ring: give every rank the same number of batches (ElasticSampler or "
        "DistributedSampler with drop_last=True, or ElasticSampler(global_batch_size=...)) so that no rank runs out "
        "of data before the others")


# ------------------------------------------------------------------ parameters and optimizers
def _parameter_items(params: Any, prefix: str | None) -> list[tuple[str, torch.Tensor]]:
    """Horovod's ``params``: a module, a dict (sorted by name, as Horovod), or a list of tensors and / or
    ``(name, tensor)`` pairs (``model.parameters()``, ``model.named_parameters()``)."""
    if isinstance(params, torch.nn.Module):
        items: list[tuple[Any, Any]] = list(params.state_dict().items())
    elif isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda item: str(item[0]))
    elif isinstance(params, torch.Tensor) or isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}: pass model.state_dict(), "
                         "model.named_parameters() or a list of tensors")
    else:
        items = [p if isinstance(p, tuple) and len(p) == 2 else (None, p) for p in params]
    named = []
    for i, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {i} ({name!r}) is a {type(tensor).__name__}, not a tensor")
        label = f"parameter.{i}" if name is None else str(name)
        named.append((label if prefix is None else f"{prefix}.{label}", tensor))
    return named


@_hvd_call
def broadcast_parameters(params, root_rank: int, prefix: str | None = None) -> None:
    """Overwrite the parameters in place with root's (``model.state_dict()``, ``model.named_parameters()`` or a
    list of tensors such as ``list(model.parameters())``)."""
    er.broadcast_parameters(_parameter_items(params, prefix), root_rank)


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and m.sparse for p in m.parameters()}


@_hvd_call
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              prefix: str | None = None) -> None:
    """Give every rank root's optimizer state. ``model`` (Horovod's): a fresh optimizer's sparse parameters
    (``nn.Embedding(sparse=True)``) get sparse zero gradients for the step that creates its state, as in
    Horovod (``SparseAdam`` takes sparse gradients for all of them)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if isinstance(model, torch.nn.Module) and not optimizer.state_dict()["state"]:
        sparse = _sparse_parameters(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None and (isinstance(optimizer, torch.optim.SparseAdam)
                                                           or id(p) in sparse):
                    p.grad = torch.zeros_like(p).to_sparse()
    er.broadcast_optimizer_state(optimizer, root_rank)


class _SparseGradients:
    """Between elastic_ring's DistributedOptimizer and the wrapped optimizer's class: the sparse gradients
    reduced dense are handed back sparse before the wrapped optimizer's own step."""

    _hvd_sparse: dict

    def step(self, closure=None):  # noqa: D401 - torch's signature
        _resparsify(self)
        return super().step(closure)  # type: ignore[misc]


class _HorovodOptimizer:
    """The outermost class of hvd.DistributedOptimizer: Horovod's errors and sparse gradients after
    ``synchronize()``."""

    def synchronize(self) -> None:
        with _horovod_errors():
            super().synchronize()  # type: ignore[misc]
        _resparsify(self)

    def step(self, closure=None):  # noqa: D401 - torch's signature
        with _horovod_errors():
            return super().step(closure)  # type: ignore[misc]


def _resparsify(optimizer: Any) -> None:
    """The gradients that arrived sparse this step, reduced dense, as sparse tensors again (Horovod's
    layout: ``sparse_as_dense=True`` all dimensions sparse, else the gradient's own sparse dimensions)."""
    pending = getattr(optimizer, "_hvd_sparse", None)
    if not pending:
        return
    for p, sparse_dim in list(pending.items()):
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            p.grad = grad.to_sparse() if sparse_dim is None else grad.to_sparse(sparse_dim)
    pending.clear()


def _densify_hooks(params: list[torch.Tensor], pending: dict, sparse_as_dense: bool) -> list:
    """Post-accumulate hooks, registered before the reducer's: a sparse gradient becomes dense (and is
    remembered), so the fused reduction takes it."""

    def densify(p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.is_sparse:
            pending[p] = None if sparse_as_dense else grad.sparse_dim()
            p.grad = grad.to_dense()

    return [p.register_post_accumulate_grad_hook(densify) for p in params]


def _translate_hook_errors(reducer: Any) -> None:
    """Buckets launch from the reducer's gradient hooks, inside ``loss.backward()``: a failure there raises
    :class:`HorovodInternalError` too (as a failed enqueue in Horovod's hooks does). The reducer's hooks are
    registered again, wrapped, in its own handle list (so its ``remove_hooks`` still removes them)."""
    handles, ready, params = (getattr(reducer, "_hooks", None), getattr(reducer, "_on_grad_ready", None),
                              getattr(reducer, "_params", None))
    if not (isinstance(handles, list) and callable(ready) and isinstance(params, list) and len(handles) == len(params)):
        return  # another reducer layout: its errors stay elastic_ring.CommError (still caught by the elastic loop)

    def on_grad_ready(param: torch.Tensor) -> None:
        with _horovod_errors():
            ready(param)

    for handle in handles:
        handle.remove()
    reducer._hooks = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in params]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp | str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer signature over ``elastic_ring.DistributedOptimizer``.

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced dense, in the fused buckets, and handed back to
    the wrapped optimizer sparse (``SparseAdam`` works), with ``sparse_as_dense`` either way: ``True`` as
    Horovod's (all dimensions sparse), ``False`` in the gradient's own layout. Horovod moves them by an allgather
    of indices and values when ``False``; the values are the same."""
    if process_set is not None and process_set is not global_process_set:
        members = getattr(process_set, "ranks", None)
        if members is None or sorted(members) != list(range(size())):
            raise NotImplementedError(
                "DistributedOptimizer over a process set is not supported by elastic_ring: its gradient reduction "
                "runs on the whole ring. Reduce gradients over a set yourself (hvd.grouped_allreduce_ of the "
                "gradients with process_set=...) and use the plain optimizer")
    if gradient_predivide_factor != 1.0:
        raise NotImplementedError("gradient_predivide_factor is not supported by elastic_ring: the average is "
                                  "divided once, while the gradient is copied into its bucket; leave it at 1.0")
    if num_groups or groups is not None:
        raise NotImplementedError("num_groups / groups are not supported by elastic_ring: gradients are fused by "
                                  "size and autotuned (fusion_threshold_bytes in elastic_ring.DistributedOptimizer)")
    reduce_op = _op(None, op)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, _DistributedMixin):
        er.DistributedOptimizer(optimizer, named_parameters)  # raises its TypeError / ValueError
    base = type(optimizer)
    inner_cls = type(base.__name__, (_SparseGradients, base), {})
    inner = inner_cls.__new__(inner_cls)
    inner.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks with `optimizer`
    pending: dict = {}
    params = list({id(p): p for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad}.values())
    hooks = _densify_hooks(params, pending, sparse_as_dense)  # before the reducer's hooks: they run first
    try:
        wrapped = er.DistributedOptimizer(inner, named_parameters, compression=compression,
                                          backward_passes_per_step=backward_passes_per_step, op=reduce_op)
    except BaseException:
        for hook in hooks:
            hook.remove()
        raise
    wrapped.__class__ = type(type(wrapped).__name__, (_HorovodOptimizer, type(wrapped)), {})
    wrapped._hvd_sparse = pending
    wrapped._hvd_hooks = hooks
    reducer = wrapped._er_reducer
    _translate_hook_errors(reducer)
    wrapped._parameter_names = dict(zip(reducer._params, reducer._names))  # Horovod's attribute: parameter -> name
    return wrapped


_ = TensorMismatchError  # re-exported through elastic_ring; kept importable here for `except` clauses
