"""The driver's decisions, as pure functions of typed observations (tested with tables, without Ray).

The driver's states (:mod:`.states`) read these records in their context
(:mod:`.context`), ask the functions below, and return what to do. Nothing
here touches Ray, the store or a clock: times arrive as ages measured by the
driver's own monotonic clock (never a worker's). The deadlines come as
:class:`~ray_integration.config.Limits`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from ..config import STUCK_GRACE_S, Limits  # noqa: F401  (Limits: the deadlines every decision reads)
from .drains import DRAIN_MARGIN_S, DrainView, KeepersStep, keepers_step, persist_due  # noqa: F401
from .liveness import (  # noqa: F401  (re-exported: the states and the loop read every decision here)
    STALL_GAP_MIN_S, UNHEARD_TO_FAIL, Kill, MemberView, Probe, Verdict, after_probe, defer_for_backlog,
    driver_stalled, kill_cause, others_heard, silence_limit_s, stuck_rule_applies, unheard_verdict,
)


def _returned(alive: list[MemberView]) -> bool:
    """fn returned on the ring: on a member that stays, or on every member (a leaving member that was let go has
    finished too, but the job has not)."""
    return any(m.finished and not m.leaving for m in alive) or bool(alive) and all(m.finished for m in alive)


class Outcome(enum.Enum):
    CONTINUE = "continue"
    FINISH = "finish"
    REFORM_FAILURE = "failure"
    REFORM_MEMBERSHIP = "membership"


def running_outcome(members: list[MemberView]) -> Outcome:
    """What the running ring's members say: keep going, it is done, or it must re-form (and why). A member whose
    fn returned before it asked for the ring it was answered in advance (:func:`prompt_ring`) never forms it: the
    others would wait for it until their formation times out, so the ring re-forms now."""
    alive = [m for m in members if m.alive]
    if _returned(alive) and all(m.finished or m.waiting == "failure" for m in alive):
        return Outcome.FINISH   # fn returned; a peer lost at the very end does not undo that
    if any(m.dead for m in members) or any(m.waiting == "failure" or m.finished and m.unasked for m in alive):
        return Outcome.REFORM_FAILURE
    if any(m.waiting == "membership" for m in alive):
        return Outcome.REFORM_MEMBERSHIP
    return Outcome.CONTINUE


class ErrorStep(enum.Enum):
    NONE = "none"   # no worker's fn raised
    DROP = "drop"   # count the members whose fn raised as lost workers (replaced); the others go on
    FAIL = "fail"   # end the run with a worker's error


@dataclass(frozen=True)
class ErrorDecision:
    step: ErrorStep
    workers: tuple[str, ...] = ()  # DROP: the members to count as lost
    worker: str | None = None      # FAIL: whose error ends the run
    all_failed: bool = False       # FAIL: because every member of the ring failed (not the policy)


def worker_error_decision(policy: str, raised: list[str], members: list[MemberView],
                          dropped: frozenset[str] | set[str]) -> ErrorDecision:
    """What to do about the workers whose ``fn`` raised (``raised``, oldest first, not dropped yet). ``policy``
    (``TrainerConfig.worker_errors``): ``"fail"`` ends the run with the first error. ``"replace"`` is Horovod's
    elastic mode: a member whose fn raised is a failed worker, dropped and replaced while the others go on; the run
    fails when every member of the ring failed (each raised, was dropped for raising, or was lost), naming the
    error of the lowest rank that raised; and at once for a worker that raised before it joined any ring (its
    script cannot start: every replacement would fail alike)."""
    if not raised:
        return ErrorDecision(ErrorStep.NONE)
    if policy != "replace":
        return ErrorDecision(ErrorStep.FAIL, worker=raised[0])
    ids = [m.worker_id for m in members]
    outside = [w for w in raised if w not in ids]
    if outside:
        return ErrorDecision(ErrorStep.FAIL, worker=outside[0])
    failed = set(raised) | set(dropped)
    if all(m.dead or m.worker_id in failed for m in members):
        first = next(w for w in ids if w in failed)
        return ErrorDecision(ErrorStep.FAIL, worker=first, all_failed=True)
    return ErrorDecision(ErrorStep.DROP, workers=tuple(w for w in ids if w in raised))


class Step(enum.Enum):
    WAIT = "wait"        # not everyone is at the rendezvous yet, or capacity may still come
    FORM = "form"        # form the next ring of `staying` (+ joiners); with no holder left, it resumes from the checkpoint
    HANDOVER = "handover"  # only leaving members hold the state: form a ring of them + staying + joiners that
                           # syncs the state to the others, then re-forms at once without the leavers
    RELEASE = "release"  # leaving holders cannot wait longer and the state is in a durable checkpoint: let them go
    PERSIST = "persist"  # only leaving members hold the state: form a ring of them that commits after its sync,
                         # writes that commit durably (the drain's final write) and re-forms at once
    FORM_STOP = "form_stop"  # form it of `staying` (or the leaving holders) only, told to commit durably and stop
    FINISH = "finish"    # some members returned from fn and the rest are lost or waiting: the job is done
    STOPPED = "stopped"  # stop requested and nothing left to save
    FAIL = "fail"


@dataclass(frozen=True)
class ReformDecision:
    step: Step
    message: str = ""
    keep_leavers: bool = False  # FORM: the leaving members stay in the ring (they train until the final write)
    release_leavers: bool = False  # WAIT: others hold the state; the leaving members waiting may go now
    saved: bool = False         # RELEASE: the drain's final write landed (else an older checkpoint keeps the state)


def reform_decision(members: list[MemberView], joiners: int, stop: bool, ever_had_state: bool,
                    waited_s: float, limits: Limits, checkpoint: bool = False,
                    drain: DrainView | None = None, round_id: int = 0, write_landing: bool = False) -> ReformDecision:
    """The re-forming ring's next step. ``waited_s``: since the re-form began (driver clock);
    ``checkpoint``: a durable checkpoint of the job's state exists (written or resumed in this run);
    ``drain``: the current drain's writes (:mod:`.drains`), None when no member is leaving; ``write_landing``: a
    write the driver asked for is still on its way (its writer works on it)."""
    alive = [m for m in members if m.alive]
    if _returned(alive) and all(m.finished or m.waiting is not None for m in alive):
        return ReformDecision(Step.FINISH)
    staying = [m for m in alive if not m.leaving and not m.finished]
    leaving = [m for m in alive if m.leaving and not m.finished]
    if not all(m.waiting is not None for m in staying + leaving):
        return ReformDecision(Step.WAIT)
    keepers = [m for m in leaving if m.has_state]   # leaving, but they hold the state: hand it over first
    if any(m.has_state for m in staying) or not ever_had_state:
        if ever_had_state and not stop and _keep_leavers(staying, leaving, joiners, limits, drain, round_id):
            decision = _form_or_wait(len(staying) + len(leaving) + joiners, stop, staying + leaving, waited_s, limits)
            if decision.step is Step.FORM:
                return replace(decision, keep_leavers=True)
        decision = _form_or_wait(len(staying) + joiners, stop, staying, waited_s, limits)
        return replace(decision, release_leavers=bool(leaving)) if decision.step is Step.WAIT else decision
    if stop:
        if keepers:
            return ReformDecision(Step.FORM_STOP)   # the leaving holders commit durably and stop
        return ReformDecision(Step.STOPPED, "every worker that held the job's state was lost; nothing in memory "
                                            "to save (the newest durable checkpoint stays the newest)")
    if keepers:
        return _keepers(keepers, len(staying) + joiners, waited_s, limits, drain, checkpoint, round_id)
    if checkpoint:   # every holder is gone, but the state is durable: resume from it in this run
        return _form_or_wait(len(staying) + joiners, stop, staying, waited_s, limits, resume=True)
    if write_landing:  # the leavers went while their final write was landing: its outcome decides
        return ReformDecision(Step.WAIT)
    return ReformDecision(Step.FAIL, (
        "every worker that held the job's state was lost at once (the rest had just joined and not yet received "
        "it), and no durable checkpoint exists; nothing can be recovered. Set checkpoint_uri to resume after "
        "such losses"))


def _form_or_wait(available: int, stop: bool, staying: list[MemberView], waited_s: float, limits: Limits,
                  resume: bool = False) -> ReformDecision:
    if stop:
        return ReformDecision(Step.FORM_STOP) if staying else ReformDecision(
            Step.STOPPED, "no worker left to save the last commit (the newest durable checkpoint stays the newest)")
    if available < max(1, limits.min_workers):
        if waited_s > limits.capacity_wait_s:
            kept = (" The job's state is in the newest durable checkpoint: run the same script again to resume."
                    if resume else "")
            return ReformDecision(Step.FAIL, (
                f"only {available} workers left, below min_workers={limits.min_workers}, and no capacity "
                f"came within elastic_timeout_s={limits.capacity_wait_s}; add nodes, lower min_workers, or raise "
                f"elastic_timeout_s.{kept}"))
        return ReformDecision(Step.WAIT)
    return ReformDecision(Step.FORM, "resume from the newest durable checkpoint" if resume else "")


def _leave_in_s(members: list[MemberView]) -> float | None:
    left = [m.leave_in_s for m in members if m.leave_in_s is not None]
    return min(left) if left else None


def _keep_leavers(staying: list[MemberView], leaving: list[MemberView], joiners: int, limits: Limits,
                  drain: DrainView | None, round_id: int) -> bool:
    """Leaving members whose state others hold stay in the next ring while their drain still needs its final
    write (the ring left behind would be too small) and it is not due yet: they train until then."""
    if not leaving or drain is None or not drain.can_persist:
        return False
    if not persist_before_leaving(len(staying) + joiners, limits.min_workers, sum(1 for m in staying if m.has_state)):
        return False
    final = drain.final
    if final is not None and (final.saved or final.pending(round_id)):
        return False
    return not persist_due(_leave_in_s(leaving), drain)


_RELEASE_SAVED = ("no worker came to take the state before the drain deadline; the drain's final write, a durable "
                  "checkpoint, holds it (that commit was saved), and the job resumes from it when capacity comes")
_RELEASE_OLDER = ("no worker came to take the state before the drain deadline, and the drain's final write had not "
                  "landed (the leaving rank 0 still writes it, or it failed: see the checkpoint events); the job "
                  "resumes from the newest checkpoint when capacity comes, and trains again what came after it")


def _keepers(keepers: list[MemberView], takers: int, waited_s: float, limits: Limits,
             drain: DrainView | None, checkpoint: bool, round_id: int) -> ReformDecision:
    """Only leaving members hold the state (:func:`~.drains.keepers_step`)."""
    kept = keepers_step(len(keepers), takers, _leave_in_s(keepers), waited_s, limits, drain, checkpoint, round_id)
    if kept.step is KeepersStep.HANDOVER:
        return ReformDecision(Step.HANDOVER)
    if kept.step is KeepersStep.TRAIN:
        return ReformDecision(Step.FORM, keep_leavers=True)
    if kept.step is KeepersStep.PERSIST:
        return ReformDecision(Step.PERSIST)
    if kept.step is KeepersStep.RELEASE:
        return ReformDecision(Step.RELEASE, _RELEASE_SAVED if kept.saved else _RELEASE_OLDER, saved=kept.saved)
    if kept.step is KeepersStep.FAIL:
        return ReformDecision(Step.FAIL, (
            "every worker holding the job's state is on a draining node, no other worker came to take the state "
            "before the drain deadline, and no durable checkpoint of the drain commit was written to keep it; set "
            "checkpoint_uri (the drain commit is then written durably and the job resumes when capacity returns; "
            "if it is set, the checkpoint_failed events say why the write failed), or keep capacity for "
            "replacements"))
    return ReformDecision(Step.WAIT)


def prompt_ring(members: list[MemberView], joiners: int, stop: bool, ever_had_state: bool, limits: Limits,
                drain: DrainView | None) -> bool:
    """Answer the survivors of a loss before they ask: form the next ring now, and push each survivor its answer
    behind the round's abort (the answer waits in its queue for the request its failed collective makes). Only
    when the driver knows the cause and the outcome: a member is dead; every other one is alive, neither
    returned nor leaving, and either asked already or was heard within ``suspect_after_s`` (presumed on its way
    to the rendezvous); no stop and no drain is in progress; and the ring it would form once all of them asked
    is an ordinary one (:func:`reform_decision` says FORM, neither keeping leavers nor resuming a checkpoint).
    It saves the survivors' requests' trip through the driver's inbox (1,023 of them at 1,024 workers). Should a
    survivor not come after all, the ring it was given fails to form or is aborted like any other
    (:func:`running_outcome`, the silence rules); every other case waits for each survivor's request."""
    if stop or drain is not None or not any(m.dead for m in members):
        return False
    alive = [m for m in members if m.alive]
    if not alive or any(m.finished or m.leaving for m in alive) or not all(
            m.waiting is not None or m.silent_s is not None and m.silent_s <= limits.suspect_after_s for m in alive):
        return False
    asked = [m._replace(waiting=m.waiting or "failure") for m in members]
    decision = reform_decision(asked, joiners, False, ever_had_state, 0.0, limits)
    return decision.step is Step.FORM and not decision.keep_leavers and not decision.message


def should_grow(world_size: int, ready_joiners: int, max_workers: int, change_pending: bool, stopping: bool) -> bool:
    """Ask the ring to re-form at its next commit when a fully started joiner waits and there is room."""
    return not stopping and not change_pending and ready_joiners > 0 and world_size < max_workers


def workers_to_request(live: int, max_workers: int) -> int:
    """Keep up to ``max_workers`` actors requested; pending ones show the autoscaler the demand. ``live``
    leaves out workers on draining nodes: their replacements are requested at the notice."""
    return max(0, max_workers - live)


def ready_to_start(ready: int, min_workers: int, max_workers: int, quiet_s: float, grace_s: float) -> bool:
    """Form the first ring once ``min_workers`` are ready and either ``max_workers`` are, or no new
    one became ready for ``grace_s`` (the others may be still starting, or waiting for capacity)."""
    if ready < min_workers:
        return False
    return ready >= max_workers or quiet_s >= grace_s


def failures_in_window(failure_ages_s: list[float], window_s: float) -> int:
    """How many failures count: those at most ``window_s`` old (ages on the driver's clock)."""
    return sum(1 for age in failure_ages_s if age <= window_s)


def give_up_after_failure(failure_ages_s: list[float], limits: Limits) -> str | None:
    """The message to end the run with once more than ``max_failures`` failures happened within
    ``failure_window_s``, else None. A job preempted every hour never reaches it with the defaults."""
    counted = failures_in_window(failure_ages_s, limits.failure_window_s)
    if counted > limits.max_failures:
        return (f"{counted} failures within failure_window_s={limits.failure_window_s:g} exceed "
                f"max_failures={limits.max_failures}; raise max_failures or look at why workers keep failing "
                "(result.events and the worker_lost causes)")
    return None


def persist_before_leaving(remaining: int, min_workers: int, staying_holders: int) -> bool:
    """Write a durable checkpoint at the drain commit when the ring left behind would be too small, or when
    no staying member holds the state (the leavers hand it over; the checkpoint keeps it if nobody comes)."""
    return remaining < min_workers or staying_holders == 0


def stop_overdue(stop_age_s: float | None, limits: Limits) -> bool:
    """A requested stop has waited too long for the workers' last commit."""
    return stop_age_s is not None and stop_age_s > limits.stop_timeout_s


class StartFailureKind(enum.Enum):
    """How a worker failed before it could run ``fn`` (see :func:`start_failure_verdict`)."""

    LOAD = "load"          # fn, its module or an import of the worker could not be loaded there
    INIT = "init"          # the worker actor's constructor raised for another reason
    RUNTIME_ENV = "runtime_env"  # Ray could not set up the runtime_env


#: How many failures of a kind, of any workers, end the run. A broken import fails the same way on every
#: node, so the first ends it. A constructor error or a runtime_env that cannot be set up may come from a
#: node that died while the worker started (a preemption, a removed node), so it takes a second one to
#: tell a deterministic failure from bad luck.
START_FAILURES_TO_GIVE_UP = {StartFailureKind.LOAD: 1, StartFailureKind.INIT: 2, StartFailureKind.RUNTIME_ENV: 2}


def start_failure_verdict(kinds: list[StartFailureKind]) -> int | None:
    """Given the start failures seen so far (oldest first), the index of the one that ends the run, or
    None (each earlier one is an ordinary worker loss: it is replaced and counts against max_failures)."""
    seen: dict[StartFailureKind, int] = {}
    for i, kind in enumerate(kinds):
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] >= START_FAILURES_TO_GIVE_UP[kind]:
            return i
    return None
