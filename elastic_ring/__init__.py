"""elastic_ring: re-formable collectives and a fused, overlapped DistributedOptimizer.

This package knows nothing of Ray or of training state. It offers:

* a ring per *round* (:class:`RingSpec`, :func:`init`), re-formed in the same
  process when membership changes, over gloo (CPU) or NCCL (CUDA, libnccl through ctypes);
* Horovod-style collectives over the current ring, each with a timeout and a
  cross-rank check of what the ranks passed;
* :func:`DistributedOptimizer`, :func:`broadcast_parameters` and
  :func:`broadcast_optimizer_state`;
* the two exceptions that drive elastic training: :class:`CommError` (roll
  back) and :class:`MembershipChanged` (re-form without rolling back).
"""

from . import shadowing  # binds er.shadowing also when state/ or ray_integration/ loaded it from its file first
from .core import allocator, auth, progress, timeline
from .ring import elastic, process_sets
from .collectives.broadcast_state import broadcast_optimizer_state, broadcast_parameters
from .collectives.tensors import (
    agree_max,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_broadcast_,
)
from .backends.base import Communicator, Work
from .reduction.compression import Compression, Compressor
from .core.errors import (
    AuthenticationError, CommError, ElasticRingError, MembershipChanged, NotInitializedError, RendezvousError, RingStopped,
    TensorMismatchError,
)
from .collectives.handles import (
    allgather_async, allreduce_async, allreduce_async_, broadcast_async, broadcast_async_, grouped_allreduce_async,
    grouped_allreduce_async_, poll, synchronize,
)
from .backends.nccl.communicator import nccl_available
from .collectives.objects import allgather_object, broadcast_object, broadcast_tree
from .collectives.join import join
from .core.ops import Average, Max, Min, Product, ReduceOp, Sum
from .reduction.optimizer import DistributedOptimizer
from .core.progress import set_progress
from .ring.report import report, set_reporter
from .collectives.scatter import alltoall, grouped_reducescatter, reducescatter
from .collectives.sync_batch_norm import SyncBatchNorm
from .ring.runtime import init, is_initialized, local_rank, local_size, rank, round_id, shutdown, size
from .core.spec import RingSpec, StoreAddress
from .ring.store import StoreServer
# the er.<module> names scripts and tests use, bound as before the sub-packages (issue 24)
from .collectives import objects as object_collectives
from .ring import runtime, store
from . import nccl_communicator  # the old path of backends.nccl.communicator, an alias
from .ring.distributed_samplers import DistributedSamplerInTraining, allow_epoch_restart

__version__ = "0.1.0"

#: Module paths from before the sub-packages (``import elastic_ring.errors``, ``from elastic_ring.distributed_samplers
#: import allow_epoch_restart``): each stays importable as an alias of its new module. Not ``elastic_ring.collectives``
#: (now the sub-package of the collectives API; its functions are ``er.allreduce`` and so on, as before).
_OLD_PATHS = {
    "errors": "core.errors", "constants": "core.constants", "validation": "core.validation", "ops": "core.ops",
    "spec": "core.spec", "identity": "core.identity", "log": "core.log",
    "communicator": "backends.base", "formation": "backends.formation", "reaper": "backends.reaper",
    "byte_collectives": "backends.byte_collectives", "gloo_communicator": "backends.gloo",
    "nccl_lib": "backends.nccl.lib", "nccl_handle": "backends.nccl.handle", "nccl_watchdog": "backends.nccl.watchdog",
    "nccl_reform": "backends.nccl.reform", "distributed_samplers": "ring.distributed_samplers", "report": "ring.report",
    "compression": "reduction.compression", "fusion": "reduction.fusion", "autotune": "reduction.autotune",
    "signature": "reduction.signature", "verdict": "reduction.verdict", "step_trailer": "reduction.step_trailer",
    "grad_buckets": "reduction.buckets", "grad_reducer": "reduction.reducer", "optimizer": "reduction.optimizer",
    "handles": "collectives.handles", "scatter": "collectives.scatter", "sync_batch_norm": "collectives.sync_batch_norm",
    "broadcast_state": "collectives.broadcast_state",
}


def _alias_old_paths() -> None:
    import importlib
    import sys

    for old, new in _OLD_PATHS.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules.setdefault(f"{__name__}.{old}", module)
        if old not in globals():  # er.report stays the function
            globals()[old] = module


_alias_old_paths()

__all__ = [
    "AuthenticationError", "Average", "CommError", "Communicator", "Compression", "Compressor", "DistributedOptimizer",
    "ElasticRingError", "Max", "MembershipChanged", "Min", "NotInitializedError", "Product", "ReduceOp", "RendezvousError", "RingSpec", "RingStopped",
    "StoreAddress", "StoreServer", "Sum", "TensorMismatchError", "Work", "agree_max", "allgather", "allgather_object", "allreduce",
    "allreduce_", "auth", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "broadcast_tree", "grouped_allreduce", "grouped_allreduce_", "grouped_broadcast_",
    "elastic", "init", "is_initialized", "local_rank", "local_size", "nccl_available", "rank", "report", "round_id",
    "set_progress", "set_reporter", "shutdown", "size", "timeline",
    "allgather_async", "allreduce_async", "allreduce_async_", "alltoall", "broadcast_async", "broadcast_async_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "poll", "reducescatter",
    "synchronize", "SyncBatchNorm", "process_sets", "DistributedSamplerInTraining", "allow_epoch_restart", "join",
]
