"""What the driver knows of each worker (:class:`WorkerRecord`), kept up to date by the pool (:mod:`.pool`) from
the worker's messages and from Ray, and what the workers sent for the trainer (:class:`Mail`). All times are the
driver's own monotonic clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import WorkerError
from .decisions import StartFailureKind
from .liveness import MemberView


@dataclass
class WorkerRecord:
    worker_id: str
    actor: Any
    info_ref: Any
    run_ref: Any
    created_at: float
    info: dict | None = None
    joined_seq: int | None = None   # order in which it became ready (asked for its first ring)
    ready_at: float | None = None   # driver's monotonic time when it first asked for a ring
    has_state: bool = False         # completed a sync: holds the job's state
    generation: int = 0             # the generation it last asked a ring for
    reason: str | None = None
    answered: int = 0               # the generation the driver last answered
    expected: int = 0               # a generation answered before the worker asked for it (0: none pending)
    previous: dict | None = None    # the answer before one given ahead (expected), until the worker asks
    answer: dict | None = None      # that answer (sent again if it got lost)
    answered_at: float = 0.0
    resends: int = 0                # times that answer was sent again since (each waits twice as long)
    in_ring: bool = False           # has been given a ring
    dead: bool = False
    cause: str | None = None
    finished: bool = False
    leaving: bool = False           # its node drains: it leaves the ring at the next commit
    leaving_since: float | None = None  # driver clock: when the driver saw its node drain
    leave_by: float | None = None   # driver clock: its node's drain deadline (None: none known)
    unheard: int = 0                # times in a row it answered through Ray while its messages were missing
    probe_ref: Any = None           # a ping through Ray in flight (see WorkerPool.probe)
    probe_at: float = 0.0
    beat_seq: int = 0               # its heartbeat counter, as last seen
    beat_at: float | None = None    # when that counter last advanced (driver clock), or a grace began
    heard_at: float | None = None   # when that counter last advanced (a grace does not move it)
    fault: str | None = None        # what a worker thread reported before it failed
    value: Any = None
    user_error: WorkerError | None = None
    start_error: str | None = None  # the actor or fn could not even start (what to tell the user)
    start_kind: StartFailureKind | None = None  # and of which kind (decisions.start_failure_verdict)

    @property
    def waiting(self) -> bool:
        return not self.dead and self.generation > self.answered

    @property
    def node_id(self) -> str:
        return self.info["node_id"] if self.info else "?"

    def silent_s(self, now: float, inbox_delay_s: float = 0.0) -> float | None:
        """Since its heartbeat counter last advanced, less how far the driver's inbox is behind (its newer
        heartbeats may wait there: :mod:`.pacing`)."""
        return None if self.beat_at is None else max(0.0, now - self.beat_at - inbox_delay_s)

    def leave_in_s(self, now: float) -> float | None:
        return None if self.leave_by is None else self.leave_by - now

    def view(self, now: float, inbox_delay_s: float = 0.0) -> MemberView:
        # (the properties above, inlined: the driver builds a view of every member at every step)
        dead, beat_at, leave_by = self.dead, self.beat_at, self.leave_by
        return MemberView(self.worker_id, dead, self.finished,
                          self.reason if not dead and self.generation > self.answered else None, self.leaving,
                          self.has_state, None if beat_at is None else max(0.0, now - beat_at - inbox_delay_s),
                          None if leave_by is None else leave_by - now, self.expected > 0)


@dataclass
class Mail:
    """What the workers sent that the trainer (not the driver's states) consumes."""

    reports: list[dict] = field(default_factory=list)
    timeline: list[tuple[str, str, list, int]] = field(default_factory=list)
    resumed: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
