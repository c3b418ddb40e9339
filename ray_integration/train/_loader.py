"""``ray.train.torch.prepare_data_loader``: each rank's share of the current ring, as Ray Train's.

With more than one worker the loader is rebuilt with a torch ``DistributedSampler`` over the current ring
(``shuffle`` kept from the original sampler, seed 0, the padding of a ``DistributedSampler``), as Ray Train does;
``sampler.set_epoch(epoch)`` works as there. Under the drop-in's ``TorchTrainer`` every new ring re-enters the
training function, which prepares its loaders again for that ring; a loader the elastic loop can reach is also
re-pointed at every new ring (:mod:`elastic_ring.ring.distributed_samplers`). A loader whose batches come from an
``ElasticSampler`` (``DataLoader(ds, batch_sampler=ElasticSampler(...))``: exactly-once across failures and resizes)
is kept as it is: it splits over the ring already. On a GPU the batches are moved to the worker's device.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, \
    SequentialSampler

from state import ElasticSampler

from ._devices import get_device, ring_place


def prepare_data_loader(data_loader: DataLoader, add_dist_sampler: bool = True, move_to_device: bool = True,
                        auto_transfer: bool = True) -> DataLoader:
    """Ray Train's ``prepare_data_loader`` (module docstring)."""
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"prepare_data_loader expects a torch DataLoader, got {type(data_loader).__name__}")
    rank, size = ring_place()
    elastic = isinstance(data_loader.batch_sampler, ElasticSampler) or isinstance(data_loader.sampler, ElasticSampler)
    if (size > 1 and add_dist_sampler and not elastic and not isinstance(data_loader.sampler, DistributedSampler)
            and not isinstance(data_loader.dataset, IterableDataset)):
        data_loader = _with_distributed_sampler(data_loader, size, rank)
    device = get_device()
    if move_to_device and device.type != "cpu":
        return _DeviceLoader(data_loader, device, auto_transfer)
    return data_loader


def _with_distributed_sampler(loader: DataLoader, size: int, rank: int) -> DataLoader:
    if loader.batch_sampler is not None and loader.batch_size is None:  # built with batch_sampler=...
        raise ValueError(f"prepare_data_loader got a DataLoader with batch_sampler={type(loader.batch_sampler).__name__}"
                         ": a DistributedSampler cannot be put under it (Ray Train's drops it, and its loader then "
                         "yields single samples). Use DataLoader(ds, batch_sampler=state.ElasticSampler(ds, "
                         "batch_size=B)), which splits over the ring itself, or pass add_dist_sampler=False and split "
                         "the data yourself with get_context().get_world_rank() / get_world_size()")
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    if not isinstance(loader.sampler, (SequentialSampler, RandomSampler)) and rank == 0:
        import warnings

        warnings.warn(f"prepare_data_loader replaces the DataLoader's {type(loader.sampler).__name__} with a "
                      "DistributedSampler (as Ray Train does); pass add_dist_sampler=False to keep it", UserWarning,
                      stacklevel=3)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                      sampler=DistributedSampler(loader.dataset, num_replicas=size, rank=rank, shuffle=shuffle))


class _DeviceLoader(DataLoader):
    """The loader, its batches moved to ``device`` (tensors inside mappings, tuples and lists too). Its attributes
    are the base loader's (``.sampler.set_epoch(e)``, ``len()``), as Ray Train's wrapper keeps them."""

    def __init__(self, base: DataLoader, device: torch.device, non_blocking: bool) -> None:  # noqa: D107
        self.__dict__.update(base.__dict__)
        self._base, self._device, self._non_blocking = base, device, non_blocking

    def __len__(self) -> int:
        return len(self._base)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._base:
            yield self._move(batch)

    def _move(self, item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.to(self._device, non_blocking=self._non_blocking)
        if isinstance(item, collections.abc.Mapping):
            return {k: self._move(v) for k, v in item.items()}
        if isinstance(item, tuple):
            return tuple(self._move(v) for v in item)
        if isinstance(item, list):
            return [self._move(v) for v in item]
        return item
