"""ElasticTrainer's options: one self-validating config whose errors name the field, the value and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from elastic_ring.constants import COLLECTIVE_TIMEOUT_S


def _positive(name: str, value: Any, integer: bool = False, allow_zero: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        what = "an int" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"ElasticTrainer {name}={value!r} must be {what} {bound}")


@dataclass(frozen=True)
class TrainerConfig:
    """Every option of :class:`ElasticTrainer`, with units in the names.

    Worker counts: the job starts once ``min_workers`` workers are up, grows to
    ``max_workers`` as capacity appears, and keeps training while at least
    ``min_workers`` are alive.
    """

    min_workers: int = 1
    max_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    checkpoint_every_n_commits: int | None = None
    checkpoint_every_s: float | None = None
    checkpoint_keep_last: int = 3
    max_failures: int = 10
    start_timeout_s: float = 120.0
    elastic_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 10.0
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    runtime_env: dict[str, Any] | None = None
    progress: bool | None = None
    timeline_path: str | None = None

    def __post_init__(self) -> None:
        _positive("min_workers", self.min_workers, integer=True)
        _positive("max_workers", self.max_workers, integer=True)
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"ElasticTrainer min_workers={self.min_workers} is larger than max_workers={self.max_workers}; "
                "set max_workers >= min_workers"
            )
        if not isinstance(self.use_gpu, bool):
            raise ValueError(f"ElasticTrainer use_gpu={self.use_gpu!r} must be True or False")
        _positive("cpus_per_worker", self.cpus_per_worker, allow_zero=True)
        if self.gpus_per_worker is not None:
            _positive("gpus_per_worker", self.gpus_per_worker)
            if not self.use_gpu:
                raise ValueError(f"ElasticTrainer gpus_per_worker={self.gpus_per_worker} needs use_gpu=True")
        if not isinstance(self.resources_per_worker, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in self.resources_per_worker.items()
        ):
            raise ValueError(
                f"ElasticTrainer resources_per_worker={self.resources_per_worker!r} must map resource names to "
                "amounts > 0, e.g. {'slot': 1}"
            )
        for reserved in ("CPU", "GPU"):
            if reserved in self.resources_per_worker:
                raise ValueError(
                    f"ElasticTrainer resources_per_worker has {reserved!r}; use cpus_per_worker / gpus_per_worker instead"
                )
        if self.checkpoint_uri is not None:
            if not isinstance(self.checkpoint_uri, str) or not self.checkpoint_uri:
                raise ValueError(f"ElasticTrainer checkpoint_uri={self.checkpoint_uri!r} must be a path or fsspec URL")
            if self.checkpoint_every_n_commits is None and self.checkpoint_every_s is None:
                raise ValueError(
                    "ElasticTrainer checkpoint_uri is set but neither checkpoint_every_n_commits nor "
                    "checkpoint_every_s is: say how often to persist"
                )
        if self.checkpoint_every_n_commits is not None:
            _positive("checkpoint_every_n_commits", self.checkpoint_every_n_commits, integer=True)
        if self.checkpoint_every_s is not None:
            _positive("checkpoint_every_s", self.checkpoint_every_s)
        _positive("checkpoint_keep_last", self.checkpoint_keep_last, integer=True)
        _positive("max_failures", self.max_failures, integer=True, allow_zero=True)
        for name in ("start_timeout_s", "elastic_timeout_s", "heartbeat_timeout_s", "collective_timeout_s"):
            _positive(name, getattr(self, name))
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(f"ElasticTrainer runtime_env={self.runtime_env!r} must be a dict (Ray's runtime_env)")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"ElasticTrainer progress={self.progress!r} must be True, False or None (auto)")
        if self.timeline_path is not None and not (isinstance(self.timeline_path, (str, os.PathLike))
                                                   and str(self.timeline_path)):
            raise ValueError(f"ElasticTrainer timeline_path={self.timeline_path!r} must be a file path, e.g. "
                             "'timeline.json', or None")

    @property
    def worker_gpus(self) -> float:
        """GPUs each worker actor asks Ray for: one per GPU by default."""
        if not self.use_gpu:
            return 0.0
        return 1.0 if self.gpus_per_worker is None else float(self.gpus_per_worker)

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"
