"""The driver's states: one small class each, :class:`Starting`, :class:`Running`, :class:`Reforming`,
and the terminal :class:`Finished`, :class:`Failed`, :class:`Stopped`.

Each ``step`` builds typed observations of the pool, asks the pure decisions
(:mod:`.decisions`) what to do, tells the driver (:mod:`.driver`) to do it, and
returns the next state. A stop (SIGTERM, ``trainer.stop()``, or a second one
that abandons it) is one more input, handled in every state together with
losses, drains and joins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_ring import shadowing

from . import decisions
from .decisions import Outcome, StartFailureKind, Step
from .worker_pool import START_HINT

if TYPE_CHECKING:
    from .driver import Driver

#: Without max_workers ready, start once no new worker became ready for this long.
START_GRACE_S = 2.0
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
    """Stopped on request (SIGTERM, ``stop()``) after the last commit, or abandoned (``forced``)."""

    reason: str
    forced: bool = False
    note: str = ""
    terminal = True


def _fatal(d: "Driver") -> DriverState | None:
    """A user error, a worker that cannot start, tampering, or an abandoned stop ends the run in every state."""
    if d.abort_reason is not None:
        return Stopped(d.abort_reason, forced=True)
    if d.tampering is not None:
        d.events.add("failed", d.round_id, d.world_size, reason="messages lost or forged")
        return Failed(RunFailed(d.tampering))
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
        hint = f"\nHint: {START_HINT}" if record.start_kind is StartFailureKind.LOAD and \
            not _names_its_fix(record.start_error) else ""
        times = "" if decisive == 0 else f" ({decisive + 1} workers failed to start)"
        return Failed(RunFailed(f"worker {record.worker_id} could not start or load fn{times}:\n{record.start_error}{hint}"))
    return None


def _names_its_fix(error: str | None) -> bool:
    """The start error already says what to do (e.g. a user's file shadows one of our packages)."""
    return error is not None and shadowing.MARKER in error


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
            d.pool.stop_waiting("the job stopped before it trained")
            return Stopped(d.stop_reason, note="nothing had trained yet")
        early = [r for r in d.pool.records.values() if r.finished and not r.in_ring and r.user_error is None]
        if early:  # its fn returned without ever joining the ring: no ring can ever start with it
            d.events.add("failed", d.round_id, d.world_size, reason="fn returned before joining the ring",
                         worker=early[0].worker_id)
            return Failed(RunFailed(
                f"fn returned on worker {early[0].worker_id} before it joined the job's ring (it made no er.* call "
                "and no collective), so the job can never start: ElasticTrainer runs fn as one worker of an elastic "
                "ring; train inside @er.elastic.run (or call er.rank() first), or run a function that needs no ring "
                "with Ray directly"))
        d.poll_drains()
        d.kill_silent([], failure_age_s=None)
        d.request_capacity()
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
        self.stop_sent = stop_sent

    def _notify_drains(self, d: "Driver", members: list) -> None:
        """Members whose node began draining leave at the next commit, written durably when the ring left
        behind would be too small or would hold no state (the leavers then hand it over first)."""
        newly = [r for r in d.poll_drains() if r in members]
        if not newly:
            return
        staying = [r for r in members if not r.leaving and not r.dead]
        persist = decisions.persist_before_leaving(len(staying) + len(d.joiners()), d.config.min_workers,
                                                   sum(1 for r in staying if r.has_state))
        d.pool.notify(members, d.round_id, change=True, persist=persist)
        if persist:
            d.drain_persist_at = time.monotonic()
            d.events.add("persist_requested", d.round_id, d.world_size, why="drain",
                         deadline_s=d.drain_deadline_s(newly))
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
            d.events.add("persist_requested", d.round_id, d.world_size, why="stop",
                         deadline_s=d.config.stop_timeout_s)
        outcome = decisions.running_outcome([d.view(r) for r in members])
        if outcome is Outcome.FINISH:
            return d.finish(members)
        if outcome is not Outcome.CONTINUE:
            return Reforming(outcome.value)
        if d.stop_reason is not None:
            if decisions.stop_overdue(d.stop_age_s(), d.limits):
                return d.stop_overdue()
            return self
        self._notify_drains(d, members)
        if self.change_requested and not self.overdue_reported and \
                time.monotonic() - self.change_requested_at > COMMIT_OVERDUE_S:
            self.overdue_reported = True
            d.events.add("commit_overdue", d.round_id, d.world_size, waited_s=COMMIT_OVERDUE_S,
                         advice="workers wait to join, but the ring has reached neither a step boundary nor a "
                                "state.commit(); hold one DistributedOptimizer and one ElasticSampler in the state "
                                "(joins, drains and stops then happen at the next step), or call state.commit() "
                                "every few steps")
        joiners = d.joiners()
        if decisions.should_grow(len(members), len(joiners), d.config.max_workers, self.change_requested, False):
            self.change_requested = True
            self.change_requested_at = time.monotonic()
            d.events.add("membership_change_requested", d.round_id, d.world_size, joiners=[r.worker_id for r in joiners])
            d.pool.notify(members, d.round_id, change=True)
        d.request_capacity()
        return self


class Reforming(DriverState):
    def __init__(self, reason: str, counted: bool = False) -> None:
        self.reason = reason
        self.counted = counted  # this failure counted against max_failures
        self.aborted = False    # the survivors were told to abandon the failed round
        self.since = time.monotonic()

    def step(self, d: "Driver") -> DriverState:
        fatal = _fatal(d)
        if fatal:
            return fatal
        if self.reason == "failure" and not self.aborted:
            self.aborted = True  # a peer frozen or dead: nobody waits on it in a collective or a formation
            d.pool.abort_round(d.members(), d.round_id, "the driver declared a member of this round lost")
        d.poll_drains()
        # Only a failure makes a member that stays away suspect; at a membership change, a member still away
        # is writing the commit the driver asked for (a drain or a stop), which has its own deadline.
        d.kill_silent(d.members(), failure_age_s=time.monotonic() - self.since if self.reason == "failure" else None)
        lost = d.report_lost()
        if (self.reason == "failure" or lost) and not self.counted:  # a death at a membership change counts too
            self.counted = True
            message = d.count_failure()
            if message:
                return Failed(RunFailed(message))
        members = d.members()
        stopping = d.stop_reason is not None
        joiners = [] if stopping else d.joiners()
        decision = decisions.reform_decision([d.view(r) for r in members], len(joiners), stopping,
                                             d.ever_had_state(), time.monotonic() - self.since, d.limits,
                                             checkpoint=d.pool.durable_checkpoint is not None,
                                             drain_saved=d.drain_persist_at is not None and
                                             d.pool.durable_at > d.drain_persist_at)
        if decision.step is Step.WAIT:
            if stopping and decisions.stop_overdue(d.stop_age_s(), d.limits):
                return d.stop_overdue()
            if not stopping:
                d.request_capacity()
            return self
        if decision.step is Step.FINISH:
            return d.finish(members)
        if decision.step is Step.FAIL:
            return Failed(RunFailed(decision.message))
        if decision.step is Step.STOPPED:
            d.pool.stop_waiting("the job stopped")
            return Stopped(d.stop_reason or "stop", note=decision.message)
        if decision.step is Step.RELEASE:
            for r in members:
                if r.leaving and not r.dead:
                    d.pool.stop(r, "its node drains; its state is in the drain commit's checkpoint")
            d.events.add("drain_released", d.round_id, d.world_size, reason=decision.message,
                         checkpoint=d.pool.durable_checkpoint)
            d.ring = None  # no member is left: the next ring is formed of whoever comes, from the checkpoint
            return Reforming(self.reason, counted=True)  # the capacity wait starts now
        return self._form(d, members, joiners, decision)

    def _form(self, d: "Driver", members: list, joiners: list, decision: decisions.ReformDecision) -> DriverState:
        staying = [r for r in members if not r.dead and not r.leaving and not r.finished]
        keepers = [r for r in members if not r.dead and r.leaving and not r.finished and r.has_state]
        stop = decision.step is Step.FORM_STOP
        handover = decision.step is Step.HANDOVER
        if stop and not any(r.has_state for r in staying):
            staying = keepers + staying   # only leavers hold the state: they commit durably and stop
        elif handover:
            staying = keepers + staying   # they sync the state to the others, then the ring re-forms without them
        for r in members:
            if r.leaving and not r.dead and r not in staying:
                d.pool.stop(r, "its node drains; it left the ring at the last commit")
        if stop:
            for r in d.joiners():
                d.pool.stop(r, "the job stops")
        if decision.message:
            d.events.add("resuming_from_checkpoint", d.round_id, d.world_size, uri=d.pool.durable_checkpoint)
        d.form(staying, joiners, reason=self.reason, stop=stop, handover=handover, extra=len(keepers) if handover else 0)
        kind = "handover" if handover else "recovered" if self.reason == "failure" else "resized"
        d.events.add(kind, d.round_id, d.world_size, seconds=round(time.monotonic() - self.since, 4))
        return Running(stop_sent=stop)
