"""The interface between the driver's states (:mod:`.states`) and its loop (:mod:`.loop`).

A state reads a :class:`Context`: what the driver knows now, as typed, read-only
records (the ring's members as :class:`~.decisions.MemberView`, the joiners, the
stop requests, the run's failures). It answers with *actions*: the small data
classes below, each one thing for the loop to do. The loop does it and shows the
state a fresh Context when the action changed anything a Context shows (else
the same one), so a state always decides on the world as its last action left
it. Neither side reaches into the other: the states never see the
loop, the pool or Ray, and the loop never decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import Limits
from .decisions import MemberView, StartFailureKind
from .drains import DrainView


@dataclass(frozen=True)
class UserError:
    """``fn`` raised on a worker: the run ends with ``error`` (a :class:`~ray_integration.WorkerError`)."""

    worker_id: str
    node_id: str
    error: Any


@dataclass(frozen=True)
class StartFailure:
    """A worker that failed before ``fn`` ran: of which kind, and what to tell the user."""

    worker_id: str
    kind: StartFailureKind
    error: str | None


@dataclass(frozen=True)
class Context:
    """What a state reads. Times are ages and deadlines on the driver's own monotonic clock (``now``)."""

    now: float
    limits: Limits
    start_timeout_s: float
    round_id: int
    world_size: int | None
    members: tuple[MemberView, ...]          # the current ring's, in rank order (dead ones too)
    joiners: tuple[str, ...]                 # ready workers waiting for their first ring, oldest first
    results: Mapping[str, Any]               # what fn returned, by worker id, for every member that finished
    unreported_losses: tuple[str, ...]       # dead members no worker_lost event names yet
    newly_draining: tuple[str, ...]          # workers the last PollDrains (of this tick) found on draining nodes
    failure_ages_s: tuple[float, ...]        # the counted failures' ages
    stop_reason: str | None                  # a stop is requested (stop at the next commit, written durably)
    stop_age_s: float | None
    abort_reason: str | None                 # abandon everything now
    tampering: str | None                    # a live worker's messages keep going missing: why the run must end
    user_error: UserError | None             # the first worker whose fn raised (not dropped)
    start_failures: tuple[StartFailure, ...]  # oldest first
    returned_early: tuple[str, ...]          # workers whose fn returned before they ever joined a ring
    ever_had_state: bool                     # some worker completed a sync (held the job's state)
    checkpoint: str | None                   # the newest durable checkpoint of the job's state
    drain: DrainView | None = None           # members are leaving: the drain's writes the driver asked for
    write_landing: bool = False              # a write the driver asked for is on its way (its writer works on it)
    start_diagnosis: str | None = None       # set by DiagnoseStart: why fewer than min_workers started
    raised: tuple[UserError, ...] = ()       # every worker whose fn raised, not dropped yet, oldest first
    dropped: Mapping[str, UserError] = field(default_factory=dict)  # members dropped because fn raised (replace)
    prompt_age_s: float | None = None        # since the current ring was answered before its members asked (None: not)


# ---------------------------------------------------------------- actions: what a state asks the loop to do
@dataclass(frozen=True)
class AddEvent:
    """Record a membership event (tagged with the driver's current round and world size)."""

    kind: str
    detail: Mapping[str, Any] = field(default_factory=dict)


def event(kind: str, **detail: Any) -> AddEvent:
    return AddEvent(kind, detail)


@dataclass(frozen=True)
class PollDrains:
    """Take the draining nodes the drain watcher last reported (at once when new, else every ``DRAIN_POLL_S``);
    mark the live workers there as leaving (their ids: ``Context.newly_draining``) and record a ``node_draining``
    event per node."""


@dataclass(frozen=True)
class KillSilent:
    """Kill the workers the heartbeat and rendezvous rules condemn (:func:`~.decisions.kill_cause`): the
    ring's members when ``members`` (``failure_age_s``: since the re-form after a failure began), and every
    other live worker by the heartbeat rule. A verdict from silence alone is confirmed through Ray first."""

    members: bool = True
    failure_age_s: float | None = None


@dataclass(frozen=True)
class RequestCapacity:
    """Keep ``max_workers`` worker actors requested (those on draining nodes are replaced already)."""


@dataclass(frozen=True)
class Form:
    """Form the next round of ``staying`` + ``joiners`` (at most max_workers, plus ``extra`` leaving holders
    in a handover round); ``stop``: the round commits durably and ends; ``handover``: it re-forms right after
    its sync; ``persist``: it commits right after its sync, writes that commit durably (the drain's final write,
    numbered like a RequestPersist) and re-forms; ``prompt``: the members of ``staying`` that have not asked yet
    are answered for the request they will make (:func:`.decisions.prompt_ring`)."""

    staying: tuple[str, ...]
    joiners: tuple[str, ...]
    reason: str
    stop: bool = False
    handover: bool = False
    extra: int = 0
    persist: bool = False
    prompt: bool = False


@dataclass(frozen=True)
class Notify:
    """Tell the ring's live members to re-form at their next commit."""


@dataclass(frozen=True)
class RepeatNotices:
    """Push the current round's notices (and the ring's preemption notice) to its live members again, as sent: a
    member that has them already changes nothing (notices merge; a write already made is not made again), one
    whose copy was lost gets it now."""


@dataclass(frozen=True)
class RequestPersist:
    """Tell the ring's live members to write their next commit durably (``why``: ``"stop"`` or ``"drain"``),
    and re-form at it (``change``) or stop at it (``stop``), or train on (neither: a drain's probe); recorded as a
    ``persist_requested`` event. A drain's write is numbered (:class:`~.drains.PersistLog`) and retried until
    ``deadline_s`` from now."""

    why: str
    deadline_s: float | None
    change: bool = False
    stop: bool = False


@dataclass(frozen=True)
class AbortRound:
    """Tell the ring's members to abandon the current round at once: a collective or a formation
    of it waiting on a lost peer fails now instead of at its timeout."""

    why: str


@dataclass(frozen=True)
class StopWorkers:
    """Answer each of ``workers`` that waits for a ring with stop: it leaves the job."""

    workers: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class StopWaiting:
    """Answer every live worker that waits for a ring with stop."""

    why: str


@dataclass(frozen=True)
class ReportLost:
    """Record a ``worker_lost`` event for each of ``workers`` (dead members)."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class CountFailure:
    """Count one failure now (``Context.failure_ages_s`` then holds it)."""


@dataclass(frozen=True)
class DropRing:
    """No member is left: the next ring is formed of whoever comes (from the durable checkpoint)."""


@dataclass(frozen=True)
class DropRaised:
    """Count these members, whose fn raised, as lost workers (kill their actors; they are replaced):
    ``TrainerConfig.worker_errors="replace"``."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class DiagnoseStart:
    """Find out why fewer than min_workers started (``ready`` did): ``Context.start_diagnosis``."""

    ready: int


Action = (AddEvent | PollDrains | KillSilent | RequestCapacity | Form | Notify | RepeatNotices | RequestPersist
          | AbortRound | StopWorkers | StopWaiting | ReportLost | CountFailure | DropRing | DiagnoseStart | DropRaised)
