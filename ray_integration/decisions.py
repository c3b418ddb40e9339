"""The driver's decisions, as pure functions of typed observations (tested with tables, without Ray).

The driver's states (:mod:`.driver`) observe the pool, build these records,
ask the functions below, and do what they say. Nothing here touches Ray, the
store or a clock: times arrive as ages measured by the driver's own monotonic
clock (never a worker's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: A member that neither heartbeats nor reaches the rendezvous for this many heartbeat intervals,
#: while its peers report a failure, is presumed dead (a lost node can take Ray many seconds to declare).
SUSPECT_AFTER_INTERVALS = 3
#: Slack added to the longest legitimate wait (a collective timing out, then a ring failing to form)
#: before a member that heartbeats but stays away from the rendezvous is declared stuck.
STUCK_GRACE_S = 2.0


@dataclass(frozen=True)
class Limits:
    """Every deadline the driver keeps, derived from the options (see ``TrainerConfig.limits``)."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    collective_timeout_s: float
    connect_timeout_s: float
    capacity_wait_s: float      # elastic_timeout_s: below min_workers, wait this long for capacity
    stop_timeout_s: float       # after a stop request, the workers have this long to reach a commit
    min_workers: int
    max_workers: int
    max_failures: int
    failure_window_s: float = 3600.0  # failures older than this (driver clock) no longer count

    @property
    def suspect_after_s(self) -> float:
        return SUSPECT_AFTER_INTERVALS * self.heartbeat_interval_s

    @property
    def stuck_after_s(self) -> float:
        """A member can legitimately stay away from the rendezvous this long after its peers failed: its own
        collective times out (collective_timeout_s), then a ring it tried to form does (connect_timeout_s)."""
        return self.collective_timeout_s + self.connect_timeout_s + STUCK_GRACE_S


@dataclass(frozen=True)
class MemberView:
    """What the driver knows of one member of the current ring."""

    worker_id: str
    dead: bool = False
    finished: bool = False
    waiting: str | None = None   # the reason it asked for a ring, while it waits for the answer
    leaving: bool = False        # its node drains: it leaves at the next commit
    has_state: bool = False      # it completed a sync
    silent_s: float | None = None  # since its heartbeat counter last advanced (driver clock); None: no beat yet

    @property
    def alive(self) -> bool:
        return not self.dead


def kill_cause(m: MemberView, limits: Limits, failure_age_s: float | None) -> str | None:
    """Why ``m`` must be killed now, or None. ``failure_age_s``: since its peers reported a failure or
    began re-forming (None while the ring runs normally)."""
    if m.dead or m.finished:
        return None
    if m.silent_s is not None and m.silent_s > limits.heartbeat_timeout_s:
        return f"no heartbeat for {m.silent_s:.1f} s (heartbeat_timeout_s={limits.heartbeat_timeout_s})"
    if failure_age_s is None or m.waiting is not None:
        return None
    if m.silent_s is not None and m.silent_s > limits.suspect_after_s:
        return f"silent for {m.silent_s:.1f} s while its peers re-formed the ring (presumed dead)"
    if failure_age_s > limits.stuck_after_s:
        return (f"stuck in user code: its heartbeats arrive, but it did not reach the rendezvous within "
                f"{limits.stuck_after_s:.0f} s (collective_timeout_s={limits.collective_timeout_s} + "
                f"connect_timeout_s={limits.connect_timeout_s} + {STUCK_GRACE_S}) after its peers began "
                "re-forming (a hang or deadlock in fn, or a collective called on only some ranks)")
    return None


class Outcome(enum.Enum):
    CONTINUE = "continue"
    FINISH = "finish"
    REFORM_FAILURE = "failure"
    REFORM_MEMBERSHIP = "membership"


def running_outcome(members: list[MemberView]) -> Outcome:
    """What the running ring's members say: keep going, it is done, or it must re-form (and why)."""
    alive = [m for m in members if m.alive]
    if any(m.finished for m in alive) and all(m.finished or m.waiting == "failure" for m in alive):
        return Outcome.FINISH   # fn returned; a peer lost at the very end does not undo that
    if any(m.dead for m in members) or any(m.waiting == "failure" for m in alive):
        return Outcome.REFORM_FAILURE
    if any(m.waiting == "membership" for m in alive):
        return Outcome.REFORM_MEMBERSHIP
    return Outcome.CONTINUE


class Step(enum.Enum):
    WAIT = "wait"        # not everyone is at the rendezvous yet, or capacity may still come
    FORM = "form"        # form the next ring of `staying` (+ joiners)
    FORM_STOP = "form_stop"  # form it of `staying` only, told to commit durably and stop right after the sync
    FINISH = "finish"    # some members returned from fn and the rest are lost or waiting: the job is done
    STOPPED = "stopped"  # stop requested and nothing left to save
    FAIL = "fail"


@dataclass(frozen=True)
class ReformDecision:
    step: Step
    message: str = ""


def reform_decision(members: list[MemberView], joiners: int, stop: bool, ever_had_state: bool,
                    waited_s: float, limits: Limits) -> ReformDecision:
    """The re-forming ring's next step. ``waited_s``: since the re-form began (driver clock)."""
    alive = [m for m in members if m.alive]
    if any(m.finished for m in alive) and all(m.finished or m.waiting is not None for m in alive):
        return ReformDecision(Step.FINISH)
    staying = [m for m in alive if not m.leaving and not m.finished]
    leaving = [m for m in alive if m.leaving]
    if not all(m.waiting is not None for m in staying) or not all(m.waiting is not None or m.finished
                                                                  for m in leaving):
        return ReformDecision(Step.WAIT)
    if not any(m.has_state for m in staying) and ever_had_state:
        if stop:
            return ReformDecision(Step.STOPPED, "every worker that held the job's state was lost; nothing in memory "
                                                "to save (the newest durable checkpoint stays the newest)")
        return ReformDecision(Step.FAIL, (
            "every worker that held the job's state was lost at once (the rest had just joined and not yet received "
            "it); nothing in memory can be recovered. With checkpoint_uri set, run the same script again to resume "
            "from the newest checkpoint"))
    if stop:
        return ReformDecision(Step.FORM_STOP) if staying else ReformDecision(
            Step.STOPPED, "no worker left to save the last commit (the newest durable checkpoint stays the newest)")
    if len(staying) + joiners < limits.min_workers:
        if waited_s > limits.capacity_wait_s:
            return ReformDecision(Step.FAIL, (
                f"only {len(staying) + joiners} workers left, below min_workers={limits.min_workers}, and no capacity "
                f"came within elastic_timeout_s={limits.capacity_wait_s}; add nodes, lower min_workers, or raise "
                "elastic_timeout_s"))
        return ReformDecision(Step.WAIT)
    return ReformDecision(Step.FORM)


def should_grow(world_size: int, ready_joiners: int, max_workers: int, change_pending: bool, stopping: bool) -> bool:
    """Ask the ring to re-form at its next commit when a fully started joiner waits and there is room."""
    return not stopping and not change_pending and ready_joiners > 0 and world_size < max_workers


def workers_to_request(live: int, max_workers: int) -> int:
    """Keep up to ``max_workers`` actors requested; pending ones show the autoscaler the demand."""
    return max(0, max_workers - live)


def ready_to_start(ready: int, min_workers: int, max_workers: int, quiet_s: float, grace_s: float) -> bool:
    """Form the first ring once ``min_workers`` are ready and either ``max_workers`` are, or no new
    one became ready for ``grace_s`` (the others may be still starting, or waiting for capacity)."""
    if ready < min_workers:
        return False
    return ready >= max_workers or quiet_s >= grace_s


def give_up_after_failure(failures: int, max_failures: int) -> str | None:
    """The message to end the run with once ``failures`` exceed ``max_failures``, else None."""
    if failures > max_failures:
        return (f"{failures} failures exceed max_failures={max_failures}; raise max_failures or look at why workers "
                "keep failing (result.events and the worker_lost causes)")
    return None


def persist_before_leaving(remaining: int, min_workers: int) -> bool:
    """Write a durable checkpoint at the drain commit when the ring left behind would be too small."""
    return remaining < min_workers


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
