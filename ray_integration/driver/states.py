"""The driver's states: one small class each, :class:`Starting`, :class:`Running`, :class:`Reforming`,
and the terminal :class:`Finished`, :class:`Failed`, :class:`Stopped`.

A state decides; it never acts. Its ``step`` reads a :class:`~.context.Context`,
asks the pure decisions (:mod:`.decisions`), and yields the actions of
:mod:`.context` one at a time; the loop (:mod:`.loop`) does each and sends back
the Context as that action left it (``ctx = yield action``). The step's return value is the next
state. A stop (SIGTERM, ``trainer.stop()``, or a second one that abandons it) is
one more input, handled in every state together with losses, drains and joins.
This module imports neither the loop nor the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

from elastic_ring import shadowing

from ..errors import RunFailed, WorkerError
from . import decisions
from .drains import DrainStep, DrainView, drain_step
from .context import (
    AbortRound, Action, Context, CountFailure, DiagnoseStart, DropRaised, DropRing, Form, KillSilent, Notify,
    PollDrains, RepeatNotices, ReportLost, RequestCapacity, RequestPersist, StopWaiting, StopWorkers, event,
)
from .pacing import notice_repeat_due
from .decisions import STUCK_GRACE_S, ErrorStep, MemberView, Outcome, StartFailureKind, Step

#: Without max_workers ready, start once no new worker became ready for this long.
START_GRACE_S = 2.0
#: Joiners waiting this long without the ring reaching a commit get a warning event: fn must commit.
COMMIT_OVERDUE_S = 30.0

START_HINT = ("if the module that defines fn (or something it imports) is missing on the workers, ship it with "
              "ElasticTrainer(runtime_env={'working_dir': '.'}) or runtime_env={'py_modules': [...]}, or define fn "
              "in the driver script")

#: A state's step: yields actions, receives the Context after each, returns the next state.
Steps = Generator[Action, Context, "DriverState"]


class DriverState:
    terminal = False

    def step(self, ctx: Context) -> Steps:
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


def _fatal(ctx: Context) -> Generator[Action, Context, DriverState | None]:
    """A user error, a worker that cannot start, tampering, or an abandoned stop ends the run in every state. With
    ``worker_errors="replace"`` a member whose fn raised is dropped instead (a lost worker, replaced), unless
    every member of the ring failed (:func:`decisions.worker_error_decision`)."""
    if ctx.abort_reason is not None:
        return Stopped(ctx.abort_reason, forced=True)
    if ctx.tampering is not None:
        yield event("failed", reason="messages lost or forged")
        return Failed(RunFailed(ctx.tampering))
    raised = ctx.raised or ((ctx.user_error,) if ctx.user_error is not None else ())
    decision = decisions.worker_error_decision(ctx.limits.worker_errors, [e.worker_id for e in raised],
                                               list(ctx.members), frozenset(ctx.dropped))
    if decision.step is ErrorStep.DROP:  # Horovod's elastic mode: failed workers, replaced; the others go on
        yield DropRaised(decision.workers)
    elif decision.step is ErrorStep.FAIL:
        failed = next((e for e in raised if e.worker_id == decision.worker), None) or ctx.dropped[decision.worker]
        yield event("failed", reason="every worker of the ring failed" if decision.all_failed else "user error",
                    worker=failed.worker_id, rank=failed.error.rank, node=failed.node_id)
        return Failed(_every_worker_failed(failed.error, len(ctx.members)) if decision.all_failed else failed.error)
    decisive = decisions.start_failure_verdict([f.kind for f in ctx.start_failures])
    if decisive is not None:
        failure = ctx.start_failures[decisive]
        yield event("failed", reason="worker could not start", worker=failure.worker_id)
        hint = f"\nHint: {START_HINT}" if failure.kind is StartFailureKind.LOAD and \
            not _names_its_fix(failure.error) else ""
        times = "" if decisive == 0 else f" ({decisive + 1} workers failed to start)"
        return Failed(RunFailed(f"worker {failure.worker_id} could not start or load fn{times}:\n{failure.error}{hint}"))
    return None


def _every_worker_failed(error: WorkerError, members: int) -> WorkerError:
    """The error that ends a run whose every member failed (``worker_errors="replace"``): the first's, saying so."""
    return WorkerError(error.worker_id, error.rank, error.node_id, error.hostname, error.remote_traceback,
                       f"every worker of the ring failed ({members} of {members}: each raised or was lost, "
                       f"worker_errors='replace'); the first error: {error.what}", error.cause)


def _last_raised(ctx: Context) -> str:
    """The newest error of a worker dropped because its fn raised (``worker_errors="replace"``), for a message."""
    if not ctx.dropped:
        return ""
    error = list(ctx.dropped.values())[-1].error
    lines = (error.remote_traceback or "").strip().splitlines()
    return f"; the last worker lost to an error: fn raised on rank {error.rank}: {lines[-1] if lines else '?'}"


def _names_its_fix(error: str | None) -> bool:
    """The start error already says what to do (e.g. a user's file shadows one of our packages)."""
    return error is not None and shadowing.MARKER in error


def _stop_overdue(ctx: Context) -> DriverState:
    return Stopped(ctx.stop_reason or "stop", forced=True,
                   note=f"the workers did not reach a commit within stop_timeout_s={ctx.limits.stop_timeout_s}")


def _finish(ctx: Context) -> Steps:
    """fn returned on some members; the value is the lowest finished rank's (rank 0's unless it was lost)."""
    done = sorted((m for m in ctx.members if m.finished and not m.dead), key=lambda m: m.leaving)  # stayers first
    waiting = tuple(m.worker_id for m in ctx.members if m.waiting is not None)
    if waiting:
        yield StopWorkers(waiting, "the job finished")
    lost = [m.worker_id for m in ctx.members if m.dead]
    if lost:
        yield event("finished_with_losses", lost=lost, value_from=done[0].worker_id)
    if ctx.stop_reason is not None and all(ctx.results.get(m.worker_id) is None for m in done):
        return Stopped(ctx.stop_reason)
    return Finished(ctx.results.get(done[0].worker_id))


def _drain_deadline_s(members: list[MemberView] | tuple[MemberView, ...]) -> float | None:
    """Seconds left before the earliest drain deadline of ``members`` (None: none known)."""
    left = [m.leave_in_s for m in members if m.leave_in_s is not None]
    return round(min(left), 1) if left else None


def _needs_persist(ctx: Context) -> bool:
    """The ring's leavers must leave the state in storage: the ring left behind would be too small, or would hold
    none of it (:func:`decisions.persist_before_leaving`)."""
    staying = [m for m in ctx.members if not m.leaving and not m.dead]
    return decisions.persist_before_leaving(len(staying) + len(ctx.joiners), ctx.limits.min_workers,
                                            sum(1 for m in staying if m.has_state))


class Starting(DriverState):
    def __init__(self, since: float | None = None) -> None:
        self.since = since  # when the run started (driver clock; None: at the first step)
        self.last_ready_change = since
        self.ready_seen = 0

    def step(self, ctx: Context) -> Steps:
        if self.since is None:
            self.since = ctx.now
        if self.last_ready_change is None:
            self.last_ready_change = self.since
        fatal = yield from _fatal(ctx)
        if fatal:
            return fatal
        if ctx.stop_reason is not None:
            yield StopWaiting("the job stopped before it trained")
            return Stopped(ctx.stop_reason, note="nothing had trained yet")
        if ctx.returned_early:  # its fn returned without ever joining the ring: no ring can ever start with it
            early = ctx.returned_early[0]
            yield event("failed", reason="fn returned before joining the ring", worker=early)
            return Failed(RunFailed(
                f"fn returned on worker {early} before it joined the job's ring (it made no er.* call "
                "and no collective), so the job can never start: ElasticTrainer runs fn as one worker of an elastic "
                "ring; train inside @er.elastic.run (or call er.rank() first), or run a function that needs no ring "
                "with Ray directly"))
        yield PollDrains()
        yield KillSilent(members=False)
        ctx = yield RequestCapacity()
        ready = ctx.joiners
        if len(ready) != self.ready_seen:
            self.ready_seen, self.last_ready_change = len(ready), ctx.now
        if decisions.ready_to_start(len(ready), ctx.limits.first_ring_workers, ctx.limits.max_workers,
                                    ctx.now - self.last_ready_change, START_GRACE_S):
            yield Form((), ready, reason="start")
            return Running()
        if ctx.now - self.since > ctx.start_timeout_s:
            ctx = yield DiagnoseStart(len(ready))
            return Failed(RunFailed(ctx.start_diagnosis))
        return self


class Running(DriverState):
    def __init__(self, stop_sent: bool = False) -> None:
        self.change_requested = False
        self.change_requested_at = 0.0
        self.overdue_reported = False
        self.stop_sent = stop_sent
        self.noticed_at: float | None = None  # when this round's notices were last sent or pushed again
        self.repeats = 0  # pushed again since the last new one

    def _noticed(self, now: float) -> None:
        self.noticed_at, self.repeats = now, 0

    def _repeat(self, ctx: Context) -> Generator[Action, Context, Context]:
        """Push this round's notices again while they may still be lost on their way (:func:`notice_repeat_due`)."""
        if self.noticed_at is None and self.stop_sent:  # (the stop went out with the ring that made this state)
            self._noticed(ctx.now)
        if self.noticed_at is not None and notice_repeat_due(ctx.now - self.noticed_at, self.repeats):
            self.noticed_at, self.repeats = ctx.now, self.repeats + 1
            return (yield RepeatNotices())
        return ctx

    def _drains(self) -> Generator[Action, Context, Context]:
        """Members on draining nodes (:mod:`.drains`): when others hold the state and enough remain, they leave at
        the next step boundary; else the ring trains on, writes a probe at once and the final write just in time,
        and re-forms at it; ready joiners take the state over live at once."""
        ctx = yield PollDrains()
        leavers = [m for m in ctx.members if m.leaving and not m.dead and not m.finished]
        if not leavers:
            return ctx
        step = drain_step(_needs_persist(ctx), self.change_requested, bool(ctx.joiners), _drain_deadline_s(leavers),
                          ctx.drain or DrainView(can_persist=False), ctx.round_id)
        if step is DrainStep.NONE:
            return ctx
        self._noticed(ctx.now)
        if step is DrainStep.PROBE:
            return (yield RequestPersist("drain", _drain_deadline_s(leavers)))
        if step is DrainStep.PERSIST:
            ctx = yield RequestPersist("drain", _drain_deadline_s(leavers), change=True)
        else:
            ctx = yield Notify()
        self.change_requested = True
        self.change_requested_at = ctx.now
        return ctx

    def step(self, ctx: Context) -> Steps:
        fatal = yield from _fatal(ctx)
        if fatal:
            return fatal
        ctx = yield KillSilent(failure_age_s=None)
        if ctx.stop_reason is not None and not self.stop_sent:
            self.stop_sent = True
            self._noticed(ctx.now)
            ctx = yield RequestPersist("stop", ctx.limits.stop_timeout_s, stop=True)
        outcome = decisions.running_outcome(list(ctx.members))
        if outcome is Outcome.FINISH:
            return (yield from _finish(ctx))
        if outcome is not Outcome.CONTINUE:
            return Reforming(outcome.value, since=ctx.now)
        if ctx.stop_reason is not None:  # (a drain is then seen, and the stop's own durable write covers it)
            if decisions.stop_overdue(ctx.stop_age_s, ctx.limits):
                return _stop_overdue(ctx)
            ctx = yield from self._repeat(ctx)
            yield PollDrains()
            return self
        ctx = yield from self._drains()
        ctx = yield from self._repeat(ctx)
        if self.change_requested and not self.overdue_reported and \
                ctx.now - self.change_requested_at > COMMIT_OVERDUE_S:
            self.overdue_reported = True
            ctx = yield event("commit_overdue", waited_s=COMMIT_OVERDUE_S,
                              advice="workers wait to join, but the ring has reached neither a step boundary nor a "
                                     "state.commit(); hold one DistributedOptimizer and one ElasticSampler in the "
                                     "state (joins, drains and stops then happen at the next step), or call "
                                     "state.commit() every few steps")
        if decisions.should_grow(len(ctx.members), len(ctx.joiners), ctx.limits.max_workers, self.change_requested,
                                 False):
            self.change_requested = True
            self.change_requested_at = ctx.now
            self._noticed(ctx.now)
            yield event("membership_change_requested", joiners=list(ctx.joiners))
            yield Notify()
        yield RequestCapacity()
        return self


class Reforming(DriverState):
    def __init__(self, reason: str, since: float, counted: bool = False) -> None:
        self.reason = reason
        self.counted = counted  # this failure counted against max_failures
        self.aborted = False    # the survivors were told to abandon the failed round
        self.since = since      # when the re-form began (driver clock)

    def step(self, ctx: Context) -> Steps:
        fatal = yield from _fatal(ctx)
        if fatal:
            return fatal
        if self.reason == "failure" and not self.aborted:
            self.aborted = True  # a peer frozen or dead: nobody waits on it in a collective or a formation
            yield AbortRound("the driver declared a member of this round lost")
        ctx = yield PollDrains()
        # Only a failure makes a member that stays away suspect; at a membership change, a member still away
        # is writing the commit the driver asked for (a drain or a stop), which has its own deadline.
        ctx = yield KillSilent(failure_age_s=ctx.now - self.since if self.reason == "failure" else None)
        lost = ctx.unreported_losses
        if lost:
            ctx = yield ReportLost(lost)
        # A death at a membership change counts too; a ring given ahead of the survivors' requests that failed to
        # form with nobody lost since (a survivor slow to come: the others' formation timed out) is the same
        # failure, counted once.
        same_failure = ctx.prompt_age_s is not None and not any(m.dead for m in ctx.members) and \
            ctx.prompt_age_s <= ctx.limits.connect_timeout_s + STUCK_GRACE_S + ctx.limits.heartbeat_interval_s
        if (self.reason == "failure" or lost) and not self.counted and not same_failure:
            self.counted = True
            ctx = yield CountFailure()
            message = decisions.give_up_after_failure(list(ctx.failure_ages_s), ctx.limits)
            if message:
                return Failed(RunFailed(message + _last_raised(ctx)))
        stopping = ctx.stop_reason is not None
        joiners = () if stopping else ctx.joiners
        decision = decisions.reform_decision(list(ctx.members), len(joiners), stopping, ctx.ever_had_state,
                                             ctx.now - self.since, ctx.limits, checkpoint=ctx.checkpoint is not None,
                                             drain=ctx.drain, round_id=ctx.round_id, write_landing=ctx.write_landing)
        if decision.step is Step.WAIT and self.aborted and decisions.prompt_ring(
                list(ctx.members), len(joiners), stopping, ctx.ever_had_state, ctx.limits, ctx.drain):
            return (yield from self._form(ctx, joiners, decisions.ReformDecision(Step.FORM), prompt=True))
        if decision.step is Step.WAIT:
            if stopping and decisions.stop_overdue(ctx.stop_age_s, ctx.limits):
                return _stop_overdue(ctx)
            idle = tuple(m.worker_id for m in ctx.members if m.leaving and m.waiting) if decision.release_leavers else ()
            if idle:  # others hold the state: nothing keeps them (a write of theirs lands before they return)
                ctx = yield StopWorkers(idle, "its node drains; the others hold the job's state")
            if not stopping:
                yield RequestCapacity()
            return self
        if decision.step is Step.FINISH:
            return (yield from _finish(ctx))
        if decision.step is Step.FAIL:
            return Failed(RunFailed(decision.message))
        if decision.step is Step.STOPPED:
            yield StopWaiting("the job stopped")
            return Stopped(ctx.stop_reason or "stop", note=decision.message)
        if decision.step is Step.RELEASE:
            leavers = tuple(m.worker_id for m in ctx.members if m.leaving and not m.dead)
            if leavers:
                yield StopWorkers(leavers, "its node drains; its state is in the drain commit's checkpoint")
            yield event("drain_released", reason=decision.message, saved=decision.saved, checkpoint=ctx.checkpoint)
            ctx = yield DropRing()  # no member is left: the next ring is formed of whoever comes, from the checkpoint
            return Reforming(self.reason, since=ctx.now, counted=True)  # the capacity wait starts now
        return (yield from self._form(ctx, joiners, decision))

    def _form(self, ctx: Context, joiners: tuple[str, ...], decision: decisions.ReformDecision,
              prompt: bool = False) -> Steps:
        members = ctx.members
        staying = [m for m in members if not m.dead and not m.leaving and not m.finished]
        keepers = [m for m in members if not m.dead and m.leaving and not m.finished and m.has_state]
        stop = decision.step is Step.FORM_STOP
        handover = decision.step is Step.HANDOVER
        persist = decision.step is Step.PERSIST
        if stop and not any(m.has_state for m in staying):
            staying = keepers + staying   # only leavers hold the state: they commit durably and stop
        elif handover or persist:
            staying = keepers + staying   # they sync the state to the others (handover) or write it (persist)
        elif decision.keep_leavers:       # they train on until the drain's final write, in the room left
            room = max(0, ctx.limits.max_workers - len(staying) - len(joiners))  # (stayers and joiners first)
            staying = staying + [m for m in members if not m.dead and m.leaving and not m.finished][:room]
        kept = {m.worker_id for m in staying}
        leavers = tuple(m.worker_id for m in members if m.leaving and not m.dead and m.worker_id not in kept)
        if leavers:
            ctx = yield StopWorkers(leavers, "its node drains; it left the ring at the last commit")
        if stop and ctx.joiners:
            ctx = yield StopWorkers(ctx.joiners, "the job stops")
        if decision.message:
            yield event("resuming_from_checkpoint", uri=ctx.checkpoint)
        ctx = yield Form(tuple(m.worker_id for m in staying), () if persist else joiners, reason=self.reason,
                         stop=stop, handover=handover, extra=len(keepers) if handover else 0, persist=persist,
                         prompt=prompt)
        kind = ("handover" if handover else "drain_write" if persist else "recovered" if self.reason == "failure"
                else "resized")
        yield event(kind, seconds=round(ctx.now - self.since, 4))
        return Running(stop_sent=stop)
