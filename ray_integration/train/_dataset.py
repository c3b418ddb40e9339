"""Ray Train's ``get_dataset_shard(dataset_name)`` inside the training function."""

from __future__ import annotations

from typing import Any


def get_dataset_shard(dataset_name: str | None = None, **options: Any) -> Any:
    """Ray Train's ``get_dataset_shard(dataset_name)``: this worker's part of ``ElasticTrainer(datasets={name:
    ...})``; ``options`` as :func:`ray_integration.data.get_dataset_shard` takes them (imported when first called).
    ``name=`` (this function's keyword before) is accepted too."""
    from ..data import get_dataset_shard as shard

    if "name" in options:
        if dataset_name is not None:
            raise TypeError(f"get_dataset_shard got dataset_name={dataset_name!r} and name={options['name']!r}; "
                            "give one (dataset_name, as Ray Train's)")
        dataset_name = options.pop("name")
    if dataset_name is None:
        raise TypeError("get_dataset_shard() needs the dataset's name: get_dataset_shard('train') for "
                        "ElasticTrainer(datasets={'train': ds})")
    return shard(dataset_name, **options)
