"""The worker actor: one per GPU (or per CPU slot), running the user's ``fn`` in its own process.

It is threaded (``max_concurrency``) so that Ray can reach it (``info``, ``ping``)
while ``fn`` runs. Its mailbox thread reads its store queue for its whole life
(:mod:`.mailbox`): ring answers for the rendezvous, and the driver's notices
about the current ring (abort, re-form/persist/stop, preemption). A heartbeat thread sends the driver a counter (and the generation
it waits for, while at the rendezvous) and the timeline events (with
``heartbeats="node"``, one worker per node forwards its node's counters:
:mod:`.node_beats`); the elastic
loop's rendezvous (:mod:`.rendezvous`) asks the driver for rings.
``er.report`` records of rank 0, the resume info and checkpoint events go to
the driver as sealed messages too. The job's secret arrives with the actor's
constructor arguments, through Ray, and never through the store.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import threading
import traceback
from typing import Any, Callable

import elastic_ring as er
import state as state_pkg
from state import membership
from elastic_ring.collectives import preemption
from elastic_ring.core import allocator, progress, timeline
from elastic_ring.ring.report import set_reporter
from elastic_ring.ring.store import connect
from state.checkpoints.config import set_default_checkpointing
from state.checkpoints.hooks import set_checkpoint_listener
from state.state import set_resume_listener

from elastic_ring.core.log import get_logger

from .. import data as data_input
from ..errors import WorkerError, WorkerGaveUp
from ..wire.channel import REPLAY_WINDOW, Channel
from ..wire.launch_env import horovod_environment
from ..wire.protocol import Keys, Returned, WorkerKind
from ..wire.settings import WorkerSettings
from .devices import worker_cuda_device
from .mailbox import KEEPALIVE_BACK_S, NOTICE_HANDLERS, Mailbox
from .node_beats import NodeBeats, Tick
from .preemption_info import preemption_info
from .rendezvous import WorkerRendezvous


_log = get_logger(__name__)


def _authentication_failure(exc: BaseException) -> bool:
    """``exc`` is, or was raised from, a value that failed authentication (somewhere in its cause chain)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, er.AuthenticationError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class Fate(enum.Enum):
    """What a worker's run does with an exception that ended ``fn`` (see :func:`fate`)."""

    LEAVE = "leave"      # it leaves the job quietly (a draining node, the job stops): run returns None
    RAISE = "raise"      # already a WorkerError: raised as it is
    GIVE_UP = "give_up"  # the rendezvous or the store is lost for this worker: the driver replaces it
    ERROR = "error"      # fn's failure (or tampering): the run fails with a WorkerError naming it


def fate(exc: BaseException) -> Fate:
    """The worker's answer to ``exc``. A rendezvous failure is a lost worker (replaced), unless a value failed
    authentication on the way: that is tampering with the job, which ends the run naming it, never a worker that
    is silently replaced."""
    if isinstance(exc, (er.RingStopped, state_pkg.TrainingStopped)):
        return Fate.LEAVE
    if isinstance(exc, WorkerError):
        return Fate.RAISE
    if isinstance(exc, er.RendezvousError) and not _authentication_failure(exc) or isinstance(exc, WorkerGaveUp):
        return Fate.GIVE_UP  # (WorkerGaveUp: an input it could not read, InputUnavailable)
    return Fate.ERROR


def _describe_failure(exc: BaseException) -> str:
    """What to call a failure of fn, with the fix when we know it."""
    if _authentication_failure(exc):
        return ("a value read from the job's rendezvous store or a peer failed authentication (something that is not "
                "part of the job writes to its store or sockets; see the README's Security section)")
    if isinstance(exc, er.RendezvousError):
        return "the rendezvous with the driver failed"
    if isinstance(exc, ImportError):
        return ("fn raised an import error (if the module is missing on the workers, ship it with "
                "ElasticTrainer(runtime_env={'working_dir': '.'}) or runtime_env={'py_modules': [...]})")
    if isinstance(exc, er.CommError):
        return ("a collective failed outside @er.elastic.run (only code inside the elastic loop survives failures: "
                "move the training loop into a function decorated with @er.elastic.run)")
    return "fn raised"


class RingWorker:
    def __init__(self, worker_id: str, store_host: str, store_port: int, job_id: str, secret: bytes,
                 heartbeat_interval_s: float, connect_timeout_s: float) -> None:
        import ray

        self.worker_id = worker_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.hostname = socket.gethostname()
        self.node_ip = ray.util.get_node_ip_address()
        self._keys = Keys(job_id)
        self._secret = secret
        address = er.StoreAddress(store_host, store_port)
        # one connection for sending (shared by threads, each op short), one for blocking waits; a broken
        # connection is replaced by a fresh one before a retry
        reconnect = functools.partial(connect, address, connect_timeout_s)
        self._send = Channel(reconnect(), secret, worker_id, connect=reconnect)
        # the one reader of this worker's queue, from now on: ring answers for the rendezvous, and the driver's
        # notices (abort, re-form/persist/stop, preemption) acted on while fn trains
        self._mailbox = Mailbox(Channel(reconnect(), secret, worker_id, connect=reconnect,
                                        replay_window=REPLAY_WINDOW),
                                self._keys.worker_inbox(worker_id), NOTICE_HANDLERS, on_failure=self._mailbox_failed,
                                send=self._send, idle_s=KEEPALIVE_BACK_S)
        self._rendezvous: WorkerRendezvous | None = None
        self._interval_s = heartbeat_interval_s
        self._stop = threading.Event()
        self._beats = 0
        self._job_id = job_id
        self._node_beats: NodeBeats | None = None  # heartbeats="node", once the settings say so (_install)
        self._beat_lock = threading.Lock()  # the node's beats: the heartbeat thread and run's end
        self._beat()
        threading.Thread(target=self._heartbeat, name="elastic-ring-heartbeat", daemon=True).start()
        self._mailbox.start()

    # ------------------------------------------------------------ heartbeat thread
    def _beat(self) -> None:
        self._beats += 1
        waiting = self._rendezvous.waiting if self._rendezvous is not None else None
        synced = self._rendezvous is not None and self._rendezvous.holds_state
        beat = {"seq": self._beats, "synced": synced, "waiting": waiting[0] if waiting else 0,
                "reason": waiting[1] if waiting else None,
                "asked": self._asked()}
        with self._beat_lock:
            tick = self._node_tick(beat)
            if tick.direct:
                self._send.send(self._keys.driver_inbox, WorkerKind.HEARTBEAT, **beat)
            if tick.forward:
                self._send.send(self._keys.driver_inbox, WorkerKind.NODE_HEARTBEAT, beats=tick.forward)
                self._node_beats.forwarded()

    def _node_tick(self, beat: dict) -> Tick:
        """What to send for ``beat``: the node's beats (:mod:`.node_beats`), or its own ``hb`` alone."""
        if self._node_beats is None:
            return Tick(direct=True)
        try:
            return self._node_beats.tick(beat)
        except OSError as exc:  # the node's directory failed us: beat directly, as heartbeats="worker"
            _log.warning("worker %s: node heartbeats failed (%s); sending its own from now on", self.worker_id, exc)
            self._close_node_beats()
            return Tick(direct=True)

    def _close_node_beats(self) -> None:
        beats, self._node_beats = self._node_beats, None
        if beats is not None:
            try:
                beats.close()
            except OSError as exc:
                _log.warning("worker %s: cleaning up its node heartbeat files failed: %s", self.worker_id, exc)

    def _heartbeat(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    self._beat()  # (sends retry store errors with backoff, over a fresh connection)
                    self._flush_timeline()
                except (RuntimeError, OSError) as exc:  # the store is unreachable for now: keep beating
                    _log.warning("worker %s: heartbeat failed (%s); trying again", self.worker_id, exc)
        except BaseException as exc:  # surfaced to the driver, which then names it when it declares us dead
            try:
                self._send.send(self._keys.driver_inbox, WorkerKind.FAULT, what="heartbeat thread",
                                error=f"{type(exc).__name__}: {exc}")
            except (RuntimeError, OSError):
                pass  # the store is unreachable: the driver sees silence, and its own error, soon
        finally:
            with self._beat_lock:
                self._close_node_beats()  # the thread ends: its beat file goes, a leader gives up the lock

    def _flush_timeline(self) -> None:
        """Send the timeline events recorded since the last flush to the driver."""
        if not timeline.is_enabled():
            return
        events, dropped = timeline.drain()
        if events or dropped:
            self._send.send(self._keys.driver_inbox, WorkerKind.TIMELINE, host=self.hostname, events=events, dropped=dropped)

    # ------------------------------------------------------------ remote methods
    def ping(self) -> bool:
        """Answers through Ray while the process runs (the driver asks when its heartbeats stop arriving)."""
        return True

    def _mailbox_failed(self, exc: BaseException) -> None:
        """The mailbox thread ended (a store it cannot reach, or a notice it could not apply): this worker would
        no longer hear the driver. It says why, if it can, and goes silent: the driver replaces it naming that."""
        _log.error("worker %s: its mailbox thread failed: %s: %s", self.worker_id, type(exc).__name__, exc,
                   exc_info=exc)
        try:
            self._send.send(self._keys.driver_inbox, WorkerKind.FAULT, what="mailbox thread",
                            error=f"{type(exc).__name__}: {exc}")
        except (RuntimeError, OSError):
            pass  # the store is unreachable: the driver sees silence soon
        self._stop.set()

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "node_id": self.node_id, "hostname": self.hostname,
                "node_ip": self.node_ip, "pid": os.getpid()}

    def _report(self, record: dict) -> None:
        if record.get("rank") == 0:
            self._send.send(self._keys.driver_inbox, WorkerKind.REPORT, record=record)

    def _install(self, settings: WorkerSettings) -> None:
        self._rendezvous = WorkerRendezvous(self._send, self._mailbox, self._keys, self.worker_id, self._secret,
                                            settings.driver_silence_s)
        # Horovod's launch variables, once, from the first ring this worker joins (as horovodrun's spawn-time
        # values: never rewritten on a re-form), before hvd.init() / the first er call that forms it returns
        self._rendezvous.on_first_ring = lambda spec: os.environ.update(horovod_environment(spec))
        er.elastic.set_rendezvous(self._rendezvous)
        set_reporter(self._report)
        membership.reset()
        preemption.install(preemption_info)  # get_preemption_info() answers Ray Train's PreemptionInfo
        set_default_checkpointing(settings.checkpoint)
        set_resume_listener(lambda info: self._send.send(self._keys.driver_inbox, WorkerKind.RESUMED, info=info))
        set_checkpoint_listener(lambda event: self._send.send(self._keys.driver_inbox, WorkerKind.CHECKPOINT,
                                                              event=event))
        data_input.install(settings.datasets)  # ElasticTrainer(datasets=...): get_dataset_shard(name) in fn
        self._flush_timeout_s = settings.flush_timeout_s
        if settings.tune_allocator:
            allocator.tune()  # freed gradient-sized blocks stay in the heap: no page faults per step
        progress.clear()
        if settings.timeline:
            timeline.enable()
        if settings.use_gpu:
            import torch

            device = worker_cuda_device()  # from Ray's GPU ids and CUDA_VISIBLE_DEVICES (NOSET-aware)
            torch.cuda.set_device(device)
            self._rendezvous.cuda_device = device  # every ring spec names it: the current device is per thread
        # last: nothing after it may raise (run() closes it only once _install returned; a worker whose start
        # failed must not go on forwarding its node-mates' beats, or keep them from beating on their own)
        if settings.heartbeats == "node":
            try:
                node_beats = NodeBeats(self._job_id, self.node_id, self.worker_id, self._secret, self._interval_s)
            except OSError as exc:  # no private directory on this node: this worker beats on its own
                _log.warning("worker %s: node heartbeats unavailable (%s); sending its own", self.worker_id, exc)
            else:
                with self._beat_lock:
                    self._node_beats = node_beats

    def run(self, fn: Callable[[dict], Any], config: dict, settings: WorkerSettings) -> Returned:
        """Run ``fn(config)`` as one worker of the job; returns what it returns, with the generation it last asked
        a ring for."""
        self._install(settings)
        try:
            value = fn(config)
            self._flush_checkpoints()
        except Exception as exc:
            outcome = fate(exc)
            if outcome is Fate.LEAVE:
                self._flush_checkpoints()  # it leaves (a draining node, the job stops): its last write lands first
                return Returned(None, self._asked())
            if outcome is Fate.RAISE:
                raise
            if outcome is Fate.GIVE_UP:
                raise WorkerGaveUp(f"worker {self.worker_id} on {self.hostname}: {exc}") from None
            raise self._error(exc) from None
        finally:
            self._mailbox.close()  # nothing more to hear: the store going away at the job's end is no failure
            with self._beat_lock:  # it leaves the job: no forwarding, its beat file goes (it beats on its own)
                self._close_node_beats()
            er.shutdown()
            er.elastic.set_rendezvous(None)
            self._flush_timeline()
        try:
            import ray.cloudpickle

            ray.cloudpickle.dumps(value)
        except Exception as exc:  # any pickling failure: tell the user what to return instead
            raise WorkerError(self.worker_id, None, self.node_id, self.hostname,
                              f"fn returned a {type(value).__name__} that cannot be pickled ({exc}); return plain "
                              "data (numbers, strings, lists, dicts, CPU tensors), e.g. a state_dict instead of "
                              "an object holding locks, files or sockets", "fn's return value") from None
        return Returned(value, self._asked())

    def _asked(self) -> int:
        """The generation this worker last asked a ring for (0: none yet)."""
        return self._rendezvous.generation if self._rendezvous is not None else 0

    def _error(self, exc: BaseException) -> WorkerError:
        rank = er.rank() if er.is_initialized() else None
        return WorkerError(self.worker_id, rank, self.node_id, self.hostname, traceback.format_exc(),
                           _describe_failure(exc), exc)

    def _flush_checkpoints(self) -> None:
        """Wait (bounded) for this process's checkpoint writes. A failed or late one does not undo the training:
        it is sent to the driver as a ``checkpoint_failed`` event (``final``), which the result records."""
        try:
            state_pkg.flush_checkpoints(self._flush_timeout_s)
        except state_pkg.CheckpointError as exc:
            self._send.send(self._keys.driver_inbox, WorkerKind.CHECKPOINT,
                            event={"kind": "checkpoint_failed", "final": True, "error": str(exc)})

    def stop_heartbeat(self) -> None:
        self._stop.set()


__all__ = ["Fate", "RingWorker", "fate"]
