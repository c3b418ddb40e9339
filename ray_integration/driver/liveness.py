"""The driver's liveness decisions: who is silent, what a probe through Ray says, when a silence is the
driver's own (a stall, a backlog) and when a cut is not each worker's broken connection. Pure functions of typed
observations, tested with tables; :mod:`.decisions` re-exports them (one namespace for the states and the loop).
Times are ages on the driver's own monotonic clock; the deadlines come as :class:`~ray_integration.config.Limits`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..config import STUCK_GRACE_S, Limits


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
    unasked: bool = False        # answered with a ring before it asked for one (decisions.prompt_ring), not yet asked

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


def defer_for_backlog(backlog: int, deferred_s: float | None, limits: Limits) -> bool:
    """Hold a silence verdict while the driver's inbox still holds unread messages (they may be the
    silent worker's heartbeats), but for at most two heartbeat intervals: a steady stream of messages
    (many workers, or a forger flooding the queue) must not keep a frozen worker alive."""
    return backlog > 0 and (deferred_s is None or deferred_s < 2 * limits.heartbeat_interval_s)
