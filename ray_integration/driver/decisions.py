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
from typing import NamedTuple

from ..config import STUCK_GRACE_S, Limits  # noqa: F401  (Limits: the deadlines every decision reads)
from .drains import DRAIN_MARGIN_S, DrainView, KeepersStep, keepers_step, persist_due  # noqa: F401


class MemberView(NamedTuple):
    """What the driver knows of one member of the current ring. (A named tuple, not a frozen dataclass: the driver
    builds one per member at every step, 1,024 of them at 1,024 workers, and a tuple is built in half the time.)"""

    worker_id: str
    dead: bool = False
    finished: bool = False
    waiting: str | None = None   # the reason it asked for a ring, while it waits for the answer
    leaving: bool = False        # its node drains: it leaves at the next commit
    has_state: bool = False      # it completed a sync
    silent_s: float | None = None  # since its heartbeat counter last advanced (driver clock); None: no beat yet
    leave_in_s: float | None = None  # leaving: time left before its node's drain deadline (None: no deadline known)

    @property
    def alive(self) -> bool:
        return not self.dead


@dataclass(frozen=True)
class Kill:
    """Why a member must go. ``confirm``: a verdict from silence alone, which the driver first checks
    through Ray (:func:`after_probe`): a frozen or lost process does not answer there, a live one whose
    messages do not reach the driver does."""

    cause: str
    confirm: bool = True


def kill_cause(m: MemberView, limits: Limits, failure_age_s: float | None) -> Kill | None:
    """Why ``m`` must be killed now, or None. ``failure_age_s``: since its peers reported a failure or
    began re-forming after one (None while the ring runs normally, and while it re-forms for a
    membership change: a member still away then is doing work the driver asked for, a commit's
    durable write, which has its own deadline)."""
    if m.dead or m.finished:
        return None
    if m.silent_s is not None and m.silent_s > limits.heartbeat_timeout_s:
        return Kill(f"no heartbeat for {m.silent_s:.1f} s (heartbeat_timeout_s={limits.heartbeat_timeout_s})")
    if failure_age_s is None or m.waiting is not None:
        return None
    if m.silent_s is not None and m.silent_s > limits.suspect_after_s:
        return Kill(f"silent for {m.silent_s:.1f} s while its peers re-formed the ring (presumed dead)")
    if failure_age_s > limits.stuck_after_s:
        return Kill(f"stuck in user code: its heartbeats arrive, but it did not reach the rendezvous within "
                    f"{limits.stuck_after_s:.0f} s (collective_timeout_s={limits.collective_timeout_s} + "
                    f"connect_timeout_s={limits.connect_timeout_s} + {STUCK_GRACE_S}) after its peers began "
                    "re-forming (a hang or deadlock in fn, or a collective called on only some ranks)", confirm=False)
    return None


def silence_limit_s(limits: Limits, failure_age_s: float | None) -> float:
    """The shortest silence for which :func:`kill_cause` condemns (else only :func:`stuck_rule_applies`)."""
    return limits.heartbeat_timeout_s if failure_age_s is None else min(limits.suspect_after_s, limits.heartbeat_timeout_s)


def stuck_rule_applies(limits: Limits, failure_age_s: float | None) -> bool:
    """Whether :func:`kill_cause` may condemn a member that heartbeats (stuck in user code)."""
    return failure_age_s is not None and failure_age_s > limits.stuck_after_s


class Probe(enum.Enum):
    """What Ray said when the driver asked a silent worker's actor to answer (within ``PROBE_S``)."""

    PENDING = "pending"        # asked, no answer yet, still within PROBE_S
    ANSWERED = "answered"      # it answered: the process runs, its messages do not reach the driver
    UNANSWERED = "unanswered"  # no answer within PROBE_S: frozen, or its node is gone


class Verdict(enum.Enum):
    WAIT = "wait"      # ask again at the next tick
    KILL = "kill"
    UNHEARD = "unheard"  # alive, but its messages are lost: give it a fresh grace and count it


def after_probe(probe: Probe) -> Verdict:
    """A silence verdict, once Ray has been asked whether the process still answers."""
    return {Probe.PENDING: Verdict.WAIT, Probe.ANSWERED: Verdict.UNHEARD, Probe.UNANSWERED: Verdict.KILL}[probe]


#: A worker found alive through Ray while none of its messages reached the driver this many times in a row
#: (each after a whole heartbeat_timeout_s) means something removes the job's messages: the run ends naming it.
UNHEARD_TO_FAIL = 2


def others_heard(silent: int, heard: int) -> bool:
    """Whether the driver hears the job's other workers, while ``silent`` live workers answer through Ray but their
    messages do not arrive (counted with those killed for it within two heartbeat timeouts: a cut that the driver's
    probes find in batches is one cut) and ``heard`` others' do. When it hears at least as many as are silent, each
    silent one's own connection is at fault (it is lost and replaced). When most are silent, it is something between
    the workers and the driver (its store, its inbox, the network, tampering, a cluster starved of CPU): killing them
    would end the job for it, so they are treated as when nobody is heard (a grace, then the run names it).
    Measured in ``benchmarks.control_plane`` at 1,024 simulated workers starved of CPU during a re-form: 1,011 of
    1,023 healthy workers killed without this rule, 771 with it before the batches were counted together."""
    return heard > 0 and heard >= silent


def unheard_verdict(worker_id: str, times: int, forged: int, others_heard: bool) -> tuple[Verdict, str | None]:
    """What to do when a live worker's messages went missing ``times`` times in a row. While the driver hears
    the other workers, it is that worker's connection to the store: a lost worker (KILL, replaced). When it
    hears none, something takes the job's messages: after UNHEARD_TO_FAIL times the run ends naming it."""
    if others_heard:
        return Verdict.KILL, ("it answers through Ray, but its messages stopped reaching the driver while the other "
                              "workers' arrive (its connection to the job's store is broken)")
    if times < UNHEARD_TO_FAIL:
        return Verdict.UNHEARD, None
    return Verdict.UNHEARD, _tampering(worker_id, times, forged)


def _tampering(worker_id: str, times: int, forged: int) -> str:
    return (f"worker {worker_id} answers through Ray, but none of its messages (nor any other worker's) reached "
            f"the driver for {times} heartbeat timeouts in a row, and {forged} messages that failed authentication were dropped: "
            "something that is not part of the job takes or corrupts messages in the job's rendezvous store "
            "(tampering), or the worker's connection to it is broken. See docs/security.md: restrict who can "
            "reach the driver node's ports (bind_address, a firewall)")


def driver_stalled(gap_s: float, since_last_grace_s: float, limits: Limits) -> bool:
    """The driver's own loop did not run for ``gap_s`` (a GC pause, a stopped or starved process):
    the workers' silence during it is the driver's, so every worker gets a fresh grace. At most one grace
    per heartbeat_timeout_s: a loop that is slow on every tick (a slow on_report) must not keep a frozen
    worker alive forever."""
    return gap_s > max(STALL_GAP_MIN_S, 2 * limits.heartbeat_interval_s) and \
        since_last_grace_s > limits.heartbeat_timeout_s


#: The driver loop wakes at least every 0.1 s; a gap longer than this (or two heartbeats) is a stall of its own.
STALL_GAP_MIN_S = 1.0


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
    """What the running ring's members say: keep going, it is done, or it must re-form (and why)."""
    alive = [m for m in members if m.alive]
    if _returned(alive) and all(m.finished or m.waiting == "failure" for m in alive):
        return Outcome.FINISH   # fn returned; a peer lost at the very end does not undo that
    if any(m.dead for m in members) or any(m.waiting == "failure" for m in alive):
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


def defer_for_backlog(backlog: int, deferred_s: float | None, limits: Limits) -> bool:
    """Hold a silence verdict while the driver's inbox still holds unread messages (they may be the
    silent worker's heartbeats), but for at most two heartbeat intervals: a steady stream of messages
    (many workers, or a forger flooding the queue) must not keep a frozen worker alive."""
    return backlog > 0 and (deferred_s is None or deferred_s < 2 * limits.heartbeat_interval_s)
