"""``ray_integration.horovod``: Horovod's PyTorch API over elastic_ring, ``import ray_integration.horovod as hvd``.

A Horovod (elastic) PyTorch script runs with only its import line changed, under
``python -m ray_integration.launch`` (or inside ``ElasticTrainer(...).run``). The
calls keep Horovod's names, signatures, defaults and semantics (``average=`` or
``op=``, ``prescale_factor`` / ``postscale_factor``, ``root_rank`` positional,
mismatches as ``RuntimeError``); each maps onto ``elastic_ring`` and ``state``
(docs/migration.md has the table). The ``_async`` calls return at once and run in the background: unnamed, in
call order on their communicator's queue (:mod:`elastic_ring.collectives.ordered`); named, paired by name as
Horovod's coordinator pairs them (:mod:`elastic_ring.collectives.negotiation`); as Horovod's, one whose ``name``
an operation not synchronized yet holds raises ``ValueError`` at once (:func:`.session.launch_async`). Each
worker's environment holds Horovod's launch variables (``HOROVOD_RANK``, ...) from the first ring it joins
(:mod:`ray_integration.wire.launch_env`). Process sets run on sub-rings of their ranks
(:mod:`elastic_ring.ring.process_sets`); sparse tensors are reduced by an allgather of their indices and
values as in Horovod, and sparse gradients of ``DistributedOptimizer`` are reduced dense and handed
back sparse. A failed collective raises :class:`HorovodInternalError`, a ``RuntimeError`` (as
Horovod's) and an :class:`elastic_ring.CommError` (the elastic loop's "roll back and re-form").
``op=hvd.Adasum`` is Horovod's Adasum (:mod:`.adasum`); ``DistributedOptimizer`` over a process set and with
``op=Adasum`` reduce at the step in this layer (:mod:`.step_reduced`); ``start_timeline`` / ``stop_timeline``
write rank 0's timeline (:mod:`.timeline`). The modules: :mod:`.errors`, :mod:`.topology`, :mod:`.process_sets`,
:mod:`.session` (init, shutdown), :mod:`.ops` (collectives, sparse, objects, join), :mod:`.async_ops`,
:mod:`.optimizer`, :mod:`.elastic`. What elastic_ring does not offer is refused with an error that says so and
what to use instead, never ignored: ``gradient_predivide_factor``, ``num_groups`` / ``groups``, and (as in
Horovod) Adasum on a number of ranks that is not a power of two. ``join`` works with optimizer steps on the other
ranks: ``DistributedOptimizer`` leads each step with its check by default here (``strict_checks=True``).

It owns Horovod's API and nothing else; it may import ``ray_integration.errors`` (``HorovodInternalError``) and
``ray_integration.wire`` (the timeline's trace layout), never the driver or the worker actor: a script imports
it inside a worker, wherever ``fn`` runs.
"""

from __future__ import annotations

# names this module has always had (re-exported: scripts may use them)
import torch  # noqa: F401

import elastic_ring as er
from elastic_ring.collectives.handles import Handle
from elastic_ring.collectives.sync_batch_norm import SyncBatchNorm
from elastic_ring.core.errors import NotInitializedError, TensorMismatchError
from elastic_ring.core.ops import Average, Max, Min, Product, ReduceOp, Sum
from elastic_ring.reduction.compression import Compression
from elastic_ring.ring import runtime

from . import elastic
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from .topology import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                       is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                       mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .session import init, shutdown
from .ops import (Adasum, allgather, allgather_object, allreduce, allreduce_, alltoall, barrier, broadcast,
                  broadcast_, broadcast_object, grouped_allgather, grouped_allreduce, grouped_allreduce_,
                  grouped_reducescatter, join, reducescatter, sparse_allreduce_async)
from .async_ops import (allgather_async, allreduce_async, allreduce_async_, alltoall_async, broadcast_async,
                        broadcast_async_, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter_async, poll, reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .timeline import start_timeline, stop_timeline

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
    "start_timeline", "stop_timeline",
]

