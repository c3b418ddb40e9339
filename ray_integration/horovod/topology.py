"""Horovod's topology calls (rank, size, local and cross ranks) and build flags over elastic_ring's ring."""

from __future__ import annotations

import torch

import elastic_ring as er
from elastic_ring.core.errors import NotInitializedError
from elastic_ring.ring import runtime

from .errors import _LAUNCH


class _Session:
    """This script's hvd session: whether it called hvd.shutdown() since its last hvd.init() (Horovod's
    is_initialized() then says False and rank() raises; the ring itself belongs to the launcher and stays), and
    the names of its ``_async`` operations not synchronized yet (:mod:`.session` keeps them)."""

    shut = False
    #: (process set id, Horovod's op prefix, name) -> (the ring round it was started in, its handle's id); see
    #: session.launch_async
    in_flight: dict[tuple[int, str, str], tuple[int, int]] = {}


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
    return _spec().placement.local_rank


def local_size() -> int:
    return _spec().placement.local_size


def cross_rank() -> int:
    """This node's index among the nodes that have a rank with this rank's local rank."""
    return _spec().placement.cross_rank


def cross_size() -> int:
    return _spec().placement.cross_size


def is_homogeneous() -> bool:
    return _spec().placement.homogeneous


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
