"""ElasticTrainer: the public entry point. ``ElasticTrainer(...).run(fn, config)`` -> :class:`Result`."""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.autoscaler.sdk import request_resources

import elastic_ring as er
from elastic_ring.auth import new_secret
from elastic_ring.log import get_logger
from state import CheckpointConfig, CheckpointLease, CheckpointStore

from .channel import Channel, Inbox
from .config import TrainerConfig
from .driver import Driver, Failed, Finished, Stopped
from .events import Event, EventLog
from .progress import ProgressDisplay
from .protocol import DRIVER, Keys
from .timeline_file import TimelineFile
from .worker_pool import WorkerPool

_log = get_logger(__name__)


@dataclass
class Result:
    value: Any                                   # what fn returned on rank 0 of the final ring
    metrics: list[dict] = field(default_factory=list)   # rank 0's er.report records (with time, round, world size)
    events: list[Event] = field(default_factory=list)   # membership history
    checkpoint: str | None = None                # URI of the newest durable checkpoint


class _Signals:
    """SIGTERM: stop at the next commit, written durably; a second SIGTERM abandons the stop at once."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self._driver.stop_reason is None:
            self._driver.request_stop("SIGTERM")
        else:
            self._driver.abort("a second SIGTERM")

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _Mailroom:
    """Moves what workers sent (reports, timeline, resume info, checkpoint events) to the trainer's outputs."""

    def __init__(self, pool: WorkerPool, events: EventLog, progress: ProgressDisplay, timeline: TimelineFile | None,
                 on_report: Callable[[dict], None] | None) -> None:
        self.pool, self.events, self.progress, self.timeline, self.on_report = pool, events, progress, timeline, on_report
        self.metrics: list[dict] = []
        self.resumed: dict | None = None

    def __call__(self, d: Driver) -> None:
        mail = self.pool.mail
        for info in mail.resumed:
            if self.resumed is None:
                self.resumed = info
                meta = info.get("meta") or {}
                self.events.add("resumed_from_checkpoint", d.round_id, d.world_size, uri=info.get("uri"),
                                seq=info.get("seq"), commits=meta.get("commits"), epoch=info.get("epoch"),
                                step=info.get("step"))
        for event in mail.checkpoints:
            detail = {k: v for k, v in event.items() if k != "kind"}
            self.events.add(str(event.get("kind", "checkpoint")), d.round_id, d.world_size, **detail)
        for record in mail.reports:
            self.metrics.append(record)
            if self.on_report is not None:
                self.on_report(record)
        if self.timeline is not None:
            for batch in mail.timeline:
                self.timeline.add_worker_events(*batch)
        mail.resumed.clear(), mail.checkpoints.clear(), mail.reports.clear(), mail.timeline.clear()
        self.progress.update(self.metrics, d.world_size)


class ElasticTrainer:
    def __init__(self, **options: Any) -> None:
        self.config = TrainerConfig(**options)

    def _check_cluster(self) -> None:
        resources = ray.cluster_resources()
        if self.config.use_gpu and resources.get("GPU", 0) == 0:
            raise ValueError("ElasticTrainer use_gpu=True, but the Ray cluster has no GPUs; "
                             "set use_gpu=False or connect to a cluster with GPU nodes")

    def _checkpoint_config(self, run_id: str) -> CheckpointConfig | None:
        if self.config.checkpoint_uri is None:
            return None
        every_n, every_s = self.config.checkpoint_cadence
        return CheckpointConfig(self.config.checkpoint_uri, every_n, every_s, self.config.checkpoint_keep_last,
                                run_id=run_id, trusted=self.config.trusted_checkpoints)

    def _lease(self, run_id: str) -> CheckpointLease | None:
        """Hold the checkpoint location for this run: a second live job there is refused within seconds."""
        if self.config.checkpoint_uri is None:
            return None
        return CheckpointLease(self.config.checkpoint_uri, run_id).acquire()

    def _newest_checkpoint(self) -> str | None:
        if self.config.checkpoint_uri is None:
            return None
        return CheckpointStore(self.config.checkpoint_uri, self.config.checkpoint_keep_last).newest_uri()

    def run(self, fn: Callable[[dict], Any], config: dict | None = None,
            on_report: Callable[[dict], None] | None = None, on_event: Callable[[Event], None] | None = None) -> Result:
        """Run ``fn(config)`` on every worker until rank 0 of the final ring returns.

        ``on_report(record)``, if given, is called on the driver with each of rank 0's ``er.report``
        records as it arrives (live logging, or reacting to progress); ``on_event(event)`` with each
        membership event (:class:`Event`) as it happens. An exception in either ends the run.
        """
        if not callable(fn):
            raise TypeError(f"ElasticTrainer.run expects a function fn(config), got {type(fn).__name__}")
        for name, callback in (("on_report", on_report), ("on_event", on_event)):
            if callback is not None and not callable(callback):
                raise TypeError(f"ElasticTrainer.run {name} must be a function of one argument, got {callback!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"ElasticTrainer.run config must be a dict (passed to fn), got {type(config).__name__}")
        if not ray.is_initialized():
            ray.init()
        self._check_cluster()
        timeline = TimelineFile(self.config.timeline_path) if self.config.timeline_path is not None else None
        if timeline is not None:
            timeline.check_writable()
        keys = Keys(f"job-{uuid.uuid4().hex[:8]}")
        secret = new_secret()
        events = EventLog(on_event)
        progress = ProgressDisplay(self.config.progress)
        final = None
        with contextlib.ExitStack() as cleanup:  # everything set up below is undone in reverse, also on failure
            lease = self._lease(keys.job)
            if lease is not None:
                cleanup.callback(lease.release)  # last: the workers are stopped, nothing of this run writes
            host = self.config.bind_address or ray.util.get_node_ip_address()
            server = er.StoreServer(host, timeout_s=max(60.0, self.config.connect_timeout_s))
            cleanup.callback(server.close)
            send = Channel(server.store, secret, DRIVER)
            receive = Channel(server.connect(60.0), secret, DRIVER)  # its own connection: it blocks in waits
            wakeups: "queue.Queue[tuple[str, Any]]" = queue.Queue()
            settings = {"driver_silence_s": self.config.heartbeat_timeout_s,
                        "flush_timeout_s": self.config.stop_timeout_s, "checkpoint": self._checkpoint_config(keys.job),
                        "use_gpu": self.config.use_gpu, "timeline": timeline is not None}
            pool = WorkerPool(self.config, send, host, server.address.port, keys, secret, fn, config or {}, settings)
            driver = Driver(self.config, pool, host, events, wakeups)
            mailroom = _Mailroom(pool, events, progress, timeline, on_report)
            cleaner = _RoundKeys(server.store, keys)

            def on_tick(d: Driver) -> None:
                mailroom(d)
                cleaner.forget_before(d.round_id - 1)
                if lease is not None:
                    lease.check()  # another run took the location over (this one stalled): stop now

            # Demand the autoscaler can see: max_workers worker bundles while the job runs.
            bundle = {"CPU": self.config.cpus_per_worker, "GPU": self.config.worker_gpus,
                      **self.config.resources_per_worker}
            request_resources(bundles=[{k: v for k, v in bundle.items() if v}] * self.config.max_workers)
            cleanup.callback(request_resources, bundles=[])  # cancel the demand, also on failure
            if timeline is not None:
                cleanup.callback(lambda: _log.info("timeline written to %s", timeline.write(events.events)))
            cleanup.callback(pool.shutdown, "the job ended")
            inbox = Inbox(receive, keys.driver_inbox, wakeups, on_message=lambda msg: _acknowledge(send, keys, msg))
            inbox.start()
            cleanup.callback(inbox.close, lambda: send.send(keys.driver_inbox, "wake"))
            cleanup.callback(progress.close)
            signals = _Signals(driver)
            cleanup.callback(signals.restore)
            try:
                final = driver.run(on_tick)
                on_tick(driver)
                if isinstance(final, Finished):
                    events.add("finished", driver.round_id, driver.world_size)
            except KeyboardInterrupt:
                print(f"elastic_ring: interrupted (Ctrl-C): the workers are stopped now; {self._abandoned()}",
                      file=sys.stderr, flush=True)
                raise
        if receive.forged or send.forged:
            _log.warning("%d forged messages were sent to this job's rendezvous store and ignored; see the README's "
                         "Security section", receive.forged + send.forged)
        return self._result(final, mailroom, events, driver.stop_reason)

    def _abandoned(self) -> str:
        newest = self._newest_checkpoint()
        if newest:
            return f"training since the newest durable checkpoint ({newest}) is abandoned; run the same script to resume"
        if self.config.checkpoint_uri is None:
            return "no checkpoint_uri was set, so all training of this run is abandoned"
        return "no durable checkpoint was written yet, so all training of this run is abandoned"

    def _result(self, final, mailroom: _Mailroom, events: EventLog, stop_reason: str | None) -> Result:
        if isinstance(final, Failed):
            if stop_reason is not None:
                cause = str(final.error).strip().splitlines()
                print(f"elastic_ring: {stop_reason} received, but the job could not stop cleanly: "
                      f"{cause[-1] if cause else type(final.error).__name__}; {self._abandoned()}",
                      file=sys.stderr, flush=True)
            raise final.error
        if isinstance(final, Stopped):
            if final.forced:
                note = f" ({final.note})" if final.note else ""
                print(f"elastic_ring: {final.reason}: stopping at once{note}; the workers were killed; "
                      f"{self._abandoned()}", file=sys.stderr, flush=True)
                raise SystemExit(1)
            newest = self._newest_checkpoint()
            saved = (f"the last commit is saved as {newest}; run the same script again to resume" if newest else
                     "no checkpoint_uri was set, so nothing was saved")
            note = f" ({final.note})" if final.note else ""
            print(f"elastic_ring: {final.reason} received: training stopped at a commit{note}; {saved}",
                  file=sys.stderr, flush=True)
            raise SystemExit(0)
        assert isinstance(final, Finished)
        written = [e.detail.get("uri") for e in events.events if e.kind == "checkpoint_written"]
        return Result(value=final.value, metrics=mailroom.metrics, events=list(events.events),
                      checkpoint=written[-1] if written else self._newest_checkpoint())


def _acknowledge(send: Channel, keys: Keys, msg: dict) -> None:
    """Tell a worker waiting at the rendezvous that the driver is alive (from the inbox thread)."""
    waiting = msg.get("waiting") if msg.get("k") == "hb" else None
    if isinstance(waiting, int) and waiting > 0:
        send.send(keys.worker_inbox(msg["from"]), "pending", generation=waiting)


class _RoundKeys:
    """Deletes the store keys (gloo's and NCCL's rendezvous) of rounds that can no longer be formed."""

    def __init__(self, store, keys: Keys) -> None:
        self._store, self._keys = store, keys
        self._done = 0

    def forget_before(self, round_id: int) -> None:
        if round_id <= self._done + 1:
            return
        prefixes = tuple(self._keys.round_prefix(r) for r in range(self._done + 1, round_id))
        for key in self._store.list_keys():
            if key.startswith(prefixes):
                self._store.delete_key(key)
        self._done = round_id - 1
