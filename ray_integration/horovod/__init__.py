"""Horovod's PyTorch API over elastic_ring: ``import ray_integration.horovod as hvd``.

A Horovod (elastic) PyTorch script runs with only its import line changed, under
``python -m ray_integration.launch`` (or inside ``ElasticTrainer(...).run``). The
calls keep Horovod's names, signatures, defaults and semantics (``average=`` or
``op=``, ``prescale_factor`` / ``postscale_factor``, ``root_rank`` positional,
mismatches as ``RuntimeError``); each maps onto ``elastic_ring`` and ``state``
(docs/migration.md has the table). The ``_async`` calls are launched at the call and
paired by call order (:mod:`elastic_ring.handles`). What elastic_ring does not offer is refused
with an error that says so and what to use instead, never ignored: Adasum,
process sets other than the global one, ``sparse_as_dense`` and
``num_groups`` / ``groups``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

import elastic_ring as er
from elastic_ring import runtime
from elastic_ring.compression import Compression
from elastic_ring.errors import NotInitializedError, TensorMismatchError
from elastic_ring.handles import Handle, poll, synchronize
from elastic_ring.ops import Average, Max, Min, Product, ReduceOp, Sum
from elastic_ring.sync_batch_norm import SyncBatchNorm

from . import elastic

__all__ = [
    "Adasum", "Average", "Product", "Compression", "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "ProcessSet", "Sum", "SyncBatchNorm", "allgather", "alltoall_async", "ccl_built", "ddl_built",
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

#: Horovod's exception names, for ``except`` clauses in ported scripts: a lost peer / a membership change.
HorovodInternalError = er.CommError
HostsUpdatedInterrupt = er.MembershipChanged

_LAUNCH = ("run the script with `python -m ray_integration.launch [--min-workers N] [--max-workers M] script.py "
           "[args]` (or call it inside ElasticTrainer(...).run(fn)): elastic_ring forms the ring for you")


class ProcessSet:
    """Horovod's process sets: only the global one (every rank of the current ring) exists here."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        if ranks is not None:
            raise NotImplementedError("process sets other than the global one are not supported by elastic_ring; "
                                      "use the global ring (process_set=hvd.global_process_set or leave it out)")

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True


global_process_set = ProcessSet()


def _global_only(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets other than the global one are not supported by elastic_ring; "
                                  "leave process_set out")


# ------------------------------------------------------------------ init and topology
class _Session:
    """Whether this script called hvd.shutdown() since its last hvd.init() (Horovod's is_initialized() then says
    False and rank() raises; the ring itself belongs to the launcher and stays)."""

    shut = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Form (or join) this worker's ring. There is nothing to configure: the launcher or ElasticTrainer did."""
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) takes an MPI communicator; elastic_ring has no MPI: " + _LAUNCH)
    if process_sets not in (None, "dynamic") and process_sets != []:
        raise NotImplementedError("process sets other than the global one are not supported by elastic_ring")
    try:
        runtime.current()
    except NotInitializedError:
        raise NotInitializedError("hvd.init() found no ring to join: " + _LAUNCH) from None
    _Session.shut = False


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
    from elastic_ring import nccl_lib

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


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Horovod's allreduce (differentiable): ``postscale * reduce(prescale * tensor)``."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    return grouped_allreduce_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)[0]


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    _global_only(process_set)
    reduced = er.grouped_allreduce(_scaled(tensors, prescale_factor), op=_op(average, op), name=name,
                                   compression=compression)
    return _scaled(reduced, postscale_factor)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    _global_only(process_set)
    with torch.no_grad():
        for t in tensors:
            t.copy_(_scale(t, prescale_factor))
        er.grouped_allreduce_(list(tensors), op=_op(average, op), name=name)
        for t in tensors:
            t.copy_(_scale(t, postscale_factor))
    return list(tensors)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    _global_only(process_set)
    return er.allgather(tensor, name=name)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    _global_only(process_set)
    return [er.allgather(t, name=None if name is None else f"{name}.{i}") for i, t in enumerate(tensors)]


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    _global_only(process_set)
    return er.broadcast(tensor, root_rank, name=name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    _global_only(process_set)
    with torch.no_grad():
        return er.broadcast_(tensor, root_rank, name=name)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none,
                  op: ReduceOp | str = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression=Compression.none,
                          op: ReduceOp | str = Average, process_set: Any = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    _global_only(process_set)
    if compression is not Compression.none:
        raise NotImplementedError("reducescatter with compression is not supported by elastic_ring; leave it out")
    out = er.grouped_reducescatter(_scaled(tensors, prescale_factor), op=_op(None, op), name=name)
    return _scaled(out, postscale_factor)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set: Any = global_process_set):
    _global_only(process_set)
    return er.alltoall(tensor, splits, name=name)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set):
    _global_only(process_set)
    if prescale_factor == postscale_factor == 1.0:  # launched now, runs while the script works
        return er.allreduce_async(tensor, op=_op(average, op), name=name)
    return Handle(lambda: allreduce(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set):
    _global_only(process_set)
    if prescale_factor == postscale_factor == 1.0:
        return er.allreduce_async_(tensor, op=_op(average, op), name=name)
    return Handle(lambda: allreduce_(tensor, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set):
    _global_only(process_set)
    if prescale_factor == postscale_factor == 1.0:
        return er.grouped_allreduce_async(list(tensors), op=_op(average, op), name=name)
    return Handle(lambda: grouped_allreduce(tensors, average, name, Compression.none, op, prescale_factor,
                                            postscale_factor))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set):
    _global_only(process_set)
    if prescale_factor == postscale_factor == 1.0:
        return er.grouped_allreduce_async_(list(tensors), op=_op(average, op), name=name)
    return Handle(lambda: grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor))


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


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    _global_only(process_set)
    return er.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list:
    _global_only(process_set)
    return er.allgather_object(obj)


def barrier(process_set: Any = global_process_set) -> None:
    _global_only(process_set)
    er.barrier()


def broadcast_parameters(params, root_rank: int, prefix: str | None = None) -> None:
    er.broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, prefix: str | None = None) -> None:
    er.broadcast_optimizer_state(optimizer, root_rank)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp | str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer signature over ``elastic_ring.DistributedOptimizer``."""
    _global_only(process_set)
    if gradient_predivide_factor != 1.0:
        raise NotImplementedError("gradient_predivide_factor is not supported by elastic_ring: the average is "
                                  "divided once, while the gradient is copied into its bucket; leave it at 1.0")
    if num_groups or groups is not None:
        raise NotImplementedError("num_groups / groups are not supported by elastic_ring: gradients are fused by "
                                  "size and autotuned (fusion_threshold_bytes in elastic_ring.DistributedOptimizer)")
    if sparse_as_dense:
        raise NotImplementedError("sparse_as_dense is not supported by elastic_ring: use dense embeddings "
                                  "(nn.Embedding(sparse=False))")
    wrapped = er.DistributedOptimizer(optimizer, named_parameters, compression=compression,
                                      backward_passes_per_step=backward_passes_per_step, op=_op(None, op))
    reducer = wrapped._er_reducer
    wrapped._parameter_names = dict(zip(reducer._params, reducer._names))  # Horovod's attribute: parameter -> name
    return wrapped


_ = TensorMismatchError  # re-exported through elastic_ring; kept importable here for `except` clauses
