"""elastic_ring: re-formable collectives and a fused, overlapped DistributedOptimizer.

This package knows nothing of Ray or of training state. It offers:

* a ring per *round* (:class:`RingSpec`, :func:`init`), re-formed in the same
  process when membership changes, over gloo (CPU) or NCCL (CUDA, libnccl through ctypes);
* Horovod-style collectives over the current ring, each with a timeout and a
  cross-rank check of what the ranks passed;
* :func:`DistributedOptimizer`, :func:`broadcast_parameters` and
  :func:`broadcast_optimizer_state`;
* the two exceptions that drive elastic training: :class:`CommError` (a collective
  failed: the ring re-forms and the next sync decides between the newest whole
  live state and a rollback) and :class:`MembershipChanged` (re-form at a
  commit, without rolling back).

``er.*`` exports what a training script calls; the plumbing is imported from the
module that owns it (``elastic_ring.ring.store.StoreServer``,
``elastic_ring.core.auth``, ``elastic_ring.core.progress.set_progress``,
``elastic_ring.ring.report.set_reporter``, ``elastic_ring.core.timeline``,
``elastic_ring.ring.runtime``, ``elastic_ring.backends.base.Communicator``...).
"""

from . import shadowing  # binds er.shadowing also when state/ or ray_integration/ loaded it from its file first
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
from .reduction.compression import Compression
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
from .collectives.preemption import get_preemption_info
from .core.ops import Average, Max, Min, Product, ReduceOp, Sum
from .reduction.optimizer import DistributedOptimizer
from .ring.report import report
from .collectives.scatter import alltoall, grouped_reducescatter, reducescatter
from .collectives.sync_batch_norm import SyncBatchNorm
from .ring.runtime import init, is_initialized, local_rank, local_size, rank, round_id, shutdown, size
from .core.spec import Placement, RingSpec, StoreAddress, placements
from .ring.distributed_samplers import DistributedSamplerInTraining, allow_epoch_restart

__version__ = "0.1.0"

__all__ = [
    # the errors
    "AuthenticationError", "CommError", "DistributedSamplerInTraining", "ElasticRingError", "MembershipChanged",
    "NotInitializedError", "RendezvousError", "RingStopped", "TensorMismatchError",
    # the ring: formed by ElasticTrainer, or by hand for a standalone ring (RingSpec, StoreAddress, init)
    "Placement", "RingSpec", "StoreAddress", "init", "is_initialized", "local_rank", "local_size", "nccl_available",
    "placements", "rank", "round_id", "shutdown", "size",
    # Horovod's collectives, their async forms, join
    "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "agree_max", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_tree",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_broadcast_", "grouped_reducescatter", "join", "poll", "process_sets", "reducescatter", "synchronize",
    # Horovod's optimizer and model helpers
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "broadcast_optimizer_state", "broadcast_parameters",
    # elastic training
    "allow_epoch_restart", "elastic", "get_preemption_info", "report",
]
