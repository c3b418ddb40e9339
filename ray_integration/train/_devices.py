"""``ray.train.torch``'s device helpers inside the training function: ``get_device``, ``get_devices``,
``enable_reproducibility``, and the three calls Ray Train V2 removed (``accelerate``, ``prepare_optimizer``,
``backward``), which raise ``DeprecationWarning`` as Ray's do."""

from __future__ import annotations

import os
import random

import torch

#: What Ray Train V2's ``accelerate`` / ``prepare_optimizer`` / ``backward`` say (they raise it, as here).
_AMP_REMOVED = ("`accelerate`, `backward` and `prepare_optimizer` of `ray.train.torch` are deprecated in Ray Train "
                "V2 (ray-project/ray#49454): use PyTorch's own mixed precision (torch.autocast, torch.amp.GradScaler) "
                "and the plain optimizer")


def ring_place() -> tuple[int, int]:
    """(rank, size) in the current ring, formed if a rendezvous is installed; (0, 1) outside any run (Ray Train's
    local mode: a plain script calling these helpers)."""
    import elastic_ring as er

    try:
        return er.rank(), er.size()
    except er.NotInitializedError:
        return 0, 1


def get_devices() -> list[torch.device]:
    """The torch devices of this worker: its GPU (``use_gpu=True``: the worker's CUDA device is already current),
    else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cpu")]


def get_device() -> torch.device:
    """This worker's torch device (``get_devices()[0]``)."""
    return get_devices()[0]


def enable_reproducibility(seed: int = 0) -> None:
    """Ray Train's ``enable_reproducibility``: seed torch, ``random`` and numpy; deterministic algorithms; no cuDNN
    benchmarking; cuBLAS's deterministic workspace (``CUBLAS_WORKSPACE_CONFIG``)."""
    import numpy

    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def accelerate(amp: bool = False) -> None:
    raise DeprecationWarning(_AMP_REMOVED)


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    raise DeprecationWarning(_AMP_REMOVED)


def backward(tensor: torch.Tensor) -> None:
    raise DeprecationWarning(_AMP_REMOVED)
