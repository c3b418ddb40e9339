"""ElasticTrainer: the public entry point. ``ElasticTrainer(...).run(fn, config)`` -> :class:`Result`."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import uuid
from typing import Any, Callable

import ray

from elastic_ring import shadowing
from elastic_ring.core.auth import new_secret
from elastic_ring.core.log import get_logger
from elastic_ring.ring.store import StoreServer
from state import CheckpointConfig, CheckpointError
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.reported import ReportedCheckpoints
from state.checkpoints.store import CheckpointStore

from .config import TrainerConfig
from .driver.events import Event, EventLog
from .driver.loop import Driver
from .driver.mailroom import Acknowledger, Mailroom, RoundKeys, take_last_messages
from .driver.pool import WorkerPool
from .driver.progress import ProgressDisplay
from .driver.states import Failed, Finished, Stopped
from .driver.stopping import Signals, StopControl
from .driver.timeline import TimelineFile
from .result import Result
from .train._checkpoint import as_ray_checkpoint
from .train._config import default_storage_location, merge, translate
from .wire.channel import Channel, Inbox
from .wire.protocol import DRIVER, DriverKind, Keys
from .wire.settings import WorkerSettings

_log = get_logger(__name__)


def _check_datasets(datasets: Any) -> dict | None:
    """``datasets`` as given when it is None or a dict of str -> ray.data.Dataset; TypeError otherwise."""
    if datasets is None:
        return None
    from ray.data import Dataset

    if not isinstance(datasets, dict) or not all(isinstance(k, str) and k and isinstance(v, Dataset)
                                                 for k, v in datasets.items()):
        shown = {k: type(v).__name__ for k, v in datasets.items()} if isinstance(datasets, dict) else type(datasets).__name__
        raise TypeError(f"ElasticTrainer datasets={shown} must be a dict of name -> ray.data.Dataset, e.g. "
                        "{'train': ray.data.read_parquet(...)}; read them in fn with get_dataset_shard(name)")
    return dict(datasets)


def _said(reason: str) -> str:
    """How a stop's reason reads in the driver's stderr line: ``SIGTERM received`` / ``stop requested (...)``."""
    return f"{reason} received" if reason.startswith("SIG") else f"stop requested ({reason})"


class ElasticTrainer:
    """``ElasticTrainer(**options)``: the options of :class:`TrainerConfig`, and Ray Train's configs beside them:
    ``scaling_config=ray.train.ScalingConfig(...)``, ``run_config=ray.train.RunConfig(...)`` (translated by
    :mod:`.train._config`; an option given both ways with two values is an error), ``datasets={name: ds}``
    (Ray Data datasets, read in the workers with ``get_dataset_shard(name)``)."""

    def __init__(self, *, scaling_config: Any = None, run_config: Any = None, datasets: dict | None = None,
                 **options: Any) -> None:
        if scaling_config is not None or run_config is not None:
            options = merge(options, translate(scaling_config, run_config))
        self.config = TrainerConfig(**options)
        # RunConfig(name=...) without storage_path: a node-local location, refused by run() on several nodes
        self._node_local_location = default_storage_location(run_config)
        self.datasets = _check_datasets(datasets)
        self._stops = StopControl()

    def stop(self, reason: str = "stop() called") -> None:
        """Ask the run to stop at its next commit, written durably; :meth:`run` then returns a stopped
        :class:`Result`. Safe from any thread and from a signal handler; the driver wakes at once.

        A second call abandons the stop: the workers are killed now, and the Result says ``forced``
        (as a second SIGTERM does). Called while no run is in progress, the stop is kept for the next
        :meth:`run`, which then returns a stopped Result at once without starting anything. A run consumes
        every stop asked for while it was in progress: a later run() starts afresh (and resumes from the
        checkpoint)."""
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"ElasticTrainer.stop reason must be a non-empty string (e.g. 'SIGTERM'), got {reason!r}")
        self._stops.request(reason)

    def _check_cluster(self) -> None:
        resources = ray.cluster_resources()
        if self.config.use_gpu and resources.get("GPU", 0) == 0:
            raise ValueError("ElasticTrainer use_gpu=True, but the Ray cluster has no GPUs; "
                             "set use_gpu=False or connect to a cluster with GPU nodes")
        if self._node_local_location is not None and self.config.checkpoint_uri == self._node_local_location:
            nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
            if nodes > 1:
                raise ValueError(f"ElasticTrainer run_config=RunConfig(name=...) without storage_path puts checkpoints "
                                 f"at {self._node_local_location}, on the local disk of whichever node rank 0 runs on, "
                                 f"but this Ray cluster has {nodes} nodes: a checkpoint written on one is lost to the "
                                 "others; set RunConfig(storage_path=...) to storage every node reaches (s3://..., "
                                 "gs://..., an NFS path)")

    def _checkpoint_config(self, run_id: str, lease: CheckpointLease | None) -> CheckpointConfig | None:
        """The workers' checkpointing, carrying the generation of the lease this driver holds: a worker publishes a
        reported checkpoint only while that generation is the location's current one."""
        if self.config.checkpoint_uri is None:
            return None
        every_n, every_s = self.config.checkpoint_cadence
        return CheckpointConfig(self.config.checkpoint_uri, every_n, every_s, self.config.checkpoint_keep_last,
                                run_id=run_id, trusted=self.config.trusted_checkpoints,
                                lease_generation=lease.generation if lease is not None else None)

    def _lease(self, run_id: str) -> CheckpointLease | None:
        """Hold the checkpoint location for this run: a second live job there is refused within seconds."""
        if self.config.checkpoint_uri is None:
            return None
        return CheckpointLease(self.config.checkpoint_uri, run_id, ttl_s=self.config.lease_ttl_s).acquire()

    def _newest_checkpoint(self, events: EventLog | None = None) -> str | None:
        """The newest state checkpoint at the location; None when there is none, or when the location cannot be
        listed now (recorded as a ``checkpoint_listing_failed`` event in ``events``: the run's result stands)."""
        if self.config.checkpoint_uri is None:
            return None
        try:
            return CheckpointStore(self.config.checkpoint_uri, self.config.checkpoint_keep_last).newest_uri()
        except (OSError, CheckpointError) as exc:
            _log.warning("cannot list the checkpoints at %s: %s", self.config.checkpoint_uri, exc)
            if events is not None:
                events.add("checkpoint_listing_failed", None, None, uri=self.config.checkpoint_uri,
                           error=f"{type(exc).__name__}: {exc}")
            return None

    def _result_checkpoint(self, state_uri: str | None) -> Any:
        """Result.checkpoint: the newest reported checkpoint at the location whose files are all there with their
        sizes, else the state checkpoint ``state_uri``, as a ``ray.train.Checkpoint``; None without either."""
        if self.config.checkpoint_uri is None:
            return None
        try:
            reported = ReportedCheckpoints(self.config.checkpoint_uri)
            for seq in reversed(reported.complete()):
                try:
                    reported.check_sizes(seq)
                except CheckpointError as exc:
                    _log.warning("%s; Result.checkpoint is an older one", exc)
                    continue
                return as_ray_checkpoint(reported.files_url(seq))
        except (OSError, CheckpointError) as exc:  # cannot be listed now: the state checkpoint's URI is known anyway
            _log.warning("cannot list the reported checkpoints at %s: %s", self.config.checkpoint_uri, exc)
        return as_ray_checkpoint(state_uri) if state_uri else None

    def run(self, fn: Callable[[dict], Any], config: dict | None = None,
            on_report: Callable[[dict], None] | None = None, on_event: Callable[[Event], None] | None = None) -> Result:
        """Run ``fn(config)`` on every worker until rank 0 of the final ring returns, or until a stop.

        ``on_report(record)``, if given, is called on the driver with each of rank 0's ``er.report``
        records as it arrives (live logging, or reacting to progress); ``on_event(event)`` with each
        membership event (:class:`Event`) as it happens. An exception in either ends the run.

        A stop (SIGTERM when ``run()`` is on the main thread, or :meth:`stop` from anywhere) ends the
        run at the next commit and returns a :class:`Result` with ``stopped=True``; a second one abandons
        the stop (``forced=True``). ``run()`` never raises ``SystemExit``: the caller decides the exit
        code (see examples/cluster/train.py). It raises for failures (``WorkerError``, ``RunFailed``...).
        """
        if not callable(fn):
            raise TypeError(f"ElasticTrainer.run expects a function fn(config), got {type(fn).__name__}")
        for name, callback in (("on_report", on_report), ("on_event", on_event)):
            if callback is not None and not callable(callback):
                raise TypeError(f"ElasticTrainer.run {name} must be a function of one argument, got {callback!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"ElasticTrainer.run config must be a dict (passed to fn), got {type(config).__name__}")
        token, pending = self._stops.begin()
        try:
            if pending is not None:  # stop() before run(): nothing starts
                return self._stopped_before_start(self._stops.end(token) or pending)
            return self._run(fn, config, on_report, on_event, token)
        finally:
            self._stops.end(token)  # (a no-op when the run ended it itself)

    def _stopped_before_start(self, reason: str) -> Result:
        message = f"elastic_ring: {_said(reason)} before run() started: nothing ran"
        print(message, file=sys.stderr, flush=True)
        newest = self._newest_checkpoint()
        return Result(value=None, checkpoint_uri=newest, checkpoint=self._result_checkpoint(newest),
                      path=self.config.checkpoint_uri, completed=False, stopped=True,
                      stop_reason=reason, message=message)

    def _run(self, fn: Callable[[dict], Any], config: dict | None, on_report: Callable[[dict], None] | None,
             on_event: Callable[[Event], None] | None, token: object) -> Result:
        if not ray.is_initialized():
            ray.init()
        # Ray puts the driver's working directory and script directory first on every worker's sys.path: a
        # user's state.py there would break every worker's import; say so now, before any worker starts
        shadowing.check_path_prefix([os.getcwd(), os.path.dirname(os.path.realpath(sys.argv[0] or "."))])
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
            signals = Signals(self.stop)  # first: a SIGTERM while the job sets up stops it before it starts
            cleanup.callback(signals.restore)
            lease = self._lease(keys.job)
            if lease is not None:
                cleanup.callback(lease.release)  # last: the workers are stopped, nothing of this run writes
            host = self.config.bind_address or ray.util.get_node_ip_address()
            server = StoreServer(host, timeout_s=max(60.0, self.config.connect_timeout_s))
            cleanup.callback(server.close)
            send = Channel(server.store, secret, DRIVER)
            receive = Channel(server.connect(60.0), secret, DRIVER)  # its own connection: it blocks in waits
            # a SimpleQueue: its put() is reentrant, so stop() may put from a SIGTERM handler on this thread
            wakeups: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
            checkpointing, prepared = self._checkpoint_config(keys.job, lease), None
            if self.datasets:  # materialized once; kept alive by this frame (and so the blocks) until the run ends
                from .data import prepare_datasets

                prepared = prepare_datasets(self.datasets)
                cleanup.callback(lambda: prepared)
            settings = WorkerSettings(driver_silence_s=self.config.driver_silence_s,
                                      flush_timeout_s=self.config.stop_timeout_s,
                                      checkpoint=checkpointing,
                                      use_gpu=self.config.use_gpu, timeline=timeline is not None,
                                      tune_allocator=self.config.tune_allocator, datasets=prepared,
                                      heartbeats=self.config.heartbeat_mode)
            pool = WorkerPool(self.config, send, host, server.address.port, keys, secret, fn, config or {}, settings)
            pool.receive = receive  # its forged-message count names tampering in the driver's errors
            driver = Driver(self.config, pool, host, events, wakeups)
            mailroom = Mailroom(pool, events, progress, timeline, on_report)
            cleaner = RoundKeys(server.store, keys)

            lease_check = LeaseCheck(lease, events)

            def on_tick(d: Driver, ended: bool = False) -> None:
                mailroom(d.round_id, d.world_size)
                cleaner.forget_before(d.round_id - 1)
                lease_check(d.round_id, d.world_size, ended=ended, stopping=d.stop_reason is not None)

            # The autoscaler sees this job's demand as its pending worker actors (the pool keeps max_workers
            # requested), which are this job's alone and end with it. No request_resources(): that call is
            # one cluster-wide request, which the next call by anyone replaces (docs/api.md, "Autoscaling").
            if timeline is not None:
                cleanup.callback(lambda: _log.info("timeline written to %s", timeline.write(events.events)))
            cleanup.callback(pool.shutdown, "the job ended")
            inbox = Inbox(receive, keys.driver_inbox, wakeups,
                          on_message=Acknowledger(send, keys, self.config.heartbeat_interval_s,
                                                  known=pool.records.__contains__))
            inbox.start()
            cleanup.callback(inbox.close, lambda: send.send(keys.driver_inbox, DriverKind.WAKE))
            cleanup.callback(progress.close)
            self._stops.attach(driver, wakeups)  # a stop asked for from here on (or before) reaches the driver
            try:
                final = driver.run(on_tick)
                take_last_messages(pool, wakeups)
                on_tick(driver, ended=True)
                if isinstance(final, Finished):
                    events.add("finished", driver.round_id, driver.world_size)
            except KeyboardInterrupt:
                print(f"elastic_ring: interrupted (Ctrl-C): the workers are stopped now; {self._abandoned()}",
                      file=sys.stderr, flush=True)
                raise
        stop_reason = self._stops.end(token)  # after the cleanup: a stop() during it is this run's too
        if receive.forged or send.forged:
            _log.warning("%d forged messages were sent to this job's rendezvous store and ignored; see the README's "
                         "Security section", receive.forged + send.forged)
        return self._result(final, mailroom, events, driver.stop_reason or stop_reason)

    def _abandoned(self, events: EventLog | None = None) -> str:
        newest = self._newest_checkpoint(events)
        if newest:
            return f"training since the newest durable checkpoint ({newest}) is abandoned; run the same script to resume"
        if self.config.checkpoint_uri is None:
            return "no checkpoint_uri was set, so all training of this run is abandoned"
        return "no durable checkpoint was written yet, so all training of this run is abandoned"

    def _result(self, final, mailroom: Mailroom, events: EventLog, stop_reason: str | None) -> Result:
        if isinstance(final, Failed):
            if stop_reason is not None:
                cause = str(final.error).strip().splitlines()
                print(f"elastic_ring: {_said(stop_reason)}, but the job could not stop cleanly: "
                      f"{cause[-1] if cause else type(final.error).__name__}; {self._abandoned()}",
                      file=sys.stderr, flush=True)
            raise final.error
        written = [e.detail.get("uri") for e in events.events if e.kind == "checkpoint_written"]
        checkpoint_error = _final_checkpoint_error(events.events)
        # the store first: it orders by state (a leaver's late write of an older state is not the newest), and a
        # stop's final write is the newest whether or not its event arrived
        checkpoint = self._newest_checkpoint(events) or (written[-1] if written else None)
        common = dict(metrics_history=mailroom.metrics, events=list(events.events), checkpoint_uri=checkpoint,
                      checkpoint=self._result_checkpoint(checkpoint), path=self.config.checkpoint_uri,
                      stop_reason=stop_reason, checkpoint_error=checkpoint_error)
        if isinstance(final, Finished):
            if checkpoint_error is not None:
                print(f"elastic_ring: fn completed, but the final checkpoint could not be written: {checkpoint_error}; "
                      f"the newest durable checkpoint is {checkpoint or 'none'}", file=sys.stderr, flush=True)
            return Result(value=final.value, completed=True, **common)
        assert isinstance(final, Stopped), final
        note = f" ({final.note})" if final.note else ""
        if final.forced:
            abandoned = self._abandoned()
            message = (f"elastic_ring: {final.reason}: stopping at once{note}; the workers were killed; "
                       f"{abandoned}")
            print(message, file=sys.stderr, flush=True)
            return Result(value=None, completed=False, stopped=True, forced=True, abandoned=abandoned,
                          message=message, **common)
        reason = stop_reason or final.reason
        if checkpoint_error is not None:
            message = (f"elastic_ring: {_said(reason)}, but the job could not stop cleanly: the final checkpoint "
                       f"failed: {checkpoint_error}; {self._abandoned()}")
        else:
            saved = (f"the last commit is saved as {checkpoint}; run the same script again to resume" if checkpoint
                     else "no checkpoint_uri was set, so nothing was saved" if self.config.checkpoint_uri is None
                     else "no durable checkpoint was written")
            message = f"elastic_ring: {_said(reason)}: training stopped at a commit{note}; {saved}"
        print(message, file=sys.stderr, flush=True)
        return Result(value=None, completed=False, stopped=True, message=message, **common)


class LeaseCheck:
    """Checks, at every tick of the driver, that this run still holds its checkpoint location's lease. Lost while
    the run trains: raised (another run took the location over; this one must stop now). Lost once the run ended
    or while it stops: recorded once, as a ``lease_lost`` event, and the Result is returned (a stop's final write
    is fenced by the lease, and its failure is the Result's ``checkpoint_error``)."""

    def __init__(self, lease: CheckpointLease | None, events: EventLog) -> None:
        self.lease, self.events, self.lost = lease, events, None

    def __call__(self, round_id: int | None, world_size: int | None, *, ended: bool, stopping: bool) -> None:
        if self.lease is None or self.lost is not None:
            return
        try:
            self.lease.check()
        except CheckpointError as exc:
            if not (ended or stopping):
                raise
            self.lost = str(exc)
            _log.warning("the checkpoint lease was lost %s: %s", "after the run" if ended else "while it stopped", exc)
            self.events.add("lease_lost", round_id, world_size, after_the_run=ended, error=str(exc))


def _final_checkpoint_error(events: list[Event]) -> str | None:
    """The error of the last final checkpoint flush that failed (a ``checkpoint_failed`` event with ``final``),
    unless a checkpoint was written after it (e.g. a drained worker's flush failed, the ring's later writes
    did not): then the newest durable checkpoint is as recent as the run's state."""
    error = None
    for event in events:
        if event.kind == "checkpoint_failed" and event.detail.get("final"):
            error = str(event.detail.get("error") or "the final checkpoint flush failed (no error text was sent)")
        elif event.kind == "checkpoint_written":
            error = None
    return error


#: After the driver's last state, how long the workers' last messages may keep arriving, and the most to wait.
