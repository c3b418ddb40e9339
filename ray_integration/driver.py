"""The membership driver: an explicit state machine over the worker pool.

States (one small class each): :class:`Starting`, :class:`Running`,
:class:`Reforming`, :class:`Finished`, :class:`Failed`. Each ``step`` looks at
the pool's records, asks the pure policies (:mod:`.policies`,
:mod:`.ring_formation`) what to do, tells the pool to do it, and returns the
next state. The driver hosts the rendezvous store and hands every member of a
new round its ``RingSpec`` (a new round id; keys prefixed with job and round).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import elastic_ring as er

from . import policies
from .config import TrainerConfig
from .events import EventLog
from .ring_formation import Member, Ring, form_ring
from .worker_pool import WorkerPool, WorkerRecord

#: Without max_workers ready, start once no new worker became ready for this long.
START_GRACE_S = 2.0
#: How often the driver looks at the world.
TICK_S = 0.002
#: How often the driver asks Ray which nodes are draining (a GCS call).
DRAIN_POLL_S = 0.5
#: While re-forming after a failure that peers reported, a member that neither asks for a
#: ring nor heartbeats for this many heartbeat intervals is presumed dead (a lost node
#: can take Ray many seconds to declare), without waiting for heartbeat_timeout_s.
SUSPECT_AFTER_INTERVALS = 3
#: A member that heartbeats but has not reached the rendezvous this long after collective_timeout_s
#: (counted from its peers' failure) is stuck in user code, and is killed with that cause.
HUNG_GRACE_S = 2.0
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
    """Stopped on request (SIGTERM) after every member's last commit."""

    reason: str
    terminal = True


def _user_error(d: "Driver") -> DriverState | None:
    for record in d.pool.records.values():
        if record.user_error is not None:
            d.events.add("failed", d.round_id, d.world_size, reason="user error", worker=record.worker_id,
                         rank=record.user_error.rank, node=record.node_id)
            return Failed(record.user_error)
    return None


class Starting(DriverState):
    def __init__(self) -> None:
        self.since = time.monotonic()
        self.last_ready_change = time.monotonic()
        self.ready_seen = 0

    def step(self, d: "Driver") -> DriverState:
        if d.stop_reason is not None:
            return Stopped(d.stop_reason)  # nothing trained yet: nothing to save
        d.pool.request(policies.workers_to_request(len(d.pool.live()), d.config.max_workers))
        failed = _user_error(d)
        if failed:
            return failed
        ready = d.joiners()
        if len(ready) != self.ready_seen:
            self.ready_seen, self.last_ready_change = len(ready), time.monotonic()
        started = [r for r in d.pool.live() if r.info is not None]
        if policies.ready_to_start(len(ready), len(started), d.config.min_workers, d.config.max_workers,
                                   time.monotonic() - self.last_ready_change, START_GRACE_S):
            d.form([], ready, reason="start")
            return Running()
        if time.monotonic() - self.since > d.config.start_timeout_s:
            return Failed(RunFailed(
                f"only {len(ready)} of min_workers={d.config.min_workers} workers started within start_timeout_s="
                f"{d.config.start_timeout_s}: the cluster lacks the resources ({d.resource_text()} per worker), "
                "or workers fail at start; lower min_workers, add nodes, or raise start_timeout_s"))
        return self


class Running(DriverState):
    def __init__(self) -> None:
        self.change_requested = False
        self.change_requested_at = 0.0
        self.overdue_reported = False
        self.last_drain_poll = 0.0
        self.stop_sent_at: float | None = None

    def _handle_stop(self, d: "Driver", members: list[WorkerRecord]) -> DriverState | None:
        """Ask every member to stop at its next commit (written durably), then wait for them."""
        if d.stop_reason is None:
            return None
        if self.stop_sent_at is None:
            self.stop_sent_at = time.monotonic()
            d.events.add("stop_requested", d.round_id, d.world_size, reason=d.stop_reason)
            for r in members:
                if not r.dead:
                    r.actor.request_stop.remote()
        alive = [r for r in members if not r.dead]
        if all(r.finished for r in alive):
            return Stopped(d.stop_reason)
        if time.monotonic() - self.stop_sent_at > d.config.elastic_timeout_s:
            return Failed(RunFailed(f"{d.stop_reason}: the workers did not reach a commit within elastic_timeout_s="
                                    f"{d.config.elastic_timeout_s}; work since the last durable checkpoint is lost"))
        return self

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
        persist = policies.persist_before_leaving(staying, d.config.min_workers)
        d.pool.notify_membership_change([r for r in members if not r.dead], persist=persist)
        self.change_requested = True
        self.change_requested_at = time.monotonic()

    def step(self, d: "Driver") -> DriverState:
        failed = _user_error(d)
        if failed:
            return failed
        members = d.members()
        stopping = self._handle_stop(d, members)
        if stopping is not None:
            return stopping
        if members and all(r.finished for r in members):
            return Finished(d.rank0_value())
        self._watch_drains(d, members)
        if d.report_lost() or any(r.waiting and r.reason == "failure" for r in members):
            return Reforming("failure")
        if any(r.waiting and r.reason == "membership" for r in members):
            return Reforming("membership")
        if self.change_requested and not self.overdue_reported and \
                time.monotonic() - self.change_requested_at > COMMIT_OVERDUE_S:
            self.overdue_reported = True
            d.events.add("commit_overdue", d.round_id, d.world_size, waited_s=COMMIT_OVERDUE_S,
                         advice="workers wait to join, but the ring has not reached a state.commit(); call "
                                "state.commit() every few steps (joins, drains and stops happen only at commits)")
        if policies.should_grow(len(members), len(d.joiners()), d.config.max_workers, self.change_requested):
            self.change_requested = True
            self.change_requested_at = time.monotonic()
            d.events.add("membership_change_requested", d.round_id, d.world_size, joiners=[r.worker_id for r in d.joiners()])
            d.pool.notify_membership_change(members)
        d.pool.request(policies.workers_to_request(len(d.pool.live()), d.config.max_workers))
        return self


class Reforming(DriverState):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.counted = False  # this failure counted against max_failures
        self.since = time.monotonic()
        self.detected_at = time.time()

    def step(self, d: "Driver") -> DriverState:
        failed = _user_error(d)
        if failed:
            return failed
        members = [r for r in d.members() if not r.dead]
        if self.reason == "failure":
            for r in members:
                if not r.waiting and r.silent_s > SUSPECT_AFTER_INTERVALS * d.pool.heartbeat_interval_s:
                    d.pool.kill(r, f"silent for {r.silent_s:.1f} s while its peers reported a failure")
                elif not r.waiting and time.monotonic() - self.since > d.config.collective_timeout_s + HUNG_GRACE_S:
                    d.pool.kill(r, f"stuck in user code: its heartbeats arrive, but it did not reach the rendezvous "
                                   f"within collective_timeout_s={d.config.collective_timeout_s} s + {HUNG_GRACE_S} s "
                                   "after its peers' collective failed (a hang or deadlock in fn, or a collective "
                                   "called on only some ranks)")
        d.report_lost()
        alive = [r for r in d.members() if not r.dead]
        members = [r for r in alive if not r.leaving]
        leaving = [r for r in alive if r.leaving]
        # everyone staying must reach the rendezvous; everyone leaving must have committed and be told to go
        if not all(r.waiting for r in members) or not all(r.waiting or r.finished for r in leaving):
            return self  # (heartbeats catch the hung)
        for r in leaving:
            d.pool.stop(r)  # its node drains: it leaves now, with the state committed
        if self.reason == "failure" and not self.counted:
            self.counted = True
            d.failures += 1
            decision = policies.after_failure(d.failures, d.config.max_failures)
            if decision.give_up:
                return Failed(RunFailed(decision.message))
        if members and not any(r.has_state for r in members) and any(r.has_state for r in d.pool.records.values()):
            return Failed(RunFailed(
                "every worker that held the job's committed state was lost at once (the rest had just joined "
                "and not yet received it); nothing in memory can be rolled back to. With checkpoint_uri set, "
                "run the same script again to resume from the newest checkpoint"))
        joiners = d.joiners()
        if len(members) + len(joiners) < d.config.min_workers:
            d.pool.request(policies.workers_to_request(len(d.pool.live()), d.config.max_workers))
            if time.monotonic() - self.since > d.config.elastic_timeout_s:
                return Failed(RunFailed(
                    f"only {len(members) + len(joiners)} workers left, below min_workers={d.config.min_workers}, and "
                    f"no capacity came within elastic_timeout_s={d.config.elastic_timeout_s}; add nodes, lower "
                    "min_workers, or raise elastic_timeout_s"))
            return self
        d.form(members, joiners, reason=self.reason)
        d.events.add("recovered" if self.reason == "failure" else "resized", d.round_id, d.world_size,
                     seconds=round(time.time() - self.detected_at, 4))
        return Running()


class Driver:
    def __init__(self, config: TrainerConfig, pool: WorkerPool, store_host: str, events: EventLog) -> None:
        self.config, self.pool, self.store_host, self.events = config, pool, store_host, events
        self.round_id = 0
        self.ring: Ring | None = None
        self.failures = 0
        self.lost_reported: set[str] = set()
        self.draining: dict[str, int] = {}  # node id hex -> deadline ms, as of the last poll
        self.stop_reason: str | None = None   # set (e.g. by a SIGTERM handler) to stop at the next commit

    def request_stop(self, reason: str) -> None:
        """Stop at the next commit, written durably (safe to call from a signal handler)."""
        self.stop_reason = reason

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

    def form(self, members: list[WorkerRecord], joiners: list[WorkerRecord], reason: str) -> None:
        chosen = (members + joiners)[: self.config.max_workers]
        self.round_id += 1
        self.ring = form_ring([Member(r.worker_id, r.node_id, r.joined_seq, r.has_state) for r in chosen], self.round_id)
        store = er.StoreAddress(self.store_host, self.pool.store.port)
        for rank, worker_id in enumerate(self.ring.worker_ids):
            record = self.pool.records[worker_id]
            spec = er.RingSpec(round_id=self.round_id, rank=rank, world_size=self.ring.world_size,
                               node_ids=self.ring.node_ids, store=store, backend=self.config.backend,
                               job_id=self.pool.keys.job, collective_timeout_s=self.config.collective_timeout_s,
                               connect_timeout_s=self.config.elastic_timeout_s,
                               bind_host=record.info.get("node_ip") if record.info else None)
            was_member = record.in_ring
            self.pool.answer(record, spec)
            if not was_member and reason != "start":
                self.events.add("worker_joined", self.round_id, self.ring.world_size, worker=worker_id, node=record.node_id)
        self.events.add("ring_formed", self.round_id, self.ring.world_size, reason=reason,
                        ranks=list(self.ring.worker_ids), nodes=[n[:12] for n in self.ring.node_ids])

    def rank0_value(self) -> Any:
        return self.pool.records[self.ring.worker_ids[0]].value

    def run(self, on_tick=None) -> DriverState:
        state: DriverState = Starting()
        while not state.terminal:
            self.pool.poll()
            state = state.step(self)
            if on_tick is not None:
                on_tick(self)
            time.sleep(TICK_S)
        return state
