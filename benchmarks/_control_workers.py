"""Simulated workers for :mod:`benchmarks.control_plane`: many in one process, each speaking the real protocol.

One process hosts a slice of the job's workers. Each simulated worker is what a ``RingWorker`` actor is to the
driver's store, without ``fn``:

* heartbeats at the job's cadence (``WorkerKind.HEARTBEAT``, the same fields as ``RingWorker._beat``, plus the
  wall-clock send time ``t`` the driver side uses to measure the lag), sealed by a real
  :class:`~ray_integration.wire.channel.Channel` per worker (its own sender id and message counter), sent by
  one beater thread per process that spreads the process's workers over the interval; with
  ``heartbeats="node"``, through the real :class:`~ray_integration.worker.node_beats.NodeBeats` of each worker
  (real beat files and leader lock in a temporary directory per simulated node; a node's workers live in
  different processes, as on a real node): one ``node_hb`` per node and interval, ``t`` its send time;
* ring requests (``ring_request``), ``synced`` after a ring formed, and rank 0's ``report`` records;
* a receiving thread per worker on its own connection, blocked in the real ``Channel.receive`` on its queue, as a
  real worker's mailbox thread: ring answers (validated with the real ``RingSpec.from_wire``), ``stop``,
  ``pending``, the driver's notices (``abort``, ``notice``, ``preemption``), the simulated pool's ``sim_kill``
  (Ray's kill in a real job), and its own ``keepalive``, pushed by the beater thread after ``KEEPALIVE_S`` without a
  message, as a worker's mailbox does;
* on a ring answer, the store traffic of a real formation on that connection: the arrival barrier
  (``arrival.announce_arrival``, then a wait for ``all_arrived``), the rank's gloo address (the lazy layout,
  154 bytes as gloo's), and the reads a lazy gloo ring makes (a wait and a get per pair it connects:
  rank ± 2^k). No gloo group is built: the TCP pairs are not the control plane.

What it does not model: ``fn``, its collectives and their failures (the scenario tells the survivors when a peer
died), Ray's actor calls (``info``, ``ping``, ``kill``: the simulated pool answers them), timeline batches.

Every store connection counts its operations and bytes (:class:`Counted`), split into the background (heartbeats
and reports) and the rest.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends import arrival, gloo
from elastic_ring.core.auth import AuthenticatedStore
from ray_integration.wire.channel import Channel
from ray_integration.wire.protocol import DRIVER, KEEPALIVE, DriverKind, Keys, WorkerKind
from ray_integration.worker.mailbox import KEEPALIVE_S
from ray_integration.worker.node_beats import NodeBeats

#: A gloo rank's published value is about this long (hostname, address, no pair ids: lazy).
GLOO_VALUE_BYTES = 154
#: Simulated time from a membership notice to the ring's next commit (a step).
STEP_S = 0.02


_beating = threading.local()  # set on the threads whose operations are heartbeats


class Counted:
    """A store connection that counts operations and bytes (keys and values, not the protocol's headers); those
    of a thread marked as a heartbeat thread (``_beating.on``) count apart."""

    _SIZED = {"queue_push", "set", "add", "wait", "check", "get", "queue_pop", "delete_key", "queue_len",
              "list_keys", "multi_get"}

    def __init__(self, store: Any, lock: threading.Lock | None = None) -> None:
        self._store, self._lock = store, lock
        self.ops = self.bytes = self.hb_ops = self.hb_bytes = 0

    def _count(self, name: str, args: tuple, result: Any) -> None:
        size = 0
        for a in args:
            if isinstance(a, (str, bytes)):
                size += len(a)
            elif isinstance(a, list):
                size += sum(len(k) for k in a if isinstance(k, (str, bytes)))
        if isinstance(result, (bytes, str)):
            size += len(result)
        elif isinstance(result, list):
            size += sum(len(k) for k in result if isinstance(k, (str, bytes)))
        if getattr(_beating, "on", False):
            self.hb_ops += 1
            self.hb_bytes += size
        else:
            self.ops += 1
            self.bytes += size

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in self._SIZED:
            return attr

        def call(*args: Any) -> Any:
            if self._lock is not None:
                with self._lock:
                    result = attr(*args)
            else:
                result = attr(*args)
            self._count(name, args, result)
            return result

        return call

    @property
    def timeout(self) -> datetime.timedelta:
        return self._store.timeout


def _connect(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


def lazy_peers(rank: int, world: int) -> list[int]:
    """The pairs a lazy gloo rank connects in its formation: rank ± 2^k (the dissemination barrier's)."""
    peers, d = set(), 1
    while d < world:
        peers.update(((rank + d) % world, (rank - d) % world))
        d <<= 1
    peers.discard(rank)
    return sorted(peers)


@dataclass
class SimWorker:
    wid: str
    node: str
    send: Channel
    receive: Channel
    recv_store: Counted
    started: bool = False
    alive: bool = True
    beats: int = 0
    generation: int = 0
    waiting: tuple[int, str] | None = None
    synced: bool = False
    round_id: int = 0
    rank: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    node_beats: NodeBeats | None = None  # heartbeats="node"
    heard_at: float = field(default_factory=time.monotonic)  # its last message (a keepalive is due KEEPALIVE_S after)
    keepalives: int = 0


class WorkerHost:
    """The simulated workers of one process, driven by commands from the driver's process (see :func:`main`)."""

    def __init__(self, host: str, port: int, secret: bytes, job: str, slots: list[tuple[str, str]],
                 interval_s: float, report_hz: float, events: "Any", beats_root: str | None = None) -> None:
        self.keys, self.secret, self.interval_s, self.report_hz = Keys(job), secret, interval_s, report_hz
        self.events = events  # multiprocessing queue to the driver's process
        self.send_lock = threading.Lock()
        self.send_store = Counted(_connect(host, port), self.send_lock)  # one connection sends for all its workers
        receivers: dict[str, dist.TCPStore] = {}

        def open_one(wid: str) -> None:
            receivers[wid] = _connect(host, port)

        threads = [threading.Thread(target=open_one, args=(wid,)) for wid, _ in slots]  # in parallel: a new
        for t in threads:                                                               # connection may stall 5 s
            t.start()                                                                   # on this VM's reverse DNS
        for t in threads:
            t.join()
        self.workers: dict[str, SimWorker] = {}
        for wid, node in slots:
            recv = Counted(receivers[wid])
            self.workers[wid] = SimWorker(wid, node, Channel(self.send_store, secret, wid),
                                          Channel(recv, secret, wid), recv)
            if beats_root is not None:  # heartbeats="node"
                self.workers[wid].node_beats = NodeBeats(job, node, wid, secret, interval_s, root=beats_root)
        self._stop = threading.Event()
        # workers told to re-form at their next commit, with when they reach it (in order: all a step later). One
        # thread asks for them all: a real worker starts no thread for a notice, and a thread started per notice
        # here (each start waits for the new thread to run) made 1,024 simulated workers read a notice in 1.6 s
        self._later: "queue.SimpleQueue[tuple[float, SimWorker]]" = queue.SimpleQueue()

    # ------------------------------------------------------------ threads
    def start_threads(self) -> None:
        for w in self.workers.values():
            threading.Thread(target=self._receive_loop, args=(w,), daemon=True).start()
        threading.Thread(target=self._later_loop, daemon=True).start()
        threading.Thread(target=self._beat_loop, daemon=True).start()
        if self.report_hz > 0:
            threading.Thread(target=self._report_loop, daemon=True).start()

    def _beat_loop(self) -> None:
        _beating.on = True
        while not self._stop.is_set():
            cycle = time.monotonic()
            live = [w for w in self.workers.values() if w.started and w.alive]
            for i, w in enumerate(live):
                due = cycle + i * self.interval_s / max(1, len(live))
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                with w.lock:
                    if not (w.started and w.alive):
                        continue
                    w.beats += 1
                    waiting = w.waiting
                    fields = dict(seq=w.beats, synced=w.synced, waiting=waiting[0] if waiting else 0,
                                  reason=waiting[1] if waiting else None, asked=w.generation)
                try:
                    self._beat(w, fields)
                    if time.monotonic() - w.heard_at >= KEEPALIVE_S:  # as a worker's mailbox, after a quiet while
                        w.heard_at, w.keepalives = time.monotonic(), w.keepalives + 1
                        w.send.send(self.keys.worker_inbox(w.wid), KEEPALIVE, seq=w.keepalives)
                except (RuntimeError, OSError):
                    pass  # the driver's store is gone: the run is ending
            rest = cycle + self.interval_s - time.monotonic()
            if rest > 0:
                self._stop.wait(rest)

    def _later_loop(self) -> None:
        while not self._stop.is_set():
            due, w = self._later.get()
            time.sleep(max(0.0, due - time.monotonic()))
            self.request(w, "membership")

    def _beat(self, w: SimWorker, fields: dict) -> None:
        """What ``RingWorker._beat`` sends for one interval (its own ``hb``, or its node's as their forwarder)."""
        tick = w.node_beats.tick(fields) if w.node_beats is not None else None
        if tick is None or tick.direct:
            w.send.send(self.keys.driver_inbox, WorkerKind.HEARTBEAT, t=time.time(), **fields)
        if tick is not None and tick.forward:
            w.send.send(self.keys.driver_inbox, WorkerKind.NODE_HEARTBEAT, t=time.time(), beats=tick.forward)
            w.node_beats.forwarded()

    def _report_loop(self) -> None:
        _beating.on = True  # background traffic too: counted with the heartbeats
        step = 0
        while not self._stop.wait(1.0 / self.report_hz):
            for w in list(self.workers.values()):
                if w.alive and w.rank == 0 and w.waiting is None:
                    step += 1
                    record = {"rank": 0, "round": w.round_id, "step": step, "loss": 1.0 / step}
                    try:
                        w.send.send(self.keys.driver_inbox, WorkerKind.REPORT, record=record)
                    except (RuntimeError, OSError):
                        pass

    def _receive_loop(self, w: SimWorker) -> None:
        inbox = self.keys.worker_inbox(w.wid)
        while not self._stop.is_set() and w.alive:
            try:
                msg = w.receive.receive(inbox, 3600.0)
            except (RuntimeError, OSError):
                return  # the driver's store is gone
            w.heard_at = time.monotonic()
            if msg is None or msg.get("from") != DRIVER or not w.alive:
                continue  # (its own keepalive, read as a worker's mailbox reads it)
            kind = msg.get("k")
            if kind == "sim_kill":
                w.alive = False
                return
            if kind == DriverKind.NOTICE.value:
                self.events.put(("notice", w.wid, msg.get("round"), time.time()))
                if msg.get("change") or msg.get("stop"):  # it asks at its next commit, a step from now
                    self._later.put((time.monotonic() + STEP_S, w))
                continue
            if kind == DriverKind.PREEMPTION.value:
                continue
            if kind == DriverKind.ABORT.value:
                if w.waiting is None and w.round_id <= int(msg.get("round", 0)):
                    self.request(w, "failure")
                continue
            if w.waiting is None or msg.get("generation") != w.waiting[0]:
                continue
            if kind == DriverKind.STOP.value:
                with w.lock:
                    w.alive, w.waiting = False, None
                self.events.put(("returned", w.wid, None, w.generation))
                return
            if kind == DriverKind.RING.value:
                self._form(w, msg)

    # ------------------------------------------------------------ what a worker does
    def request(self, w: SimWorker, reason: str) -> None:
        with w.lock:
            if not w.alive or w.waiting is not None:
                return
            w.generation += 1
            w.waiting = (w.generation, reason)
        try:
            w.send.send(self.keys.driver_inbox, WorkerKind.RING_REQUEST, generation=w.generation, reason=reason,
                        t=time.time())
        except (RuntimeError, OSError):
            pass

    def _form(self, w: SimWorker, msg: dict) -> None:
        spec = er.RingSpec.from_wire({**msg["spec"], "cuda_device": None}, self.secret)  # the worker's validation
        received = time.time()
        store = AuthenticatedStore(w.recv_store, self.secret)
        timeout = datetime.timedelta(seconds=spec.connect_timeout_s)
        try:
            if not arrival.announce_arrival(store, spec):
                store.wait([arrival.all_arrived_key(spec)], timeout)
            store.set(gloo.address_key(spec, spec.rank, lazy=True), b"a" * GLOO_VALUE_BYTES)
            for peer in lazy_peers(spec.rank, spec.world_size):
                key = gloo.address_key(spec, peer, lazy=True)
                store.wait([key], timeout)
                store.get(key)
        except (RuntimeError, OSError, er.CommError) as exc:
            self.events.put(("form_failed", w.wid, spec.round_id, f"{type(exc).__name__}: {exc}"))
            with w.lock:
                w.waiting = None
            return
        with w.lock:
            w.waiting, w.round_id, w.rank = None, spec.round_id, spec.rank
        self.events.put(("formed", w.wid, spec.round_id, (received, time.time())))
        if not w.synced:
            w.synced = True
            w.send.send(self.keys.driver_inbox, WorkerKind.SYNCED, round=spec.round_id)

    def counts(self) -> dict:
        stores = [self.send_store] + [w.recv_store for w in self.workers.values()]
        return {name: sum(getattr(c, name) for c in stores) for name in ("ops", "bytes", "hb_ops", "hb_bytes")}

    def stop(self) -> None:
        self._stop.set()


def main(host: str, port: int, secret: bytes, job: str, slots: list[tuple[str, str]], interval_s: float,
         report_hz: float, commands: Any, events: Any, beats_root: str | None = None, nice: int = 0) -> None:
    """A worker process (``beats_root``: heartbeats="node", the nodes' directories there; ``nice``: its CPU
    priority below the driver's, whose workers run on other machines in a job): connect every worker (in
    parallel), say ``ready``, then obey ``commands``:
    ``("start", wids)``, ``("fail", wids)`` (their collective failed: ask for a ring), ``("kill", wids)``,
    ``("counts", None)`` (answered on ``events``), ``("quit", None)``."""
    if nice:
        os.nice(nice)
    hosted = WorkerHost(host, port, secret, job, slots, interval_s, report_hz, events, beats_root)
    hosted.start_threads()
    events.put(("ready", None, None, None))
    while True:
        try:
            kind, wids = commands.get(timeout=1.0)
        except queue.Empty:
            continue
        if kind == "quit":
            hosted.stop()
            events.close()
            events.join_thread()
            os._exit(0)  # its threads block in the store's native calls: no destructors
        if kind == "counts":
            events.put(("counts", None, None, hosted.counts()))
            continue
        for wid in wids:
            w = hosted.workers.get(wid)
            if w is None:
                continue
            if kind == "start":
                w.started = True
                hosted.request(w, "start")
            elif kind == "fail":
                hosted.request(w, "failure")
            elif kind == "kill":
                w.alive = False
