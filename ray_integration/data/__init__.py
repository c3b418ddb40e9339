"""``ray_integration.data``: Ray Data input, every row trained exactly once per epoch across kills, drains and joins.

It owns the datasets' preparation on the driver (:mod:`.prepare`), the elastic shard a worker reads
(:mod:`.shard`) and the conversion of Ray Data blocks to batches (:mod:`.convert`). It imports nothing of
ray_integration (``elastic_ring``, ``state`` and Ray Data only): the trainer, the worker side and
``ray_integration.train`` import it.

On the driver, ``ElasticTrainer(datasets={"train": ds})`` calls :func:`prepare_datasets` (each dataset
materialized once, its blocks recorded in order); every worker calls :func:`install` with the result
before ``fn``; inside ``fn``, :func:`get_dataset_shard` gives an :class:`ElasticDataShard`, an
``ElasticSampler`` over the dataset's global row indices that yields Ray Data batches::

    shard = get_dataset_shard("train")
    state = TorchState(model=model, optimizer=optimizer, sampler=shard, epoch=0)

    @er.elastic.run
    def loop(state):
        for state.epoch in range(state.epoch, epochs):
            shard.set_epoch(state.epoch)     # the epoch is the shard's (saved) state, not one per iter_*() call
            for batch in shard.iter_torch_batches(batch_size=32):
                ...; optimizer.step()
            state.commit()

See docs/ray_data.md for the design, its costs and what it needs from the dataset.
"""

from __future__ import annotations


from .prepare import BlockSpan, PreparedDataset, PreparedDatasets, block_digest, prepare_datasets
from .shard import DEFAULT_BATCH_SIZE, ElasticDataShard, block_order

_installed: PreparedDatasets | None = None


def install(prepared: PreparedDatasets | None) -> None:
    """Make ``prepared`` (from :func:`prepare_datasets`, or None) what :func:`get_dataset_shard` reads in this
    process (each worker, before ``fn``)."""
    global _installed
    if prepared is not None and not isinstance(prepared, PreparedDatasets):
        raise TypeError(f"install() takes what prepare_datasets() returned (or None), got {type(prepared).__name__}")
    _installed = prepared


def get_dataset_shard(name: str, *, batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = True, seed: int = 0,
                      global_batch_size: int | None = None, cache_blocks: int = 2) -> ElasticDataShard:
    """This rank's shard of the dataset ``name`` given as ``ElasticTrainer(datasets={name: ds})``, inside ``fn``.

    Keep it in the state (``TorchState(..., sampler=shard)``) and iterate ``shard.iter_torch_batches(...)`` or
    ``shard.iter_batches(...)`` inside ``@er.elastic.run``. ``shuffle``/``seed``: a seeded per-epoch order of
    the blocks, rows shuffled within each (the same on every rank); ``shuffle=False`` keeps the dataset's
    order. The other arguments are ElasticSampler's."""
    if not isinstance(name, str):
        raise TypeError(f"get_dataset_shard(name) takes the dataset's name as a string, got {name!r}")
    if _installed is None:
        raise ValueError(f"get_dataset_shard({name!r}): this job was given no datasets; pass them to the trainer as "
                         f"ElasticTrainer(datasets={{{name!r}: ds}})")
    if name not in _installed.datasets:
        raise ValueError(f"get_dataset_shard({name!r}): no dataset of that name; this job's datasets are "
                         f"{_installed.names} (from ElasticTrainer(datasets={{...}}))")
    return ElasticDataShard(_installed.datasets[name], batch_size, shuffle, seed, global_batch_size,
                            cache_blocks=cache_blocks)


def installed() -> PreparedDatasets | None:
    """What :func:`install` last installed in this process."""
    return _installed


__all__ = ["BlockSpan", "DEFAULT_BATCH_SIZE", "ElasticDataShard", "PreparedDataset", "PreparedDatasets",
           "block_digest", "block_order", "get_dataset_shard", "install", "installed", "prepare_datasets"]
