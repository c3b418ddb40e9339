"""The driver's effects on Ray and on the workers: create, observe, answer, notify and kill worker actors.

Everything here *does*; nothing decides. The pool keeps one :class:`WorkerRecord`
per worker up to date from the workers' messages (:meth:`apply`) and from Ray
(:meth:`apply_ray`), and does what the driver's loop tells it. All times are
the driver's own monotonic clock.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from typing import Any, Callable

import ray

import elastic_ring as er
from elastic_ring import shadowing

from ..config import TrainerConfig
from ..errors import WorkerError, WorkerGaveUp
from ..wire.channel import Channel
from ..wire.protocol import DriverKind, Keys, Returned, WorkerKind
from ..wire.settings import WorkerSettings
from ..worker.actor import RingWorker  # the one import of the worker side: the pool creates its actors
from .decisions import Probe, StartFailureKind
from .drains import PersistLog
from .pacing import resend_after_s, wakes_states
from .records import Mail, WorkerRecord

_RemoteWorker = ray.remote(RingWorker)

#: How long a silent worker's actor has to answer through Ray before the silence verdict stands.
PROBE_S = 0.5


class WorkerPool:
    def __init__(self, config: TrainerConfig, send: Channel, store_host: str, store_port: int, keys: Keys,
                 secret: bytes, fn: Callable, fn_config: dict, settings: WorkerSettings) -> None:
        self.config, self.send, self.keys = config, send, keys
        self.store_host, self.store_port, self._secret = store_host, store_port, secret
        self.fn, self.fn_config, self.settings = fn, fn_config, settings
        self.records: dict[str, WorkerRecord] = {}
        self.start_failures: list[WorkerRecord] = []  # workers that failed before fn ran, oldest first
        self.mail = Mail()
        self._ready_seq = itertools.count()
        self._by_ref: dict[Any, tuple[str, str]] = {}   # ObjectRef -> (worker id, "info" | "run")
        self.durable_checkpoint: str | None = None  # the newest checkpoint of the job's state (written or resumed)
        self.reported_checkpoint: str | None = None  # the newest reported checkpoint written (a Ray Train script's)
        self.persists = PersistLog()  # the writes the driver asked for (drains), by number, from the workers' events
        self.receive: Channel | None = None  # the driver's receiving channel (counts forged messages), if known
        self.inbox_delay_s = 0.0  # how far behind the driver reads its inbox (set by its loop: wire.InboxProbe)
        self.foreign_beats = 0  # node_hb entries refused: a worker unknown, dead or on another node than the sender
        self._notices: tuple[int, list[tuple[float, dict]]] = (-1, [])  # (round, [(sent at, fields)]) as sent
        self._preemption: dict | None = None  # the newest preemption notice sent

    # ------------------------------------------------------------ effects
    def request(self, count: int) -> int:
        """Ask Ray for ``count`` more workers (their records at once: pending actors count as requested); returns
        how many records it added."""
        options: dict[str, Any] = {"num_cpus": self.config.cpus_per_worker, "num_gpus": self.config.worker_gpus,
                                   "max_concurrency": 4, "max_restarts": 0}
        if self.config.resources_per_worker:
            options["resources"] = dict(self.config.resources_per_worker)
        if self.config.runtime_env:
            options["runtime_env"] = self.config.runtime_env
        for _ in range(count):
            worker_id = uuid.uuid4().hex[:8]
            actor = _RemoteWorker.options(**options).remote(
                worker_id, self.store_host, self.store_port, self.keys.job, self._secret,
                self.config.heartbeat_interval_s, self.config.connect_timeout_s)
            record = WorkerRecord(worker_id, actor, actor.info.remote(),
                                  actor.run.remote(self.fn, self.fn_config, self.settings), created_at=time.monotonic())
            self.records[worker_id] = record
            self._by_ref[record.info_ref] = (worker_id, "info")
            self._by_ref[record.run_ref] = (worker_id, "run")
        return count

    def watched_refs(self) -> list[Any]:
        """The Ray object refs whose completion changes a record (for the driver's Ray watcher)."""
        return list(self._by_ref)

    def _deliver(self, record: WorkerRecord, answer: dict) -> None:
        self.send.send(self.keys.worker_inbox(record.worker_id), answer.pop("k"), **answer)

    def answer(self, record: WorkerRecord, spec: er.RingSpec, stop: bool = False, handover: bool = False,
               persist_id: int = 0, within_s: float | None = None) -> None:
        """Answer ``record``'s ring request with ``spec``; ``persist_id``: the round writes its state right after
        its sync (the driver's write number; retried for ``within_s``) and re-forms."""
        record.answer = {"k": DriverKind.RING, "generation": record.generation, "spec": spec.to_wire(), "stop": stop,
                         "handover": handover}
        if persist_id:
            record.answer.update(persist=persist_id, within_s=within_s)
        self._deliver(record, dict(record.answer))
        record.answered, record.answered_at, record.in_ring = record.generation, time.monotonic(), True
        record.resends = 0

    def expect(self, record: WorkerRecord, reason: str) -> None:
        """``record`` (a member that has not asked yet) will ask for its next ring: the next answer is for the
        generation that request will carry (:func:`.decisions.prompt_ring`). A waiting record already asked."""
        if not record.waiting:
            record.generation += 1
            # the answer it had may have been lost on its way: sent again while its heartbeats say it waits for it
            # (its round was aborted: the worker's formation of it fails at once and it asks for the next one). Given
            # ahead twice before it asked: the one it had before the first stays the one it may still wait for.
            if not record.expected:
                record.previous = record.answer
            record.reason, record.expected = reason, record.generation

    def stop(self, record: WorkerRecord, why: str) -> None:
        """Answer a waiting worker with stop: its run returns (it leaves the job)."""
        if record.waiting:
            record.answer = {"k": DriverKind.STOP, "generation": record.generation, "why": why}
            self._deliver(record, dict(record.answer))
            record.answered, record.answered_at, record.resends = record.generation, time.monotonic(), 0

    def stop_waiting(self, why: str) -> None:
        for record in self.live():
            self.stop(record, why)

    def notify(self, records: list[WorkerRecord], round_id: int, change: bool = False, persist: bool = False,
               stop: bool = False, persist_id: int = 0, within_s: float | None = None,
               preemption: dict | None = None) -> None:
        """Tell ``records`` what round ``round_id`` must do at its next commit (``persist_id``: the driver's number
        of the write it asks for, retried for ``within_s`` seconds). ``preemption``: a new preemption notice for the
        same members, carried by this message instead of one of its own (a drain's notice and its re-form request
        reach each worker in one message: half the pushes and reads)."""
        fields: dict[str, Any] = {"round": round_id, "change": change, "persist": persist, "stop": stop}
        if persist_id:
            fields.update(persist_id=persist_id, within_s=within_s)
        if self._notices[0] != round_id:
            self._notices = (round_id, [])
        self._notices[1].append((time.monotonic(), fields))
        if preemption is not None:
            self._preemption = preemption
            fields = {**fields, "preemption": preemption}
        self._tell([r for r in records if not r.dead], DriverKind.NOTICE, fields)

    def tell_preemption(self, records: list[WorkerRecord], notice: dict) -> None:
        """Tell ``records`` the ring's preemption notice (what ``get_preemption_info()`` answers)."""
        self._preemption = notice
        self._tell([r for r in records if not r.dead and not r.finished], DriverKind.PREEMPTION, {"notice": notice})

    def repeat_notices(self, records: list[WorkerRecord], round_id: int) -> None:
        """Push round ``round_id``'s notices and the newest preemption notice to ``records`` again, as sent (a
        write's ``within_s`` less the time since): a member that has them changes nothing (notices merge, a write
        already made is not made again, an older preemption notice is ignored)."""
        now = time.monotonic()
        live = [r for r in records if not r.dead]
        for sent_at, fields in self._notices[1] if self._notices[0] == round_id else []:
            if fields.get("within_s") is not None:
                fields = {**fields, "within_s": max(0.0, fields["within_s"] - (now - sent_at))}
            self._tell(live, DriverKind.NOTICE, fields)
        if self._preemption is not None:
            self._tell([r for r in live if not r.finished], DriverKind.PREEMPTION, {"notice": self._preemption})

    def abort_round(self, records: list[WorkerRecord], round_id: int, why: str) -> None:
        """Tell ``records`` to abandon round ``round_id`` at once: a collective or a formation of it that waits on
        a lost peer fails now instead of at its timeout."""
        self._tell([r for r in records if not r.dead and not r.finished], DriverKind.ABORT,
                   {"round": round_id, "why": why})

    def _tell(self, records: list[WorkerRecord], kind: DriverKind, fields: dict[str, Any]) -> None:
        """Push one sealed ``kind`` message into each of ``records``' queues, which the worker's mailbox thread
        reads while ``fn`` trains (:mod:`ray_integration.worker.mailbox`): about 20–40 µs of the loop per worker,
        where a Ray actor call cost 0.2–0.4 ms (``python -m benchmarks.control_plane --ray-calls``)."""
        for record in records:
            self.send.send(self.keys.worker_inbox(record.worker_id), kind, **fields)

    def probe(self, record: WorkerRecord, now: float) -> Probe:
        """Ask ``record``'s actor, through Ray, whether its process still answers (non-blocking)."""
        if record.probe_ref is None or now - record.probe_at > 4 * PROBE_S:  # none, or one of an earlier silence
            record.probe_ref, record.probe_at = record.actor.ping.remote(), now
            return Probe.PENDING
        ready, _ = ray.wait([record.probe_ref], timeout=0, fetch_local=True)
        if ready:
            ref, record.probe_ref = record.probe_ref, None
            try:
                ray.get(ref, timeout=PROBE_S)
            except (ray.exceptions.RayError, TimeoutError):
                return Probe.UNANSWERED  # it died meanwhile
            return Probe.ANSWERED
        return Probe.UNANSWERED if now - record.probe_at > PROBE_S else Probe.PENDING

    def grace(self, now: float) -> None:
        """A fresh heartbeat grace for every worker (the driver itself was not running)."""
        for record in self.records.values():
            if record.beat_at is not None:
                record.beat_at = max(record.beat_at, now)

    def inbox_backlog(self) -> int:
        """Messages waiting in the driver's queue that the inbox thread has not read yet."""
        return self.send.pending(self.keys.driver_inbox)

    def forged(self) -> int:
        """Messages that failed authentication so far (dropped unread)."""
        return self.send.forged + (self.receive.forged if self.receive is not None else 0)

    @staticmethod
    def draining_nodes() -> dict[str, int]:
        """Ray's draining nodes: node id hex -> deadline in ms (0: none); the signal
        Ray Train v2's preemption watcher reads, set by autoscaler v2 and `ray drain-node`."""
        return ray._private.state.state.get_draining_nodes()

    def kill(self, record: WorkerRecord, cause: str) -> None:
        if not record.dead:
            if record.fault:
                cause = f"{cause}; it reported: {record.fault}"
            ray.kill(record.actor, no_restart=True)
            record.dead, record.cause = True, cause

    def shutdown(self, why: str) -> None:
        for record in self.live():
            if record.waiting:
                try:
                    self.stop(record, why)
                except (RuntimeError, OSError):
                    pass  # the store is gone; the kill below ends the worker anyway
        for record in self.records.values():
            if not record.dead:
                ray.kill(record.actor, no_restart=True)
                record.dead = True

    def diagnose_start(self, ready: int) -> str:
        """Why fewer than min_workers started: missing resources (which), or workers that did not get ready."""
        pending = [r for r in self.live() if r.info is None]
        head = (f"only {ready} of min_workers={self.config.min_workers} workers started within start_timeout_s="
                f"{self.config.start_timeout_s}")
        need = {"CPU": self.config.cpus_per_worker, "GPU": self.config.worker_gpus, **self.config.resources_per_worker}
        total, free = ray.cluster_resources(), ray.available_resources()
        short = [f"{k} (each worker needs {v:g}; the cluster has {total.get(k, 0):g}, {free.get(k, 0):g} free)"
                 for k, v in need.items() if v and free.get(k, 0) < v]
        if pending and short:
            return (f"{head}: {len(pending)} worker actor(s) are still waiting for resources the cluster lacks: "
                    f"{', '.join(short)}. Add nodes with these resources, lower min_workers, or ask for less per "
                    "worker (cpus_per_worker, gpus_per_worker, resources_per_worker)")
        if pending:
            return (f"{head}: {len(pending)} worker actor(s) were placed but did not finish starting (slow imports, "
                    "or a runtime_env that takes long to set up); raise start_timeout_s")
        return (f"{head}: the workers started but did not reach the rendezvous (fn never asked for its ring); "
                "look at the workers' logs, or raise start_timeout_s")

    # ------------------------------------------------------------ observation
    def live(self) -> list[WorkerRecord]:
        """Workers starting or in the job: not dead and not finished (a worker that left a draining
        node has finished and no longer counts against max_workers)."""
        return [r for r in self.records.values() if not r.dead and not r.finished]

    def apply(self, msg: dict) -> bool:
        """Bring a record up to date with one of its worker's (authenticated) messages. Returns whether that
        changed something the driver's states decide on (:func:`.decisions.wakes_states`)."""
        record = self.records.get(msg["from"])
        kind = WorkerKind.of(msg)
        if record is None or kind is None or record.dead and kind is not WorkerKind.NODE_HEARTBEAT:
            return False  # (a dead sender's node_hb still counts for its live node-mates: they sent no hb of their own)
        changed = _HANDLERS[kind](self, record, msg, time.monotonic())
        return wakes_states(kind.value, changed)

    def _heartbeat(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        # A counter that advanced changes no decision by itself: silence is judged at the next step, which sees it.
        # (Counting a worker heard again after a gap as news would make every heartbeat news once the driver falls
        # behind its inbox, which hands them over in bursts: a step per message again, and further behind.)
        changed = False
        waiting = msg.get("waiting")
        if isinstance(msg.get("seq"), int) and msg["seq"] > record.beat_seq:
            record.beat_seq, record.beat_at, record.heard_at = msg["seq"], now, now
            record.unheard, record.probe_ref = 0, None
        if msg.get("synced") is True:
            record.has_state = True
        self._confirm(record, msg.get("asked"), now)  # (its request may be lost: its heartbeats say it asked)
        if isinstance(waiting, int) and waiting > 0:
            changed = self._note_request(record, waiting, msg.get("reason"), now) or changed
            lost = record.answer if waiting == record.answered else \
                record.previous if record.previous is not None and waiting == record.previous["generation"] else None
            if lost is not None and now - record.answered_at > \
                    resend_after_s(self.config.heartbeat_interval_s, self.inbox_delay_s, record.resends):
                self._deliver(record, dict(lost))  # the answer got lost: send it again
                record.answered_at, record.resends = now, record.resends + 1
        return changed

    def _node_heartbeat(self, sender: WorkerRecord, msg: dict, now: float) -> bool:
        """A node's heartbeats forwarded by ``sender`` (``heartbeats="node"``): each applied as its worker's own,
        but only for live workers that Ray placed on the sender's node (a member of the job cannot keep another
        node's workers alive); the rest are ignored and counted (``foreign_beats``)."""
        beats, changed = msg.get("beats"), False
        if not isinstance(beats, dict) or sender.info is None:
            return False
        for worker_id, beat in beats.items():
            record = self.records.get(worker_id)
            if record is None or record.dead or record.info is None or record.node_id != sender.node_id or \
                    not isinstance(beat, dict):
                self.foreign_beats += 1
                continue
            changed = self._heartbeat(record, beat, now) or changed
        return changed

    def _ring_request(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        return self._note_request(record, msg.get("generation"), msg.get("reason"), now)

    def _synced(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        record.has_state = True
        return False

    def _report(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        if isinstance(msg.get("record"), dict):
            self.mail.reports.append({**msg["record"], "driver_time": time.time()})
        return False

    def _timeline(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        if isinstance(msg.get("events"), list):
            self.mail.timeline.append((record.worker_id, str(msg.get("host")), msg["events"], int(msg.get("dropped") or 0)))
        return False

    def _resumed(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        if isinstance(msg.get("info"), dict):
            self.mail.resumed.append(msg["info"])
            if isinstance(msg["info"].get("uri"), str) and self.durable_checkpoint is None:
                self.durable_checkpoint = msg["info"]["uri"]
        return True

    def _checkpoint(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        if isinstance(msg.get("event"), dict):
            self.mail.checkpoints.append({**msg["event"], "worker": record.worker_id})
            if msg["event"].get("kind") == "checkpoint_written" and isinstance(msg["event"].get("uri"), str):
                self.durable_checkpoint = msg["event"]["uri"]
            elif msg["event"].get("kind") == "reported_checkpoint_written" and isinstance(msg["event"].get("uri"), str):
                self.reported_checkpoint = msg["event"]["uri"]
            self.persists.apply(msg["event"], now, record.worker_id)
        return True

    def _fault(self, record: WorkerRecord, msg: dict, now: float) -> bool:
        record.fault = f"{msg.get('what')}: {msg.get('error')}"
        return True

    def _note_request(self, record: WorkerRecord, generation: Any, reason: Any, now: float) -> bool:
        """Note a ring request; True if it was a new one. The request for a ring answered in advance is no news
        (:meth:`_confirm`)."""
        if self._confirm(record, generation, now):
            return False
        if isinstance(generation, int) and generation > record.generation and \
                reason in ("start", "failure", "membership"):
            record.generation, record.reason = generation, reason
            if record.joined_seq is None:
                record.joined_seq = next(self._ready_seq)
                record.ready_at = time.monotonic()
            return True
        return False

    @staticmethod
    def _confirm(record: WorkerRecord, generation: Any, now: float) -> bool:
        """The worker asked for ``generation``: an answer given before it asked (:meth:`expect`) is asked for now, or
        was passed by a later request. Returns whether it was that very generation (its answer waits in the
        worker's queue: a resend is due from now on, not from when the driver answered)."""
        if not record.expected or not isinstance(generation, int) or generation < record.expected:
            return False
        asked, record.expected, record.previous = generation == record.expected, 0, None
        if asked:
            record.answered_at, record.resends = now, 0
        return asked

    def apply_ray(self, refs: list[Any]) -> None:
        """Bring records up to date with Ray object refs that completed (actor started, run ended)."""
        for ref in refs:
            owner = self._by_ref.pop(ref, None)
            if owner is None:
                continue
            record = self.records[owner[0]]
            if owner[1] == "info":
                self._started(record, ref)
            else:
                self._ended(record, ref)

    def _started(self, record: WorkerRecord, ref: Any) -> None:
        try:
            record.info = ray.get(ref)
            record.beat_at = time.monotonic()  # it heartbeats from its constructor on
        except ray.exceptions.RayActorError as exc:
            if record.dead:
                return
            record.dead, record.cause = True, f"did not start: {_first_lines(str(exc))}"
            self._note_start_failure(record, _start_failure(exc))
        except ray.exceptions.RayError as exc:
            record.dead, record.cause = True, f"did not start: {type(exc).__name__}: {_first_lines(str(exc))}"
            self._note_start_failure(record, _start_failure(exc))

    def _returned(self, record: WorkerRecord, returned: Returned) -> None:
        """``fn`` returned on ``record``'s worker. A ring given before it asked was asked for after all if it reached
        that generation (its request may still be on its way, or lost): only one it never asked for is ``unasked``."""
        record.value, record.finished = returned.value, True
        self._confirm(record, returned.asked, time.monotonic())
        if record.leaving and not record.dead:  # it left its draining node: free the slot at once
            self.free_slot(record)

    def free_slot(self, record: WorkerRecord) -> None:
        """End the actor of a worker that left the job (its node drains): its resources are free at once."""
        ray.kill(record.actor, no_restart=True)

    def _note_start_failure(self, record: WorkerRecord, failure: tuple[StartFailureKind, str] | None) -> None:
        if failure is not None and record.start_kind is None:
            record.start_kind, record.start_error = failure
            self.start_failures.append(record)

    def _ended(self, record: WorkerRecord, ref: Any) -> None:
        try:
            self._returned(record, ray.get(ref))
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, WorkerError):
                record.user_error, record.finished = cause, True
            elif isinstance(cause, WorkerGaveUp):  # its rendezvous or store connection failed: a lost worker
                record.dead, record.cause = True, f"left the job: {cause}"
            elif record.info is None or not record.in_ring and record.generation == 0:
                # fn never started: its arguments could not be loaded (e.g. its module is missing there)
                record.dead, record.cause = True, f"could not run fn: {_first_lines(str(exc))}"
                self._note_start_failure(record, (_load_or_init(str(exc)), _first_lines(str(exc), 12)))
            else:
                record.dead, record.cause = True, f"run failed: {_first_lines(str(exc))}"
        except ray.exceptions.RayError as exc:  # the actor or its node died
            if not record.dead:
                record.dead, record.cause = True, f"process lost: {type(exc).__name__}"
                self._note_start_failure(record, _start_failure(exc))  # it died starting (whichever ref came first)


#: The pool's method for each kind of a worker's message (:meth:`WorkerPool.apply`).
_HANDLERS = {WorkerKind.HEARTBEAT: WorkerPool._heartbeat, WorkerKind.NODE_HEARTBEAT: WorkerPool._node_heartbeat,
             WorkerKind.RING_REQUEST: WorkerPool._ring_request,
             WorkerKind.SYNCED: WorkerPool._synced, WorkerKind.REPORT: WorkerPool._report,
             WorkerKind.TIMELINE: WorkerPool._timeline, WorkerKind.RESUMED: WorkerPool._resumed,
             WorkerKind.CHECKPOINT: WorkerPool._checkpoint, WorkerKind.FAULT: WorkerPool._fault}


def _start_failure(exc: BaseException) -> tuple[StartFailureKind, str] | None:
    """What kind of start failure ``exc`` is, and what to tell the user, if it says the worker actor could
    not start: its constructor raised or its class could not be imported there (``actor_init_failed``), or
    Ray could not set up its runtime_env. None for everything else (a process or node lost while starting
    is an ordinary loss)."""
    if isinstance(exc, ray.exceptions.RayActorError) and getattr(exc, "actor_init_failed", False):
        text = _first_lines(str(exc), 12)
        shadowed = [line for line in text.splitlines() if shadowing.MARKER in line]
        return _load_or_init(text), shadowed[-1] if shadowed else text  # Ray's own text before it misleads
    if isinstance(exc, ray.exceptions.RuntimeEnvSetupError):
        return StartFailureKind.RUNTIME_ENV, ("Ray could not set up its runtime_env (ElasticTrainer(runtime_env=...) "
                                              "merged with the job's):\n" + _first_lines(str(exc), 8))
    return None


_LOAD_ERRORS = ("ModuleNotFoundError", "ImportError", "No module named", "Can't get attribute", "UnpicklingError",
                shadowing.MARKER)


def _load_or_init(text: str) -> StartFailureKind:
    """An import or unpickling error fails alike on every node (LOAD); anything else may be the node (INIT)."""
    return StartFailureKind.LOAD if any(marker in text for marker in _LOAD_ERRORS) else StartFailureKind.INIT


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_lines(text: str, n: int = 3) -> str:
    """The first ``n`` lines of a message, or the last ``n`` of a traceback (where the exception is),
    without colour codes and without the ``^^^^`` lines that point at columns."""
    text = _ANSI.sub("", text)
    lines = [line for line in text.strip().splitlines() if line.strip() and line.strip(" ^~")]
    traceback = "Traceback" in text or any(line.startswith("  File ") for line in lines)
    return "\n".join(lines[-n:]) if traceback else "\n".join(lines[:n])
