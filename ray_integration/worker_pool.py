"""The driver's effects on Ray: create, observe, answer, notify and kill worker actors.

Everything here *does*; nothing decides. The driver's states read the
records this pool keeps up to date and tell it what to do.
"""

from __future__ import annotations

import itertools
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import ray
import torch.distributed as dist

import elastic_ring as er

from .config import TrainerConfig
from .protocol import STOP, Keys, parse_waiting
from .worker import RingWorker, WorkerError

_RemoteWorker = ray.remote(RingWorker)


@dataclass
class WorkerRecord:
    worker_id: str
    actor: Any
    info_ref: Any
    run_ref: Any
    created_at: float
    info: dict | None = None
    joined_seq: int | None = None   # order in which it became ready (asked for its first ring)
    has_state: bool = False         # completed a sync: holds the ring's committed state
    generation: int = 0             # the generation it last asked a ring for
    reason: str | None = None
    answered: int = 0               # the generation the driver last answered
    in_ring: bool = False           # has been given a ring
    dead: bool = False
    cause: str | None = None
    finished: bool = False
    leaving: bool = False           # its node drains: it leaves the ring at the next commit
    silent_s: float = 0.0           # seconds since its last heartbeat, as of the last poll
    value: Any = None
    user_error: WorkerError | None = None

    @property
    def waiting(self) -> bool:
        return not self.dead and self.generation > self.answered

    @property
    def node_id(self) -> str:
        return self.info["node_id"] if self.info else "?"


class WorkerPool:
    def __init__(self, config: TrainerConfig, store: dist.TCPStore, store_host: str, keys: Keys,
                 fn: Callable, fn_config: dict, settings: dict, heartbeat_interval_s: float) -> None:
        self.config, self.store, self.store_host, self.keys = config, store, store_host, keys
        self.fn, self.fn_config, self.settings = fn, fn_config, settings
        self.heartbeat_interval_s = heartbeat_interval_s
        self.records: dict[str, WorkerRecord] = {}
        self._ready_seq = itertools.count()

    # ------------------------------------------------------------ effects
    def request(self, count: int) -> None:
        options: dict[str, Any] = {"num_cpus": self.config.cpus_per_worker, "num_gpus": self.config.worker_gpus,
                                   "max_concurrency": 4, "max_restarts": 0}
        if self.config.resources_per_worker:
            options["resources"] = dict(self.config.resources_per_worker)
        if self.config.runtime_env:
            options["runtime_env"] = self.config.runtime_env
        for _ in range(count):
            worker_id = uuid.uuid4().hex[:8]
            actor = _RemoteWorker.options(**options).remote(
                worker_id, self.store_host, self.store.port, self.keys.job, self.heartbeat_interval_s)
            self.records[worker_id] = WorkerRecord(
                worker_id, actor, actor.info.remote(), actor.run.remote(self.fn, self.fn_config, self.settings),
                created_at=time.monotonic())

    def answer(self, record: WorkerRecord, spec: er.RingSpec) -> None:
        self.store.set(self.keys.ring(record.worker_id, record.generation), pickle.dumps(spec))
        record.answered = record.generation
        record.in_ring = True

    def stop_waiting(self) -> None:
        for record in self.live():
            self.stop(record)

    def notify_membership_change(self, records: list[WorkerRecord], persist: bool = False) -> None:
        for record in records:
            record.actor.request_membership_change.remote(persist)

    def stop(self, record: WorkerRecord) -> None:
        """Answer a waiting worker with STOP: its run returns (it leaves the job)."""
        if record.waiting:
            self.store.set(self.keys.ring(record.worker_id, record.generation), STOP)
            record.answered = record.generation

    @staticmethod
    def draining_nodes() -> dict[str, int]:
        """Ray's draining nodes: node id hex -> deadline in ms (0: none); the signal
        Ray Train v2's preemption watcher reads, set by autoscaler v2 and `ray drain-node`."""
        return ray._private.state.state.get_draining_nodes()

    def kill(self, record: WorkerRecord, cause: str) -> None:
        if not record.dead:
            ray.kill(record.actor, no_restart=True)
            record.dead, record.cause = True, cause

    def shutdown(self) -> None:
        self.stop_waiting()
        for record in self.records.values():
            if not record.dead:
                ray.kill(record.actor, no_restart=True)
                record.dead = True

    # ------------------------------------------------------------ observation
    def live(self) -> list[WorkerRecord]:
        """Workers starting or in the job: not dead and not finished (a worker that left a draining
        node has finished and no longer counts against max_workers)."""
        return [r for r in self.records.values() if not r.dead and not r.finished]

    def poll(self) -> None:
        """Bring every record up to date: started, asking for a ring, finished, dead, silent."""
        now = time.time()
        for record in self.live():
            if record.info is None and ray.wait([record.info_ref], timeout=0)[0]:
                try:
                    record.info = ray.get(record.info_ref)
                except ray.exceptions.RayError as exc:
                    record.dead, record.cause = True, f"did not start: {exc}"
                    continue
            if not record.finished and ray.wait([record.run_ref], timeout=0)[0]:
                try:
                    record.value = ray.get(record.run_ref)
                    record.finished = True
                    if record.leaving:  # it left its draining node: free the slot at once
                        ray.kill(record.actor, no_restart=True)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, WorkerError):
                        record.user_error = cause
                        record.finished = True
                    else:
                        record.dead, record.cause = True, f"run failed: {exc}"
                        continue
                except ray.exceptions.RayError as exc:  # the actor or its node died
                    record.dead, record.cause = True, f"process lost: {type(exc).__name__}"
                    continue
            if record.info is None or record.finished:
                continue
            waiting_key = self.keys.waiting(record.worker_id)
            if self.store.check([waiting_key]):
                generation, reason = parse_waiting(self.store.get(waiting_key))
                if generation > record.generation:
                    record.generation, record.reason = generation, reason
                    if record.joined_seq is None:
                        record.joined_seq = next(self._ready_seq)
            if not record.has_state and self.store.check([self.keys.synced(record.worker_id)]):
                record.has_state = True
            heartbeat_key = self.keys.heartbeat(record.worker_id)
            if self.store.check([heartbeat_key]):
                silent_s = now - float(self.store.get(heartbeat_key))
                record.silent_s = silent_s
                if silent_s > self.config.heartbeat_timeout_s:
                    self.kill(record, f"no heartbeat for {silent_s:.1f} s (heartbeat_timeout_s="
                                      f"{self.config.heartbeat_timeout_s})")
