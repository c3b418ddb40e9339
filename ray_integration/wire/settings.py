"""What the driver tells every worker before ``fn`` runs: :class:`WorkerSettings`, sent through Ray with
``RingWorker.run`` (built by the trainer, read by the worker's ``_install``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_ring.core.validation import check_bool, check_number
from state import CheckpointConfig

_OWNER = "WorkerSettings"
#: How the workers' heartbeats reach the driver (resolved: ElasticTrainer's "auto" is one of these).
HEARTBEAT_MODES = ("worker", "node")


@dataclass(frozen=True)
class WorkerSettings:
    """One worker's set-up for the job, checked when it is made (on the driver, before any worker starts).

    ``driver_silence_s``: a worker waiting for its ring gives up after this long without a word from the driver.
    ``flush_timeout_s``: how long a worker leaving the job waits for its checkpoint writes.
    ``checkpoint``: the job's durable checkpointing (None: none), carrying the lease generation of the driver.
    ``use_gpu``: drive the worker's CUDA device (one per worker, from Ray's GPU ids).
    ``timeline``: record timeline events and send them to the driver.
    ``tune_allocator``: keep freed gradient-sized blocks in the heap (no page faults per step).
    ``datasets``: what :func:`ray_integration.data.prepare_datasets` made of ``ElasticTrainer(datasets=...)``, or
    None (checked by :func:`ray_integration.data.install` on the worker).
    ``heartbeats``: ``"worker"`` (each worker sends its own) or ``"node"`` (one worker per Ray node forwards its
    node's: :mod:`ray_integration.worker.node_beats`); ``ElasticTrainer(heartbeats=...)`` resolved.
    """

    driver_silence_s: float
    flush_timeout_s: float
    checkpoint: CheckpointConfig | None = None
    use_gpu: bool = False
    timeline: bool = False
    tune_allocator: bool = True
    datasets: Any = None
    heartbeats: str = "worker"

    def __post_init__(self) -> None:
        check_number(_OWNER, "driver_silence_s", self.driver_silence_s, unit="seconds")
        check_number(_OWNER, "flush_timeout_s", self.flush_timeout_s, unit="seconds")
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise TypeError(f"WorkerSettings checkpoint={self.checkpoint!r} must be a state.CheckpointConfig or None")
        for name in ("use_gpu", "timeline", "tune_allocator"):
            check_bool(_OWNER, name, getattr(self, name))
        if self.heartbeats not in HEARTBEAT_MODES:
            raise ValueError(f"WorkerSettings heartbeats={self.heartbeats!r} must be one of {HEARTBEAT_MODES}")
