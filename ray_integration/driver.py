"""The membership driver: an explicit state machine over the worker pool.

States (one small class each): :class:`Starting`, :class:`Running`,
:class:`Reforming`, and the terminal :class:`Finished`, :class:`Failed`,
:class:`Stopped`. Each ``step`` builds typed observations of the pool, asks the
pure decisions (:mod:`.decisions`, :mod:`.ring_formation`) what to do, tells
the pool to do it, and returns the next state. A stop (SIGTERM, or a second
one / Ctrl-C that abandons it) is one more input, handled in every state
together with losses and joins.

The loop wakes on every worker message and every Ray completion (no polling of
the store), and at least every :data:`TICK_S` for its timers.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

import elastic_ring as er

from . import decisions
from .config import TrainerConfig
from .decisions import Outcome, StartFailureKind, Step
from .events import EventLog
from .ring_formation import Member, Ring, form_ring
from .ray_watcher import RayWatcher
from .worker_pool import START_HINT, WorkerPool, WorkerRecord

#: Without max_workers ready, start once no new worker became ready for this long.
START_GRACE_S = 2.0
#: The driver's timers (silence, deadlines, drains) are looked at least this often.
TICK_S = 0.1
#: How often the driver asks Ray which nodes are draining (a GCS call).
DRAIN_POLL_S = 0.5
#: Joiners waiting this long without the ring reaching a commit get a warning event: fn must commit.
COMMIT_OVERDUE_S = 30.0


class RunFailed(RuntimeError):
    """The job ended without a result; the message says why and what to change."""


class DriverState:
    terminal = False

    def step(self, d: "Driver") -> "DriverState":
        raise NotImplementedError


@dataclass
class Finished(DriverState):
    value: Any
    terminal = True


@dataclass
class Failed(DriverState):
    error: BaseException
    terminal = True


@dataclass
class Stopped(DriverState):
    """Stopped on request (SIGTERM) after the last commit, or abandoned (``forced``)."""

    reason: str
    forced: bool = False
    note: str = ""
    terminal = True


def _fatal(d: "Driver") -> DriverState | None:
    """A user error, a worker that cannot start, or an abandoned stop ends the run in every state."""
    if d.abort_reason is not None:
        return Stopped(d.abort_reason, forced=True)
    for record in d.pool.records.values():
        if record.user_error is not None:
            d.events.add("failed", d.round_id, d.world_size, reason="user error", worker=record.worker_id,
                         rank=record.user_error.rank, node=record.node_id)
            return Failed(record.user_error)
    failures = d.pool.start_failures
    decisive = decisions.start_failure_verdict([r.start_kind for r in failures])
    if decisive is not None:
        record = failures[decisive]
        d.events.add("failed", d.round_id, d.world_size, reason="worker could not start", worker=record.worker_id)
        hint = f"\nHint: {START_HINT}" if record.start_kind is StartFailureKind.LOAD else ""
        times = "" if decisive == 0 else f" ({decisive + 1} workers failed to start)"
        return Failed(RunFailed(f"worker {record.worker_id} could not start or load fn{times}:\n{record.start_error}{hint}"))
    return None


class Starting(DriverState):
    def __init__(self) -> None:
        self.since = time.monotonic()
        self.last_ready_change = time.monotonic()
        self.ready_seen = 0

    def step(self, d: "Driver") -> DriverState:
        fatal = _fatal(d)
        if fatal:
            return fatal
        if d.stop_reason is not None:
            return Stopped(d.stop_reason, note="nothing had trained yet")
        d.pool.request(decisions.workers_to_request(len(d.pool.live()), d.config.max_workers))
        ready = d.joiners()
        if len(ready) != self.ready_seen:
            self.ready_seen, self.last_ready_change = len(ready), time.monotonic()
        if decisions.ready_to_start(len(ready), d.config.min_workers, d.config.max_workers,
                                    time.monotonic() - self.last_ready_change, START_GRACE_S):
            d.form([], ready, reason="start")
            return Running()
        if time.monotonic() - self.since > d.config.start_timeout_s:
            return Failed(RunFailed(d.start_diagnosis(len(ready))))
        return self


class Running(DriverState):
    def __init__(self, stop_sent: bool = False) -> None:
        self.change_requested = False
        self.change_requested_at = 0.0
        self.overdue_reported = False
        self.last_drain_poll = 0.0
        self.stop_sent = stop_sent

    def _watch_drains(self, d: "Driver", members: list[WorkerRecord]) -> None:
        if time.monotonic() - self.last_drain_poll < DRAIN_POLL_S:
            return
        self.last_drain_poll = time.monotonic()
        d.draining = d.pool.draining_nodes()
        newly = [r for r in members if r.node_id in d.draining and not r.leaving and not r.dead]
        if not newly:
            return
        for r in newly:
            r.leaving = True
        for node in {r.node_id for r in newly}:
            d.events.add("node_draining", d.round_id, d.world_size, node=node, deadline_ms=d.draining[node],
                         workers=[r.worker_id for r in newly if r.node_id == node])
        staying = len([r for r in members if not r.leaving and not r.dead]) + len(d.joiners())
        persist = decisions.persist_before_leaving(staying, d.config.min_workers)
        d.pool.notify(members, d.round_id, change=True, persist=persist)
        self.change_requested = True
        self.change_requested_at = time.monotonic()

    def step(self, d: "Driver") -> DriverState:
        fatal = _fatal(d)
        if fatal:
            return fatal
        members = d.members()
        d.kill_silent(members, failure_age_s=None)
        if d.stop_reason is not None and not self.stop_sent:
            self.stop_sent = True
            d.pool.notify(members, d.round_id, stop=True, persist=True)
        outcome = decisions.running_outcome([r.view(time.monotonic()) for r in members])
        if outcome is Outcome.FINISH:
            return d.finish(members)
        if outcome is not Outcome.CONTINUE:
            return Reforming(outcome.value)
        if d.stop_reason is not None:
            if decisions.stop_overdue(d.stop_age_s(), d.limits):
                return d.stop_overdue()
            return self
        self._watch_drains(d, members)
        if self.change_requested and not self.overdue_reported and \
                time.monotonic() - self.change_requested_at > COMMIT_OVERDUE_S:
            self.overdue_reported = True
            d.events.add("commit_overdue", d.round_id, d.world_size, waited_s=COMMIT_OVERDUE_S,
                         advice="workers wait to join, but the ring has not reached a state.commit(); call "
                                "state.commit() every few steps (joins, drains and stops happen only at commits)")
        joiners = d.joiners()
        if decisions.should_grow(len(members), len(joiners), d.config.max_workers, self.change_requested, False):
            self.change_requested = True
            self.change_requested_at = time.monotonic()
            d.events.add("membership_change_requested", d.round_id, d.world_size, joiners=[r.worker_id for r in joiners])
            d.pool.notify(members, d.round_id, change=True)
        d.pool.request(decisions.workers_to_request(len(d.pool.live()), d.config.max_workers))
        return self


class Reforming(DriverState):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.counted = False  # this failure counted against max_failures
        self.since = time.monotonic()

    def step(self, d: "Driver") -> DriverState:
        fatal = _fatal(d)
        if fatal:
            return fatal
        d.kill_silent(d.members(), failure_age_s=time.monotonic() - self.since)
        d.report_lost()
        if self.reason == "failure" and not self.counted:
            self.counted = True
            d.failures += 1
            message = decisions.give_up_after_failure(d.failures, d.config.max_failures)
            if message:
                return Failed(RunFailed(message))
        members = d.members()
        stopping = d.stop_reason is not None
        joiners = [] if stopping else d.joiners()
        decision = decisions.reform_decision([r.view(time.monotonic()) for r in members], len(joiners), stopping,
                                             d.ever_had_state(), time.monotonic() - self.since, d.limits)
        if decision.step is Step.WAIT:
            if stopping and decisions.stop_overdue(d.stop_age_s(), d.limits):
                return d.stop_overdue()
            if not stopping:
                d.pool.request(decisions.workers_to_request(len(d.pool.live()), d.config.max_workers))
            return self
        if decision.step is Step.FINISH:
            return d.finish(members)
        if decision.step is Step.FAIL:
            return Failed(RunFailed(decision.message))
        if decision.step is Step.STOPPED:
            d.pool.stop_waiting("the job stopped")
            return Stopped(d.stop_reason or "stop", note=decision.message)
        staying = [r for r in members if not r.dead and not r.leaving and not r.finished]
        for r in members:
            if r.leaving and not r.dead:
                d.pool.stop(r, "its node drains; it left the ring at the last commit")
        stop = decision.step is Step.FORM_STOP
        if stop:
            for r in d.joiners():
                d.pool.stop(r, "the job stops")
        d.form(staying, joiners, reason=self.reason, stop=stop)
        if self.reason == "failure":
            d.events.add("recovered", d.round_id, d.world_size, seconds=round(time.monotonic() - self.since, 4))
        else:
            d.events.add("resized", d.round_id, d.world_size, seconds=round(time.monotonic() - self.since, 4))
        return Running(stop_sent=stop)


class Driver:
    def __init__(self, config: TrainerConfig, pool: WorkerPool, store_host: str, events: EventLog,
                 wakeups: "queue.Queue[tuple[str, Any]]") -> None:
        self.config, self.pool, self.store_host, self.events = config, pool, store_host, events
        self.limits = config.limits
        self.wakeups = wakeups
        self.round_id = 0
        self.ring: Ring | None = None
        self.failures = 0
        self.lost_reported: set[str] = set()
        self.draining: dict[str, int] = {}  # node id hex -> deadline ms, as of the last poll
        self.stop_reason: str | None = None   # set (e.g. by a SIGTERM handler): stop at the next commit
        self.stop_requested_at: float | None = None
        self.abort_reason: str | None = None  # set by a second SIGTERM or the like: abandon the stop now

    # ------------------------------------------------------------ inputs (safe from a signal handler)
    def request_stop(self, reason: str) -> None:
        """Stop at the next commit, written durably."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_requested_at = reason, time.monotonic()

    def abort(self, reason: str) -> None:
        """Abandon everything now (the workers are killed)."""
        self.abort_reason = reason

    def stop_age_s(self) -> float | None:
        return None if self.stop_requested_at is None else time.monotonic() - self.stop_requested_at

    def stop_overdue(self) -> DriverState:
        return Stopped(self.stop_reason or "stop", forced=True,
                       note=f"the workers did not reach a commit within stop_timeout_s={self.config.stop_timeout_s}")

    # ------------------------------------------------------------ observations
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

    def ever_had_state(self) -> bool:
        return any(r.has_state for r in self.pool.records.values())

    def kill_silent(self, members: list[WorkerRecord], failure_age_s: float | None) -> None:
        now = time.monotonic()
        for r in members:
            cause = decisions.kill_cause(r.view(now), self.limits, failure_age_s)
            if cause:
                self.pool.kill(r, cause)
        for r in self.pool.live():  # joiners and starting workers: only the heartbeat rule
            if r.worker_id not in (self.ring.worker_ids if self.ring else ()):
                silent = r.silent_s(now)
                if r.info is not None and silent is not None and silent > self.limits.heartbeat_timeout_s:
                    self.pool.kill(r, f"no heartbeat for {silent:.1f} s (heartbeat_timeout_s="
                                      f"{self.limits.heartbeat_timeout_s})")

    def report_lost(self) -> bool:
        """Record an event for each member newly found dead; True if there was any."""
        lost = [r for r in self.members() if r.dead and r.worker_id not in self.lost_reported]
        for r in lost:
            self.lost_reported.add(r.worker_id)
            self.events.add("worker_lost", self.round_id, self.world_size, worker=r.worker_id, node=r.node_id, cause=r.cause)
        return bool(lost)

    def resource_text(self) -> str:
        parts = [f"CPU={self.config.cpus_per_worker}"]
        if self.config.worker_gpus:
            parts.append(f"GPU={self.config.worker_gpus}")
        parts += [f"{k}={v}" for k, v in self.config.resources_per_worker.items()]
        return ", ".join(parts)

    def start_diagnosis(self, ready: int) -> str:
        """Why fewer than min_workers started: missing resources (which), or workers that did not get ready."""
        pending = [r for r in self.pool.live() if r.info is None]
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

    # ------------------------------------------------------------ actions
    def form(self, members: list[WorkerRecord], joiners: list[WorkerRecord], reason: str, stop: bool = False) -> None:
        chosen = (members + joiners)[: self.config.max_workers]
        self.round_id += 1
        self.ring = form_ring([Member(r.worker_id, r.node_id, r.joined_seq, r.has_state) for r in chosen], self.round_id)
        store = er.StoreAddress(self.store_host, self.pool.store_port)
        for rank, worker_id in enumerate(self.ring.worker_ids):
            record = self.pool.records[worker_id]
            spec = er.RingSpec(round_id=self.round_id, rank=rank, world_size=self.ring.world_size,
                               node_ids=self.ring.node_ids, store=store, backend=self.config.backend,
                               job_id=self.pool.keys.job, collective_timeout_s=self.config.collective_timeout_s,
                               connect_timeout_s=self.config.connect_timeout_s,
                               bind_host=record.info.get("node_ip") if record.info else None)
            was_member = record.in_ring
            self.pool.answer(record, spec, stop=stop)
            if not was_member and reason != "start":
                self.events.add("worker_joined", self.round_id, self.ring.world_size, worker=worker_id, node=record.node_id)
        if self.stop_reason is not None and not stop:
            self.pool.notify(self.members(), self.round_id, stop=True, persist=True)
        self.events.add("ring_formed", self.round_id, self.ring.world_size, reason=reason, stop=stop,
                        ranks=list(self.ring.worker_ids), nodes=[n[:12] for n in self.ring.node_ids])

    def finish(self, members: list[WorkerRecord]) -> DriverState:
        """fn returned on some members; the value is the lowest finished rank's (rank 0's unless it was lost)."""
        done = [r for r in members if r.finished and not r.dead]
        for r in members:
            if r.waiting:
                self.pool.stop(r, "the job finished")
        lost = [r.worker_id for r in members if r.dead]
        if lost:
            self.events.add("finished_with_losses", self.round_id, self.world_size, lost=lost,
                            value_from=done[0].worker_id)
        if self.stop_reason is not None and all(r.value is None for r in done):
            return Stopped(self.stop_reason)
        return Finished(done[0].value)

    # ------------------------------------------------------------ the loop
    def run(self, on_tick: Callable[["Driver"], None] | None = None) -> DriverState:
        state: DriverState = Starting()
        watcher = RayWatcher(self.pool, self.wakeups)
        watcher.start()
        try:
            while not state.terminal:
                self._take_wakeups()
                state = state.step(self)
                if on_tick is not None:
                    on_tick(self)
            return state
        finally:
            watcher.close()

    def _take_wakeups(self) -> None:
        """Block until a message, a Ray completion or the tick; then apply everything that arrived."""
        try:
            items = [self.wakeups.get(timeout=TICK_S)]
        except queue.Empty:
            return
        while True:
            try:
                items.append(self.wakeups.get_nowait())
            except queue.Empty:
                break
        for kind, payload in items:
            if kind == "msg":
                self.pool.apply(payload)
            elif kind == "ray":
                self.pool.apply_ray(payload)
            elif kind == "error":
                raise payload
