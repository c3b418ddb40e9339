"""The membership driver: the loop that steps the states (:mod:`.states`) and the one place that acts.

Each step the loop shows the current state a :class:`~.context.Context` of what
it knows, and does each action the state asks for (:meth:`Driver.act`), showing
it a fresh Context after each; the state then names the next state. The loop
wakes on every worker message and every Ray completion (no polling of the
store) and applies it to its worker's record at once; the state steps at once
when something that may change a decision arrived (:mod:`.pacing`), else every
:data:`TICK_S` for its timers (a heartbeat that only advanced a counter waits
for the tick: a step costs O(members)). Every time is the
driver's own monotonic clock; when the loop itself did not run for a while (a GC
pause, a stopped or starved process), every worker gets a fresh grace
(:func:`decisions.driver_stalled`): their silence was the driver's.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

import elastic_ring as er

from ..config import TrainerConfig
from ..wire.channel import InboxProbe
from . import decisions, pacing
from .context import (
    AbortRound, Action, AddEvent, Context, CountFailure, DiagnoseStart, DropRaised, DropRing, Form, KillSilent,
    Notify, PollDrains, RepeatNotices, ReportLost, RequestCapacity, RequestPersist, StartFailure, StopWaiting,
    StopWorkers, UserError,
)
from .decisions import Kill, Verdict
from .drains import DrainView
from .events import EventLog
from .formation import Member, Ring, form_ring, ring_specs
from .pool import WorkerPool
from .preemption import Preemption
from .records import WorkerRecord
from .states import DriverState, Starting
from .watcher import DrainWatcher, RayWatcher

#: The driver's timers (silence, deadlines, drains) are looked at least this often.
TICK_S = 0.1
#: How often the driver's drain watcher asks Ray which nodes are draining (a GCS call, 0.15 ms wall and 0.035 ms CPU
#: on a local GCS, on the watcher's thread: :class:`~.watcher.DrainWatcher`); a drain reaches the loop at most this
#: much later than Ray knew of it, and the loop steps at once. The loop looks again at least this often for workers
#: that started on a node already draining.
DRAIN_POLL_S = 0.1


class Driver:
    def __init__(self, config: TrainerConfig, pool: WorkerPool, store_host: str, events: EventLog,
                 wakeups: "queue.SimpleQueue[tuple[str, Any]]") -> None:
        self.config, self.pool, self.store_host, self.events = config, pool, store_host, events
        self.limits = config.limits
        self.wakeups = wakeups
        self.round_id = 0
        self.ring: Ring | None = None
        self.failure_times: list[float] = []  # driver clock; only those within failure_window_s count
        self.lost_reported: set[str] = set()
        self.draining: dict[str, int] = {}  # node id hex -> deadline ms, as of the last poll
        self.newly_draining: tuple[str, ...] = ()  # the workers the last poll of this tick marked leaving
        self.last_drain_poll = 0.0
        self.reported_drains: dict[str, int] = {}  # the draining nodes as the drain watcher last reported them
        self.broken_at: list[float] = []  # when workers were killed as broken connections (decisions.others_heard)
        self.stop_reason: str | None = None   # set (e.g. by a SIGTERM handler): stop at the next commit
        self.stop_requested_at: float | None = None
        self.abort_reason: str | None = None  # set by a second SIGTERM or the like: abandon the stop now
        self.tampering: str | None = None     # set when a live worker's messages keep going missing
        self.deferred_at: float | None = None  # since when silence verdicts wait for the inbox's backlog
        self.last_grace = float("-inf")       # when every worker last got a fresh grace (a driver stall)
        self.start_diagnosis: str | None = None
        self.dropped: dict[str, UserError] = {}  # members dropped because fn raised (worker_errors="replace")
        self.preemption = Preemption()         # what the ring's members were last told of their nodes' drains
        self.preemption_due: dict | None = None  # a new preemption notice, not sent yet (goes at the step's end)
        self.prompted_at: float | None = None  # when the current ring was answered before its members asked
        # how far behind this loop reads its inbox: the workers' silence is judged net of it
        self.inbox = InboxProbe(pool.send, pool.keys.driver_inbox, config.heartbeat_interval_s,
                                lost_after_s=config.heartbeat_timeout_s)

    # ------------------------------------------------------------ inputs (safe from a signal handler or any thread)
    def request_stop(self, reason: str) -> None:
        """Stop at the next commit, written durably."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_requested_at = reason, time.monotonic()

    def abort(self, reason: str) -> None:
        """Abandon everything now (the workers are killed)."""
        self.abort_reason = reason

    # ------------------------------------------------------------ what the states see
    @property
    def world_size(self) -> int | None:
        return self.ring.world_size if self.ring else None

    def members(self) -> list[WorkerRecord]:
        if self.ring is None:
            return []
        return [self.pool.records[w] for w in self.ring.worker_ids]

    def joiners(self) -> list[WorkerRecord]:
        """Fully started workers waiting for their first ring, not on a draining node, oldest first."""
        member_ids = set(self.ring.worker_ids) if self.ring else set()
        ready = [r for r in self.pool.live() if r.waiting and r.worker_id not in member_ids and not r.in_ring
                 and r.node_id not in self.draining]
        return sorted(ready, key=lambda r: r.joined_seq)

    def context(self) -> Context:
        now = time.monotonic()
        records = self.pool.records.values()
        members = self.members()
        views = tuple(r.view(now) for r in members)
        raised = tuple(UserError(r.worker_id, r.node_id, r.user_error) for r in records
                       if r.user_error is not None and r.worker_id not in self.dropped)
        return Context(
            now=now, limits=self.limits, start_timeout_s=self.config.start_timeout_s, round_id=self.round_id,
            world_size=self.world_size, members=views,
            joiners=tuple(r.worker_id for r in self.joiners()),
            results={r.worker_id: r.value for r in members if r.finished},
            unreported_losses=tuple(r.worker_id for r in members if r.dead and r.worker_id not in self.lost_reported),
            newly_draining=self.newly_draining, failure_ages_s=tuple(now - t for t in self.failure_times),
            stop_reason=self.stop_reason,
            stop_age_s=None if self.stop_requested_at is None else now - self.stop_requested_at,
            abort_reason=self.abort_reason, tampering=self.tampering,
            user_error=raised[0] if raised else None, raised=raised, dropped=dict(self.dropped),
            start_failures=tuple(StartFailure(r.worker_id, r.start_kind, r.start_error)
                                 for r in self.pool.start_failures),
            returned_early=tuple(r.worker_id for r in records if r.finished and not r.in_ring and r.user_error is None),
            ever_had_state=any(r.has_state for r in records), checkpoint=self.resumable_checkpoint(),
            drain=self.drain_view(members, now), start_diagnosis=self.start_diagnosis,
            write_landing=self.pool.persists.landing(self._working),
            prompt_age_s=None if self.prompted_at is None else now - self.prompted_at)

    def resumable_checkpoint(self) -> str | None:
        """The newest checkpoint the job would resume from: its state's, or (``write_on_notice=False``: a Ray Train
        script, whose state is what it reports) its newest reported one."""
        if self.pool.durable_checkpoint is not None or self.config.write_on_notice:
            return self.pool.durable_checkpoint
        return self.pool.reported_checkpoint

    def drain_view(self, members: list[WorkerRecord], now: float) -> DrainView | None:
        """The writes asked for since the ring's current leavers began leaving (None: nobody is leaving)."""
        since = [r.leaving_since for r in members if r.leaving and not r.dead and r.leaving_since is not None]
        if not since:
            return None
        return self.pool.persists.view(min(since), now, can_persist=self.config.checkpoint_uri is not None
                                      and self.config.write_on_notice, working=self._working)

    def _working(self, worker_id: str) -> bool:
        """A worker that took a write still works on it: alive and not returned."""
        record = self.pool.records.get(worker_id)
        return record is not None and not record.dead and not record.finished

    # ------------------------------------------------------------ the one place that acts
    def act(self, action: Action) -> bool:
        """Do what a state asked for. Returns whether that changed something a :class:`Context` shows."""
        records = self.pool.records
        match action:
            case AddEvent(kind, detail):
                self.events.add(kind, self.round_id, self.world_size, **detail)
                return False
            case PollDrains():
                return self.poll_drains()
            case KillSilent(members, failure_age_s):
                return self.kill_silent(self.members() if members else [], failure_age_s)
            case RequestCapacity():
                counted = [r for r in self.pool.live() if not r.leaving and r.node_id not in self.draining]
                wanted = decisions.workers_to_request(len(counted), self.config.max_workers)
                return self.pool.request(wanted) > 0  # (no new record: the Context would show nothing new)
            case Form(staying, joiners, reason, stop, handover, extra, persist, prompt):
                self.form([records[w] for w in staying], [records[w] for w in joiners], reason, stop, handover, extra,
                          persist, prompt)
            case Notify():
                self.pool.notify(self.members(), self.round_id, change=True, preemption=self._take_preemption())
                return False
            case RepeatNotices():
                self.pool.repeat_notices(self.members(), self.round_id)
                return False
            case RequestPersist(why, deadline_s, change, stop):
                persist_id = 0
                if why == "drain":  # numbered: its write's events say that this commit was saved
                    persist_id = self.pool.persists.ask(final=change, round_id=self.round_id, now=time.monotonic())
                self.pool.notify(self.members(), self.round_id, change=change, persist=True, stop=stop,
                                 persist_id=persist_id, within_s=deadline_s if why == "drain" else None,
                                 preemption=self._take_preemption())
                self.events.add("persist_requested", self.round_id, self.world_size, why=why, deadline_s=deadline_s,
                                **({"persist": persist_id, "final": change} if persist_id else {}))
            case AbortRound(why):
                self.pool.abort_round(self.members(), self.round_id, why)
                return False
            case StopWorkers(workers, why):
                for worker_id in workers:
                    self.pool.stop(records[worker_id], why)
            case StopWaiting(why):
                self.pool.stop_waiting(why)
            case ReportLost(workers):
                for r in (records[w] for w in workers):
                    self.lost_reported.add(r.worker_id)
                    self.events.add("worker_lost", self.round_id, self.world_size, worker=r.worker_id,
                                    node=r.node_id, cause=r.cause)
            case CountFailure():
                now = time.monotonic()
                self.failure_times = [t for t in self.failure_times if now - t <= self.limits.failure_window_s]
                self.failure_times.append(now)
            case DropRing():
                self.ring = None
            case DropRaised(workers):
                for r in (records[w] for w in workers):
                    self.dropped[r.worker_id] = UserError(r.worker_id, r.node_id, r.user_error)
                    lines = (r.user_error.remote_traceback or "").strip().splitlines()
                    self.pool.kill(r, f"fn raised on rank {r.user_error.rank}: {lines[-1] if lines else '?'} "
                                      "(worker_errors='replace': a failed worker, replaced)")
            case DiagnoseStart(ready):
                self.start_diagnosis = self.pool.diagnose_start(ready)
            case _:
                raise TypeError(f"the driver's loop has no action {action!r}")
        return True

    def poll_drains(self) -> bool:
        """Take the draining nodes the drain watcher reported (at once when they changed, else at most every
        DRAIN_POLL_S); mark the live workers there as leaving (``newly_draining``). A drain deadline is Ray's
        wall-clock time: it is turned into time left once, here, and kept on the driver's monotonic clock from then
        on. Returns whether what a Context shows changed."""
        before = (self.newly_draining, self.draining)
        self.newly_draining = ()
        if self.reported_drains is self.draining and time.monotonic() - self.last_drain_poll < DRAIN_POLL_S:
            return bool(before[0])
        now = self.last_drain_poll = time.monotonic()
        self.draining = self.reported_drains
        by_node: dict[str, list[WorkerRecord]] = {}  # the newly leaving, grouped in one pass
        if self.draining:
            for r in self.pool.live():
                if not r.leaving and r.node_id in self.draining:
                    by_node.setdefault(r.node_id, []).append(r)
        members = set(self.ring.worker_ids) if self.ring else set()
        newly: list[str] = []
        for node in sorted(by_node):
            on_node, deadline_ms = by_node[node], self.draining[node]
            for r in on_node:
                r.leaving, r.leaving_since = True, now
                r.leave_by = now + (deadline_ms / 1000 - time.time()) if deadline_ms else None
            newly += (r.worker_id for r in on_node)
            left = [x for x in (r.leave_in_s(now) for r in on_node) if x is not None]
            self.events.add("node_draining", self.round_id, self.world_size, node=node,
                            deadline_ms=deadline_ms, deadline_s=round(min(left), 1) if left else None,
                            workers=[r.worker_id for r in on_node if r.worker_id in members],
                            joiners=[r.worker_id for r in on_node if r.worker_id not in members])
        self.newly_draining = tuple(newly)
        self.tell_preemption()
        return bool(newly) or bool(before[0]) or self.draining != before[1]

    def tell_preemption(self) -> None:
        """Tell the ring's members which of its ranks are on draining nodes and the earliest deadline,
        when that changed: what ``get_preemption_info()`` answers in ``fn``. Sent at the end of the step
        (:meth:`advance`), or with a notice the step sends its members (a drain's: :meth:`_take_preemption`)."""
        notice = self.preemption.notice(self.ring, self.pool.records, self.draining)
        if notice is not None:
            self.preemption_due = notice

    def _take_preemption(self) -> dict | None:
        notice, self.preemption_due = self.preemption_due, None
        return notice

    def kill_silent(self, members: list[WorkerRecord], failure_age_s: float | None) -> bool:
        """Kill members the decisions condemn, and other workers silent past the heartbeat timeout (the same rule,
        :func:`decisions.kill_cause` of a worker outside any re-form). Silence is counted net of how far behind
        the driver reads its inbox (:class:`~ray_integration.wire.channel.InboxProbe`): a driver that falls behind
        does not take its own backlog for dead workers. A verdict from silence alone is confirmed first: not while
        the driver's inbox still holds unread messages, and only if the worker's actor does not answer through Ray
        either (a live one whose messages are lost is given a fresh grace and counted: twice in a row names
        tampering). Returns whether it changed any record."""
        now = time.monotonic()
        delay = self.inbox.delay_s(now)
        member_ids = {r.worker_id for r in members}
        ring_ids = set(self.ring.worker_ids) if self.ring else set()
        # Only workers silent past the shortest limit in force (or every member, once the stuck rule may apply)
        # can be condemned: one comparison each, a view and the decision only for those (most steps: none).
        silent_before = now - delay - decisions.silence_limit_s(self.limits, failure_age_s)
        every_member = decisions.stuck_rule_applies(self.limits, failure_age_s)
        verdicts: list[tuple[WorkerRecord, Kill]] = []
        for r in members:
            if every_member or r.beat_at is not None and r.beat_at < silent_before:
                kill = decisions.kill_cause(r.view(now, delay), self.limits, failure_age_s)
                if kill:
                    verdicts.append((r, kill))
        silent_before = now - delay - decisions.silence_limit_s(self.limits, None)
        for r in self.pool.live():  # joiners and starting workers: only the heartbeat rule
            if r.beat_at is not None and r.beat_at < silent_before and r.worker_id not in member_ids and \
                    r.worker_id not in ring_ids and r.info is not None:
                kill = decisions.kill_cause(r.view(now, delay), self.limits, None)
                if kill:
                    verdicts.append((r, kill))
        if any(kill.confirm for _, kill in verdicts):
            deferred = None if self.deferred_at is None else now - self.deferred_at
            if decisions.defer_for_backlog(self.pool.inbox_backlog(), deferred, self.limits):
                self.deferred_at = self.deferred_at or now
                verdicts = [(r, kill) for r, kill in verdicts if not kill.confirm]  # read what arrived first
            else:
                self.deferred_at = None
        if not verdicts:
            return False
        probed = [(r, kill, decisions.after_probe(self.pool.probe(r, now)) if kill.confirm else Verdict.KILL)
                  for r, kill in verdicts]
        silent = {r.worker_id for r, kill in verdicts if kill.confirm}
        heard = sum(1 for r in self.pool.live() if r.worker_id not in silent and r.heard_at is not None and
                    now - r.heard_at < self.limits.heartbeat_timeout_s / 2)
        # The live ones whose messages stopped, with those killed for it within two heartbeat timeouts: a cut that
        # reaches the driver's probes in batches is still one cut, not a broken connection each.
        self.broken_at = [t for t in self.broken_at if now - t < 2 * self.limits.heartbeat_timeout_s]
        unheard = sum(1 for _, _, verdict in probed if verdict is Verdict.UNHEARD) + len(self.broken_at)
        others_heard = decisions.others_heard(unheard, heard)
        changed = False
        for r, kill, verdict in probed:
            if verdict is Verdict.UNHEARD:
                r.unheard += 1
                verdict, message = decisions.unheard_verdict(r.worker_id, r.unheard, self.pool.forged(), others_heard)
                if verdict is Verdict.KILL:
                    kill = Kill(message)
                    self.broken_at.append(now)
                else:
                    r.beat_at, changed = now, True
                    self.events.add("messages_lost", self.round_id, self.world_size, worker=r.worker_id,
                                    times=r.unheard, forged=self.pool.forged())
                    self.tampering = self.tampering or message
            if verdict is Verdict.KILL:
                self.pool.kill(r, kill.cause)
                changed = True
        return changed

    def form(self, members: list[WorkerRecord], joiners: list[WorkerRecord], reason: str, stop: bool = False,
             handover: bool = False, extra: int = 0, persist: bool = False, prompt: bool = False) -> None:
        """Form the next round of ``members`` + ``joiners`` (at most max_workers, plus ``extra`` leaving
        holders in a handover round, which re-forms without them right after its sync); ``persist``: a round that
        writes the state (the drain's final write, numbered) right after its sync and re-forms; ``prompt``: some
        members were answered before they asked (:meth:`.pool.WorkerPool.expect`), said in ``ring_formed``."""
        chosen = (members + joiners)[: self.config.max_workers + extra]
        if prompt:
            for record in chosen:
                self.pool.expect(record, reason)
        self.round_id += 1
        persist_id = self.pool.persists.ask(final=True, round_id=self.round_id, now=time.monotonic()) if persist else 0
        within_s = None
        if persist:
            left = [x for x in (r.leave_in_s(time.monotonic()) for r in chosen) if x is not None]
            within_s = min(left) if left else None
        parent, self.prompted_at = self.ring, time.monotonic() if prompt else None
        self.ring = form_ring([Member(r.worker_id, r.node_id, r.joined_seq, r.has_state) for r in chosen], self.round_id)
        records = [self.pool.records[w] for w in self.ring.worker_ids]
        specs = ring_specs(self.ring, parent, self.config.nccl_reform == "shrink_grow",
                           [r.info.get("node_ip") if r.info else None for r in records],
                           store=er.StoreAddress(self.store_host, self.pool.store_port), backend=self.config.backend,
                           job_id=self.pool.keys.job, collective_timeout_s=self.config.collective_timeout_s,
                           connect_timeout_s=self.config.connect_timeout_s, nccl_reform=self.config.nccl_reform)
        for worker_id, record, spec in zip(self.ring.worker_ids, records, specs):
            was_member = record.in_ring
            self.pool.answer(record, spec, stop=stop, handover=handover, persist_id=persist_id, within_s=within_s)
            if not was_member and reason != "start":
                waited = None if record.ready_at is None else round(time.monotonic() - record.ready_at, 3)
                self.events.add("worker_joined", self.round_id, self.ring.world_size, worker=worker_id,
                                node=record.node_id, waited_s=waited)
        if self.stop_reason is not None and not stop:
            self.pool.notify(self.members(), self.round_id, stop=True, persist=True)
        self.events.add("ring_formed", self.round_id, self.ring.world_size, reason=reason, stop=stop, handover=handover,
                        ranks=list(self.ring.worker_ids), nodes=[n[:12] for n in self.ring.node_ids],
                        **({"persist": persist_id} if persist_id else {}),
                        **({"prompt": sum(1 for r in records if r.expected)} if prompt else {}))
        self.tell_preemption()

    # ------------------------------------------------------------ the loop
    def advance(self, state: DriverState) -> DriverState:
        """One step of ``state``: do each action it yields, showing it the Context as that action left it (built
        again only after an action that changed something a Context shows: building one costs O(records))."""
        ctx = self.context()
        steps = state.step(ctx)
        try:
            action = next(steps)
            while True:
                if self.act(action):
                    ctx = self.context()
                action = steps.send(ctx)
        except StopIteration as done:
            notice = self._take_preemption()
            if notice is not None:  # not carried by a notice of this step
                self.pool.tell_preemption(self.members(), notice)
            return done.value

    def run(self, on_tick: Callable[["Driver"], None] | None = None) -> DriverState:
        state: DriverState = Starting(since=time.monotonic())
        watcher = RayWatcher(self.pool, self.wakeups)
        watcher.start()
        drains = DrainWatcher(self.pool.draining_nodes, self.wakeups, DRAIN_POLL_S)
        drains.start()
        last = stepped = time.monotonic()
        relevant, step_s = True, 0.0
        try:
            while not state.terminal:
                due = stepped + pacing.step_gap_s(relevant, step_s, TICK_S)
                relevant = self._take_wakeups(max(0.0, due - time.monotonic())) or relevant
                now = time.monotonic()
                if decisions.driver_stalled(now - last, now - self.last_grace, self.limits):
                    self.last_grace = now
                    self.pool.grace(now)
                    self.events.add("driver_stalled", self.round_id, self.world_size, seconds=round(now - last, 2),
                                    note="every worker was given a fresh heartbeat grace")
                last = now
                self.inbox.tick(now)
                self.pool.inbox_delay_s = self.inbox.delay_s(now)
                if not pacing.step_due(relevant, now - stepped, TICK_S, step_s):
                    continue  # only heartbeats and reports (the state steps at the tick), or too soon after a step
                relevant, stepped = False, now
                self.newly_draining = ()
                state, previous = self.advance(state), state
                if state is not previous and not state.terminal:  # a new state steps at once: a loss's re-form
                    self.newly_draining = ()                      # aborts the round now, not at the next tick
                    state = self.advance(state)
                step_s = time.monotonic() - stepped  # (the step's O(members) work, not the caller's on_tick I/O)
                if on_tick is not None and not state.terminal:  # the caller checks the ended run itself
                    on_tick(self)
            return state
        finally:
            watcher.close()
            drains.close()

    def _take_wakeups(self, timeout_s: float) -> bool:
        """Block until a message, a Ray completion or ``timeout_s``; then apply everything that arrived. Returns
        whether any of it may change a decision (:func:`.pacing.wakes_states`; Ray completions and stop requests
        always do)."""
        try:
            items = [self.wakeups.get(timeout=timeout_s)] if timeout_s > 0 else [self.wakeups.get_nowait()]
        except queue.Empty:
            return False
        while True:
            try:
                items.append(self.wakeups.get_nowait())
            except queue.Empty:
                break
        relevant, now = False, time.monotonic()
        for kind, payload in items:
            if kind == "msg":
                if not self.inbox.arrived(payload, now):
                    relevant = self.pool.apply(payload) or relevant
            elif kind == "ray":
                self.pool.apply_ray(payload)
                relevant = True
            elif kind == "drains":  # (DrainWatcher: the draining nodes changed)
                self.reported_drains = payload
                relevant = True
            elif kind == "error":
                raise payload
            else:  # a stop or an abort (stopping.Stops)
                relevant = True
        return relevant
