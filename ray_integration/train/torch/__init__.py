"""``ray_integration.train.torch``: ``ray.train.torch`` for a Ray Train script whose imports name ``ray_integration``.

    from ray_integration.train.torch import TorchTrainer, prepare_data_loader, prepare_model

* :class:`TorchTrainer` (Ray Train 2.60's signature) runs ``train_loop_per_worker`` on an elastic ring: a lost worker
  costs a re-entry of the function in the surviving processes, from the newest reported checkpoint held in memory or
  on their disks, instead of a restart of every worker (``fit()`` otherwise as Ray Train V2's: it returns
  ``ray.train.Result``, raises ``ray.train.WorkerGroupError``).
* Inside the function: :func:`prepare_model` (a data-parallel wrapper reducing gradients in elastic_ring's fused,
  overlapped buckets; ``isinstance(model, DistributedDataParallel)`` holds), :func:`prepare_data_loader` (each
  rank's share of the current ring), :func:`get_device`, :func:`get_devices`, :func:`enable_reproducibility`;
  ``accelerate``, ``prepare_optimizer``, ``backward`` raise ``DeprecationWarning`` as Ray Train V2's do.
* ``TorchConfig`` and ``TorchCheckpoint`` are Ray's own classes.

This package is a front door (it builds an ``ElasticTrainer``): ``tests/test_layering.py`` lets it import every unit.
The calls inside the function live in :mod:`ray_integration.train` (the worker side), which never imports this one.
"""

from .._devices import accelerate, backward, enable_reproducibility, get_device, get_devices, prepare_optimizer
from .._loader import prepare_data_loader
from .._model import ElasticDataParallel, prepare_model
from ._trainer import TorchTrainer

_FROM_RAY = ("TorchCheckpoint", "TorchConfig")


def __getattr__(name: str):
    """Ray's own ``TorchConfig`` / ``TorchCheckpoint`` (imported when first named: importing this package does not
    import ``ray.train``)."""
    if name in _FROM_RAY:
        import ray.train.torch

        return getattr(ray.train.torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ElasticDataParallel", "TorchCheckpoint", "TorchConfig", "TorchTrainer", "accelerate", "backward",
           "enable_reproducibility", "get_device", "get_devices", "prepare_data_loader", "prepare_model",
           "prepare_optimizer"]
