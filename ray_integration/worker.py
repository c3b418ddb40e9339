"""The worker actor: one per GPU (or per CPU slot), running the user's ``fn`` in its own process.

It is threaded (``max_concurrency``) so that the driver can reach it while
``fn`` runs. A background thread writes heartbeats to the rendezvous store.
The elastic loop's rendezvous asks the driver for the next ring through the
store and waits, with a timeout, for its answer. ``er.report`` records from
rank 0 go to the driver through the store too.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

import elastic_ring as er
import state as state_pkg

from .protocol import STOP, Keys


class WorkerError(RuntimeError):
    """``fn`` raised on a worker: carries the rank, the node and the remote traceback."""

    def __init__(self, worker_id: str, rank: int | None, node_id: str, hostname: str, tb: str) -> None:
        self.worker_id, self.rank, self.node_id, self.hostname, self.remote_traceback = worker_id, rank, node_id, hostname, tb
        super().__init__(f"fn raised on rank {rank} (worker {worker_id}, node {node_id[:12]} {hostname}):\n{tb}")

    def __reduce__(self):
        return (WorkerError, (self.worker_id, self.rank, self.node_id, self.hostname, self.remote_traceback))


class JobStopped(RuntimeError):
    """The driver ended the job while this worker waited for a ring."""


class StoreRendezvous:
    """The elastic loop's rendezvous on a worker: ask the driver, wait for its answer."""

    def __init__(self, store: dist.Store, keys: Keys, worker_id: str, timeout_s: float) -> None:
        self._store, self._keys, self._id, self._timeout_s = store, keys, worker_id, timeout_s
        self.generation = 0
        self._synced = False

    def next_ring(self, reason: str) -> er.RingSpec:
        self.generation += 1
        self._store.set(self._keys.waiting(self._id), f"{self.generation}:{reason}")
        key = self._keys.ring(self._id, self.generation)
        deadline = time.monotonic() + self._timeout_s
        while not self._store.check([key]):
            if time.monotonic() > deadline:
                raise JobStopped(f"worker {self._id}: no ring from the driver within {self._timeout_s} s")
            time.sleep(0.002)
        answer = self._store.get(key)
        if answer == STOP:
            raise JobStopped(f"worker {self._id}: the driver ended the job")
        return pickle.loads(answer)

    def synced(self) -> None:
        """This worker holds the ring's committed state (the driver may make it a root)."""
        if not self._synced:
            self._synced = True
            self._store.set(self._keys.synced(self._id), "1")


class RingWorker:
    def __init__(self, worker_id: str, store_host: str, store_port: int, job_id: str, heartbeat_interval_s: float) -> None:
        import ray

        self.worker_id = worker_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.hostname = socket.gethostname()
        self.node_ip = ray.util.get_node_ip_address()
        self._keys = Keys(job_id)
        self._store = dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60))
        self._heartbeat_interval_s = heartbeat_interval_s
        self._stop = threading.Event()
        self._store.set(self._keys.heartbeat(worker_id), str(time.time()))
        threading.Thread(target=self._heartbeat, name="elastic-ring-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        store = dist.TCPStore(self._store.host, self._store.port, is_master=False, wait_for_workers=False)
        while not self._stop.wait(self._heartbeat_interval_s):
            store.set(self._keys.heartbeat(self.worker_id), str(time.time()))
            self._flush_timeline(store)

    def _flush_timeline(self, store: dist.Store) -> None:
        """Send the timeline events recorded since the last flush to the driver."""
        if not er.timeline.is_enabled():
            return
        events, dropped = er.timeline.drain()
        if events or dropped:
            index = store.add(self._keys.timeline_count, 1)
            store.set(self._keys.timeline(index), pickle.dumps((self.worker_id, self.hostname, events, dropped)))

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "node_id": self.node_id, "hostname": self.hostname,
                "node_ip": self.node_ip, "pid": os.getpid()}

    def _report(self, record: dict) -> None:
        if record.get("rank") == 0:
            index = self._store.add(self._keys.metrics_count, 1)
            self._store.set(self._keys.metric(index), pickle.dumps(record))

    def run(self, fn: Callable[[dict], Any], config: dict, settings: dict) -> Any:
        """Run ``fn(config)`` as one worker of the job; returns what it returns."""
        er.elastic.set_rendezvous(StoreRendezvous(self._store, self._keys, self.worker_id, settings["ring_timeout_s"]))
        er.set_reporter(self._report)
        state_pkg.set_default_checkpointing(settings.get("checkpoint"))
        state_pkg.set_resume_listener(lambda info: self._store.set(self._keys.resumed, pickle.dumps(info)))
        er.progress.clear()
        if settings.get("timeline"):
            er.timeline.enable()
        if settings.get("use_gpu"):
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        try:
            value = fn(config)
        except (JobStopped, state_pkg.TrainingStopped):
            return None
        except Exception:
            rank = er.rank() if er.is_initialized() else None
            raise WorkerError(self.worker_id, rank, self.node_id, self.hostname, traceback.format_exc()) from None
        finally:
            er.shutdown()
            self._flush_timeline(self._store)
        try:
            import ray.cloudpickle

            ray.cloudpickle.dumps(value)
        except Exception as exc:  # any pickling failure: tell the user what to return instead
            raise WorkerError(self.worker_id, None, self.node_id, self.hostname,
                              f"fn returned a {type(value).__name__} that cannot be pickled ({exc}); return plain "
                              "data (numbers, strings, lists, dicts, CPU tensors), e.g. a state_dict instead of "
                              "an object holding locks, files or sockets") from None
        return value

    def request_membership_change(self, persist: bool = False) -> None:
        state_pkg.request_membership_change(persist)

    def request_stop(self) -> None:
        state_pkg.request_stop()

    def stop_heartbeat(self) -> None:
        self._stop.set()
