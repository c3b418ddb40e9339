"""ElasticTrainer: the public entry point. ``ElasticTrainer(...).run(fn, config)`` -> :class:`Result`."""

from __future__ import annotations

import datetime
import pickle
import signal
import threading
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch.distributed as dist
from ray.autoscaler.sdk import request_resources

from elastic_ring.log import get_logger
from state import CheckpointConfig, CheckpointStore

from .config import TrainerConfig
from .driver import Driver, Failed, Finished, Stopped
from .events import Event, EventLog
from .progress import ProgressDisplay
from .protocol import Keys
from .timeline_file import TimelineFile
from .worker_pool import WorkerPool

_log = get_logger(__name__)

#: Seconds between heartbeats of a worker (its timeout is heartbeat_timeout_s).
HEARTBEAT_INTERVAL_S = 0.5


@dataclass
class Result:
    value: Any                                   # what fn returned on rank 0 of the final ring
    metrics: list[dict] = field(default_factory=list)   # rank 0's er.report records (with time, round, world size)
    events: list[Event] = field(default_factory=list)   # membership history
    checkpoint: str | None = None                # URI of the newest durable checkpoint


class ElasticTrainer:
    def __init__(self, **options: Any) -> None:
        self.config = TrainerConfig(**options)

    def _check_cluster(self) -> None:
        resources = ray.cluster_resources()
        if self.config.use_gpu and resources.get("GPU", 0) == 0:
            raise ValueError("ElasticTrainer use_gpu=True, but the Ray cluster has no GPUs; "
                             "set use_gpu=False or connect to a cluster with GPU nodes")

    def run(self, fn: Callable[[dict], Any], config: dict | None = None,
            on_report: Callable[[dict], None] | None = None) -> Result:
        """Run ``fn(config)`` on every worker until rank 0 of the final ring returns.

        ``on_report(record)``, if given, is called on the driver with each of rank 0's ``er.report``
        records as it arrives (live logging, or reacting to progress); an exception in it ends the run.
        """
        if not callable(fn):
            raise TypeError(f"ElasticTrainer.run expects a function fn(config), got {type(fn).__name__}")
        if on_report is not None and not callable(on_report):
            raise TypeError(f"ElasticTrainer.run on_report must be a function of one record, got {on_report!r}")
        if not ray.is_initialized():
            ray.init()
        self._check_cluster()
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.config.elastic_timeout_s))
        keys = Keys(f"job-{uuid.uuid4().hex[:8]}")
        checkpoint = None
        if self.config.checkpoint_uri is not None:
            checkpoint = CheckpointConfig(self.config.checkpoint_uri, self.config.checkpoint_every_n_commits,
                                          self.config.checkpoint_every_s, self.config.checkpoint_keep_last)
        settings = {"ring_timeout_s": self.config.start_timeout_s + self.config.elastic_timeout_s,
                    "checkpoint": checkpoint, "use_gpu": self.config.use_gpu,
                    "timeline": self.config.timeline_path is not None}
        events = EventLog()
        pool = WorkerPool(self.config, store, host, keys, fn, config or {}, settings, HEARTBEAT_INTERVAL_S)
        driver = Driver(self.config, pool, host, events)
        metrics: list[dict] = []
        progress = ProgressDisplay(self.config.progress)
        timeline = TimelineFile(self.config.timeline_path) if self.config.timeline_path is not None else None
        if timeline is not None:
            timeline.check_writable()

        resumed: list[dict] = []
        timeline_batches = [0]

        def on_tick(d: Driver) -> None:
            if not resumed and store.check([keys.resumed]):
                resumed.append(pickle.loads(store.get(keys.resumed)))
                info = resumed[0]
                events.add("resumed_from_checkpoint", d.round_id, d.world_size, uri=info["uri"], seq=info["seq"],
                           commits=info["meta"].get("commits"), epoch=info.get("epoch"), step=info.get("step"))
            count = int(store.add(keys.metrics_count, 0))
            while len(metrics) < count:
                metrics.append(pickle.loads(store.get(keys.metric(len(metrics) + 1))))
                if on_report is not None:
                    on_report(metrics[-1])
            progress.update(metrics, d.world_size)
            if timeline is not None:
                batches = int(store.add(keys.timeline_count, 0))
                while timeline_batches[0] < batches:
                    timeline_batches[0] += 1
                    timeline.add_worker_events(*pickle.loads(store.get(keys.timeline(timeline_batches[0]))))

        # Demand the autoscaler can see: max_workers worker bundles while the job runs.
        bundle = {"CPU": self.config.cpus_per_worker, "GPU": self.config.worker_gpus, **self.config.resources_per_worker}
        request_resources(bundles=[{k: v for k, v in bundle.items() if v}] * self.config.max_workers)
        previous_handler = None
        if threading.current_thread() is threading.main_thread():
            # A spot VM gets SIGTERM before it goes: stop at the next commit, written durably.
            previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: driver.request_stop("SIGTERM"))
        try:
            final = driver.run(on_tick)
            on_tick(driver)
            if isinstance(final, Finished):
                events.add("finished", driver.round_id, driver.world_size)
        finally:
            progress.close()
            pool.shutdown()
            if timeline is not None:
                _log.info("timeline written to %s", timeline.write(events.events))
            request_resources(bundles=[])  # cancel the demand, also on failure
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)
        if isinstance(final, Failed):
            raise final.error
        if isinstance(final, Stopped):
            newest = (CheckpointStore(self.config.checkpoint_uri, self.config.checkpoint_keep_last).newest_uri()
                      if self.config.checkpoint_uri is not None else None)
            saved = (f"the last commit is saved as {newest}; run the same script again to resume" if newest else
                     "no checkpoint_uri was set, so nothing was saved")
            print(f"elastic_ring: {final.reason} received: training stopped at a commit; {saved}", file=sys.stderr,
                  flush=True)
            raise SystemExit(0)
        assert isinstance(final, Finished)
        newest = None
        if self.config.checkpoint_uri is not None:
            newest = CheckpointStore(self.config.checkpoint_uri, self.config.checkpoint_keep_last).newest_uri()
        return Result(value=final.value, metrics=metrics, events=list(events.events), checkpoint=newest)
