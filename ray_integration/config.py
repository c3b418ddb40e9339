"""ElasticTrainer's options: one self-validating config whose errors name the field, the value and the fix; and the
deadlines that follow from them (:class:`Limits`, what the driver's decisions read).

Imports nothing of ray_integration: every sub-package may read it (as :mod:`.errors`)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from elastic_ring.core.constants import COLLECTIVE_TIMEOUT_S
from elastic_ring.core.spec import NCCL_REFORMS
from elastic_ring.core.validation import check_bool, check_int, check_number, is_int, is_number

from state.checkpoints.config import check_checkpoint_uri, check_protocol_available

_OWNER = "ElasticTrainer"
#: The persistence cadence used when only checkpoint_uri is given (plus a checkpoint at every stop and drain).
DEFAULT_CHECKPOINT_EVERY_S = 300.0
#: A worker waiting for its ring gives up after max(this, 3 x heartbeat_timeout_s) without a word from the driver.
DRIVER_SILENCE_MIN_S = 60.0
#: lease_ttl_s bounds: renewals (every ttl / 5) must be able to retry a blip; a successor waits at most the upper.
LEASE_TTL_RANGE_S = (1.0, 120.0)


#: What the driver does when ``fn`` raises on a worker (``TrainerConfig.worker_errors``): end the run with that
#: error, or count the worker as lost and replace it (Horovod's elastic mode; the run fails when every worker of
#: a ring failed).
WORKER_ERRORS = ("fail", "replace")

#: How heartbeats reach the driver (``TrainerConfig.heartbeats``): "worker", one message per worker and interval;
#: "node", one per Ray node and interval, forwarded by one of its workers; "auto", "node" from
#: NODE_HEARTBEATS_FROM max_workers on (below that the driver's inbox is nowhere near busy: docs/performance.md).
HEARTBEATS = ("auto", "worker", "node")
NODE_HEARTBEATS_FROM = 64
#: Per node, a worker's counter reaches the driver at least every 2 intervals, and a stalled forwarder's node-mates
#: take over after 1.5 more: heartbeat_timeout_s must cover this many intervals ("auto" stays per worker otherwise).
NODE_HEARTBEAT_TIMEOUT_INTERVALS = 4

#: A member that neither heartbeats nor reaches the rendezvous for this many heartbeat intervals,
#: while its peers report a failure, is presumed dead (a lost node can take Ray many seconds to declare).
SUSPECT_AFTER_INTERVALS = 3
#: Slack added to the longest legitimate wait (a collective timing out, then a ring failing to form)
#: before a member that heartbeats but stays away from the rendezvous is declared stuck.
STUCK_GRACE_S = 2.0


@dataclass(frozen=True)
class Limits:
    """Every deadline the driver keeps, derived from the options (see ``TrainerConfig.limits``)."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    collective_timeout_s: float
    connect_timeout_s: float
    capacity_wait_s: float      # elastic_timeout_s: below min_workers, wait this long for capacity
    stop_timeout_s: float       # after a stop request, the workers have this long to reach a commit
    min_workers: int
    max_workers: int
    max_failures: int
    failure_window_s: float = 3600.0  # failures older than this (driver clock) no longer count
    start_workers: int = 0      # the first ring waits for this many workers (0: min_workers)
    worker_errors: str = "fail"       # fn raised on a member: "fail" the run, or "replace" the worker
    beats_per_node: bool = False      # heartbeats="node" in force: a beat can wait one interval in its file

    @property
    def first_ring_workers(self) -> int:
        """How many workers the first ring waits for: ``start_workers``, at least ``min_workers``."""
        return max(self.min_workers, self.start_workers)

    @property
    def suspect_after_s(self) -> float:
        """Per node, a beat waits up to one interval in its file for the forwarder: one interval more."""
        return (SUSPECT_AFTER_INTERVALS + int(self.beats_per_node)) * self.heartbeat_interval_s

    @property
    def stuck_after_s(self) -> float:
        """A member can legitimately stay away from the rendezvous this long after its peers failed: its own
        collective times out (collective_timeout_s), then a ring it tried to form does (connect_timeout_s)."""
        return self.collective_timeout_s + self.connect_timeout_s + STUCK_GRACE_S


def check_gpus_per_worker(use_gpu: bool, gpus_per_worker: float | None) -> None:
    """Raise ValueError (naming the field, the value and the fix) for a GPU placement the NCCL ring cannot use:
    a fractional GPU per worker (two ranks of one ring on one GPU: NCCL refuses the communicator, "Duplicate GPU
    detected" / "Multiple Ranks are using the same GPU") and more than one GPU per worker (one rank drives one
    GPU: the ring moves tensors of one device per rank; the other GPUs would sit idle)."""
    if not use_gpu or gpus_per_worker is None:
        return
    value = gpus_per_worker
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"ElasticTrainer gpus_per_worker={value!r} must be 1 (one GPU per worker) or None")
    if value < 1 or value != int(value):
        raise ValueError(
            f"ElasticTrainer gpus_per_worker={value!r} is a fraction of a GPU: several workers would share a GPU, "
            "and NCCL refuses two ranks of one ring on one GPU ('Duplicate GPU detected'); use gpus_per_worker=1 "
            "(one worker per GPU), or use_gpu=False to train on CPU with gloo"
        )
    if value > 1:
        raise ValueError(
            f"ElasticTrainer gpus_per_worker={value!r}: each worker is one rank of the NCCL ring and drives one GPU, "
            f"so {int(value) - 1} of its GPUs would sit idle; use gpus_per_worker=1 and {int(value)}x as many "
            "workers (max_workers)"
        )


@dataclass(frozen=True)
class TrainerConfig:
    """Every option of :class:`ElasticTrainer`, with units in the names.

    Worker counts: the job starts once ``min_workers`` workers are up (``start_workers``, if given:
    the first ring waits for that many), grows to ``max_workers`` as capacity appears, and keeps
    training while at least ``min_workers`` are alive. Every wait of the driver and the workers has a
    deadline that follows from these options (:attr:`limits`).
    """

    min_workers: int = 1
    max_workers: int = 1
    start_workers: int | None = None
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    checkpoint_every_n_commits: int | None = None
    checkpoint_every_s: float | None = None
    checkpoint_keep_last: int = 3
    trusted_checkpoints: bool = False
    lease_ttl_s: float = 15.0
    max_failures: int = 10
    failure_window_s: float = 3600.0
    start_timeout_s: float = 120.0
    elastic_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    stop_timeout_s: float = 60.0
    bind_address: str | None = None
    runtime_env: dict[str, Any] | None = None
    progress: bool | None = None
    timeline_path: str | None = None
    tune_allocator: bool = True
    nccl_reform: str = "init"
    worker_errors: str = "fail"
    write_on_notice: bool = True
    heartbeats: str = "auto"

    def __post_init__(self) -> None:
        check_int(_OWNER, "min_workers", self.min_workers, minimum=1)
        check_int(_OWNER, "max_workers", self.max_workers, minimum=1)
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"ElasticTrainer min_workers={self.min_workers} is larger than max_workers={self.max_workers}; "
                "set max_workers >= min_workers"
            )
        if self.start_workers is not None:
            check_int(_OWNER, "start_workers", self.start_workers, minimum=1, hint="or None: min_workers")
            if not self.min_workers <= self.start_workers <= self.max_workers:
                raise ValueError(f"ElasticTrainer start_workers={self.start_workers} must be between min_workers="
                                 f"{self.min_workers} and max_workers={self.max_workers}")
        check_bool(_OWNER, "use_gpu", self.use_gpu)
        check_bool(_OWNER, "write_on_notice", self.write_on_notice)
        check_number(_OWNER, "cpus_per_worker", self.cpus_per_worker, allow_equal=True, unit="CPUs")
        if self.gpus_per_worker is not None:
            check_number(_OWNER, "gpus_per_worker", self.gpus_per_worker, unit="GPUs")
            if not self.use_gpu:
                raise ValueError(f"ElasticTrainer gpus_per_worker={self.gpus_per_worker} needs use_gpu=True")
            check_gpus_per_worker(self.use_gpu, self.gpus_per_worker)
        if not isinstance(self.resources_per_worker, dict) or not all(
            isinstance(k, str) and is_number(v) and v > 0 for k, v in self.resources_per_worker.items()
        ):
            raise ValueError(
                f"ElasticTrainer resources_per_worker={self.resources_per_worker!r} must map resource names to "
                "finite amounts > 0, e.g. {'slot': 1}"
            )
        for reserved in ("CPU", "GPU"):
            if reserved in self.resources_per_worker:
                raise ValueError(
                    f"ElasticTrainer resources_per_worker has {reserved!r}; use cpus_per_worker / gpus_per_worker instead"
                )
        self._check_checkpoints()
        if not isinstance(self.tune_allocator, bool):
            raise ValueError(f"ElasticTrainer tune_allocator={self.tune_allocator!r} must be True or False (False keeps "
                             "glibc's allocator defaults in the worker processes)")
        if self.nccl_reform not in NCCL_REFORMS:
            raise ValueError(f"ElasticTrainer nccl_reform={self.nccl_reform!r} is unknown; use one of {NCCL_REFORMS}")
        if self.nccl_reform != "init" and not self.use_gpu:
            raise ValueError(f"ElasticTrainer nccl_reform={self.nccl_reform!r} re-forms NCCL communicators, which only "
                             "a GPU job has: set use_gpu=True, or drop nccl_reform (gloo re-forms in milliseconds)")
        if self.heartbeats not in HEARTBEATS:
            raise ValueError(f"ElasticTrainer heartbeats={self.heartbeats!r} is unknown; use 'worker' (each worker "
                             "sends its own), 'node' (one worker per node forwards its node's) or 'auto' ('node' from "
                             f"max_workers={NODE_HEARTBEATS_FROM} on)")
        if self.worker_errors not in WORKER_ERRORS:
            raise ValueError(f"ElasticTrainer worker_errors={self.worker_errors!r} is unknown; use 'fail' (fn "
                             "raising on any worker ends the run with that error) or 'replace' (Horovod's elastic "
                             "mode: that worker is lost and replaced, the others go on; the run fails when every "
                             "worker of a ring failed)")
        if not (is_int(self.max_failures) and self.max_failures == -1):  # -1: unlimited, as Ray Train's
            check_int(_OWNER, "max_failures", self.max_failures, minimum=0, hint="or -1 for no limit")
        for name in ("failure_window_s", "start_timeout_s", "elastic_timeout_s", "connect_timeout_s", "heartbeat_interval_s",
                     "heartbeat_timeout_s", "collective_timeout_s", "stop_timeout_s"):
            check_number(_OWNER, name, getattr(self, name), unit="seconds")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"ElasticTrainer heartbeat_timeout_s={self.heartbeat_timeout_s} is shorter than two heartbeats "
                f"(heartbeat_interval_s={self.heartbeat_interval_s}): healthy workers would be killed; set "
                f"heartbeat_timeout_s >= {2 * self.heartbeat_interval_s:g}")
        node_least_s = NODE_HEARTBEAT_TIMEOUT_INTERVALS * self.heartbeat_interval_s
        if self.heartbeats == "node" and self.heartbeat_timeout_s < node_least_s:
            raise ValueError(
                f"ElasticTrainer heartbeats='node' with heartbeat_timeout_s={self.heartbeat_timeout_s}: per node a "
                f"heartbeat can take up to {NODE_HEARTBEAT_TIMEOUT_INTERVALS} intervals (heartbeat_interval_s="
                f"{self.heartbeat_interval_s}) to reach the driver when a forwarder stalls, so healthy workers "
                f"would be killed; set heartbeat_timeout_s >= {node_least_s:g}, or heartbeats='worker'")
        if self.bind_address is not None and (not isinstance(self.bind_address, str) or not self.bind_address):
            raise ValueError(f"ElasticTrainer bind_address={self.bind_address!r} must be an address of the driver's "
                             "machine (e.g. '10.0.0.5'), or None for the address Ray uses for this node")
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(f"ElasticTrainer runtime_env={self.runtime_env!r} must be a dict (Ray's runtime_env)")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"ElasticTrainer progress={self.progress!r} must be True, False or None (auto)")
        if self.timeline_path is not None and not (isinstance(self.timeline_path, (str, os.PathLike))
                                                   and str(self.timeline_path)):
            raise ValueError(f"ElasticTrainer timeline_path={self.timeline_path!r} must be a file path, e.g. "
                             "'timeline.json', or None")

    def _check_checkpoints(self) -> None:
        if self.checkpoint_uri is not None:
            check_checkpoint_uri(self.checkpoint_uri, "ElasticTrainer checkpoint_uri")
            check_protocol_available(self.checkpoint_uri, "ElasticTrainer checkpoint_uri")
        if self.checkpoint_every_n_commits is not None:
            check_int(_OWNER, "checkpoint_every_n_commits", self.checkpoint_every_n_commits, minimum=1)
        if self.checkpoint_every_s is not None:
            check_number(_OWNER, "checkpoint_every_s", self.checkpoint_every_s, unit="seconds")
        check_int(_OWNER, "checkpoint_keep_last", self.checkpoint_keep_last, minimum=1)
        check_bool(_OWNER, "trusted_checkpoints", self.trusted_checkpoints)
        check_number(_OWNER, "lease_ttl_s", self.lease_ttl_s, unit="seconds")
        if not LEASE_TTL_RANGE_S[0] <= self.lease_ttl_s <= LEASE_TTL_RANGE_S[1]:
            raise ValueError(
                f"ElasticTrainer lease_ttl_s={self.lease_ttl_s} must be in [{LEASE_TTL_RANGE_S[0]:g}, "
                f"{LEASE_TTL_RANGE_S[1]:g}] seconds: on an object store (s3://, gs://) the lease is renewed every lease_ttl_s / 5, counts as lost "
                "only after renewals failed for lease_ttl_s, and a crashed run's successor waits lease_ttl_s to take "
                "over; on a file system (an OS lock) lease_ttl_s / 5 is how long a second run waits for the lock "
                "and how often the holder checks it")
        if self.checkpoint_uri is None:
            for name in ("checkpoint_every_n_commits", "checkpoint_every_s"):
                if getattr(self, name) is not None:
                    raise ValueError(f"ElasticTrainer {name}={getattr(self, name)!r} has no effect without "
                                     "checkpoint_uri; set checkpoint_uri too, or drop it")
            if self.trusted_checkpoints:
                raise ValueError("ElasticTrainer trusted_checkpoints=True has no effect without checkpoint_uri")

    @property
    def checkpoint_cadence(self) -> tuple[int | None, float | None]:
        """(every_n_commits, every_s): as given, or every DEFAULT_CHECKPOINT_EVERY_S seconds when neither is."""
        if self.checkpoint_every_n_commits is None and self.checkpoint_every_s is None:
            return None, DEFAULT_CHECKPOINT_EVERY_S
        return self.checkpoint_every_n_commits, self.checkpoint_every_s

    @property
    def driver_silence_s(self) -> float:
        """How long a worker waiting for its ring waits without a word from the driver: long enough that a
        stalled driver (a GC pause, a starved head node) loses no worker; a driver that is gone ends its
        actors through Ray anyway."""
        return max(DRIVER_SILENCE_MIN_S, 3 * self.heartbeat_timeout_s)

    @property
    def heartbeat_mode(self) -> str:
        """``heartbeats`` resolved: "worker" or "node"."""
        if self.heartbeats != "auto":
            return self.heartbeats
        per_node_fits = self.heartbeat_timeout_s >= NODE_HEARTBEAT_TIMEOUT_INTERVALS * self.heartbeat_interval_s
        return "node" if self.max_workers >= NODE_HEARTBEATS_FROM and per_node_fits else "worker"

    @property
    def worker_gpus(self) -> float:
        """GPUs each worker actor asks Ray for: one per GPU by default."""
        if not self.use_gpu:
            return 0.0
        return 1.0 if self.gpus_per_worker is None else float(self.gpus_per_worker)

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"

    @property
    def limits(self) -> Limits:
        return Limits(heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
                      collective_timeout_s=self.collective_timeout_s, connect_timeout_s=self.connect_timeout_s,
                      capacity_wait_s=self.elastic_timeout_s, stop_timeout_s=self.stop_timeout_s,
                      min_workers=self.min_workers, max_workers=self.max_workers,
                      max_failures=sys.maxsize if self.max_failures == -1 else self.max_failures,
                      failure_window_s=self.failure_window_s, start_workers=self.start_workers or 0,
                      worker_errors=self.worker_errors, beats_per_node=self.heartbeat_mode == "node")
