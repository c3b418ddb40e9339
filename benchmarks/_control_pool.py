"""The driver's side of :mod:`benchmarks.control_plane`: the real ``WorkerPool`` with its Ray calls replaced.

:class:`SimPool` is ``ray_integration.driver.pool.WorkerPool`` itself (records, message handling, answers,
stops, the inbox backlog: all inherited, unchanged), with the methods that talk to Ray overridden:

* ``request`` starts idle simulated workers (already connected, in the worker processes) instead of creating
  actors, and hands the driver their "actor started" completion at once (Ray would after the actor's start), or,
  while the scenario holds them (:attr:`SimPool.hold`: no room in the cluster), when it releases them;
* ``apply_ray`` reads the scenario's completions (``("info" | "dead", worker id)``, ``("return", worker id, the
  generation it last asked a ring for)``) instead of
  ``ray.get`` on object refs; ``watched_refs`` is empty (nothing for the Ray watcher to wait on);
* ``notify``, ``tell_preemption`` and ``abort_round`` are the real pool's: sealed pushes into each worker's queue,
  which a real worker's mailbox thread reads (``notify`` also notes when a round's last notice was pushed);
* ``kill`` tells the worker's process to drop it; ``probe`` answers at once from the scenario's truth;
* ``draining_nodes`` returns the scenario's drains instead of asking Ray's GCS.

It also measures: the time of each ring answer, and each heartbeat's lag from its send to the driver applying it
(a ``node_hb``'s: from its forwarder's send).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ray_integration.driver.decisions import Probe
from ray_integration.driver.pool import WorkerPool
from ray_integration.driver.records import WorkerRecord
from ray_integration.wire.protocol import Returned, WorkerKind


class SimPool(WorkerPool):
    def __init__(self, *args: Any, wakeups: "queue.SimpleQueue", nodes: dict[str, str],
                 order: list[str], command: Callable[[str, list[str]], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wakeups, self.nodes, self.command = wakeups, nodes, command
        self._idle = list(order)  # simulated workers not started yet, in the order they start
        self.hold = False  # requested workers wait for release() (no room in the cluster yet)
        self._held: list[str] = []
        self.draining_script: dict[str, int] = {}
        self.drain_seen_at: float | None = None  # wall time the driver's poll first saw the scripted drain
        self.notified_at: dict[int, float] = {}  # round -> wall time its last notice was pushed
        self.answered_at: dict[tuple[int, str], float] = {}  # (round, worker) -> wall time of its ring answer
        self.started_at: dict[str, float] = {}  # worker -> wall time the driver asked for it
        self.lags: list[float] | None = None  # heartbeat lags (s) while measured
        self.requested_at: dict[str, float] = {}  # worker -> wall time its last ring request was applied
        self.request_sent_at: dict[str, float] = {}  # worker -> wall time it sent that request
        self.background_msgs = 0  # heartbeats and reports applied
        self._lock = threading.Lock()

    # ------------------------------------------------------------ Ray's part, simulated
    def request(self, count: int) -> int:
        """Like Ray creating ``count`` actors: records at once (pending actors count as requested); they start
        now, or at :meth:`release` while :attr:`hold` (the cluster has no room yet)."""
        asked = []
        for _ in range(count):
            if not self._idle:
                break  # no capacity left: a real job's actors would stay pending
            wid = self._idle.pop(0)
            self.records[wid] = WorkerRecord(wid, actor=None, info_ref=None, run_ref=None, created_at=time.monotonic())
            asked.append(wid)
        self._held += asked
        if not self.hold:
            self.release()
        return len(asked)

    def release(self) -> None:
        """Start the workers asked for while :attr:`hold` (their actors start)."""
        self.hold = False
        started, self._held = self._held, []
        if started:
            now = time.time()
            for wid in started:
                self.started_at[wid] = now
            self.command("start", started)
            self.wakeups.put(("ray", [("info", wid) for wid in started]))

    def watched_refs(self) -> list[Any]:
        return []

    def apply_ray(self, refs: list[Any]) -> None:
        for what, wid, *asked in refs:  # ("return", wid, asked): and the generation it last asked a ring for
            record = self.records.get(wid)
            if record is None:
                continue
            if what == "info":
                record.info = {"worker_id": wid, "node_id": self.nodes[wid], "hostname": "sim", "node_ip": "127.0.0.1",
                               "pid": 0}
                record.beat_at = time.monotonic()
            elif what == "dead" and not record.dead:
                record.dead, record.cause = True, "process lost: ActorDiedError (simulated)"
            elif what == "return":
                self._returned(record, Returned(None, *asked))

    def notify(self, records: list[WorkerRecord], round_id: int, **fields: Any) -> None:
        super().notify(records, round_id, **fields)
        self.notified_at[round_id] = time.time()

    def free_slot(self, record: WorkerRecord) -> None:
        pass  # a simulated worker holds no resources

    def probe(self, record: WorkerRecord, now: float) -> Probe:
        return Probe.UNANSWERED if record.dead else Probe.ANSWERED

    def draining_nodes(self) -> dict[str, int]:  # type: ignore[override]
        if self.draining_script and self.drain_seen_at is None:
            self.drain_seen_at = time.time()
        return dict(self.draining_script)

    def kill(self, record: WorkerRecord, cause: str) -> None:
        if not record.dead:
            self.send.send(self.keys.worker_inbox(record.worker_id), "sim_kill")
            self.command("kill", [record.worker_id])
            record.dead, record.cause = True, cause

    def shutdown(self, why: str) -> None:
        for record in self.records.values():
            record.dead = True

    # ------------------------------------------------------------ measured
    def answer(self, record: WorkerRecord, spec: Any, stop: bool = False, handover: bool = False,
               persist_id: int = 0, within_s: float | None = None) -> None:
        super().answer(record, spec, stop=stop, handover=handover, persist_id=persist_id, within_s=within_s)
        self.answered_at[(spec.round_id, record.worker_id)] = time.time()

    def apply(self, msg: dict) -> bool:
        kind = WorkerKind.of(msg)
        if kind in (WorkerKind.HEARTBEAT, WorkerKind.NODE_HEARTBEAT, WorkerKind.REPORT):
            with self._lock:
                self.background_msgs += 1
                if kind is not WorkerKind.REPORT and self.lags is not None and isinstance(msg.get("t"), float):
                    self.lags.append(time.time() - msg["t"])
        elif kind is WorkerKind.RING_REQUEST:
            self.requested_at[msg.get("from")] = time.time()
            if isinstance(msg.get("t"), float):
                self.request_sent_at[msg.get("from")] = msg["t"]
        return super().apply(msg)
