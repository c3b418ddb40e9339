"""Membership notices, tagged with the round they are for, that ``commit()`` agrees on.

The Ray worker runtime (or a test) posts a notice on a rank, from any thread,
when the driver decides something about the current ring: re-form at the next
commit (a worker joins, a node drains), also write that commit durably
(``persist``), or stop at it (``stop``: the job ends). At its next ``commit()``
every rank learns of it in the same small collective and raises
:class:`elastic_ring.MembershipChanged` or :class:`~state.errors.TrainingStopped`.
A ``persist`` alone (no change, no stop) writes that commit durably and the ring
trains on: the driver's just-in-time write before a preemption deadline. The
driver numbers its persist requests (``persist_id``): the write it asked for is
tagged with that number, so that the driver knows *that* commit was saved.

Every notice names the round it is for. A commit looks only at notices for
the ring's current round and consumes them; a notice for an older round is
dropped (the driver already acted on that round: no needless re-form), and one
for a later round waits for that round. Nothing is lost between the agreement
and the clearing either: the driver re-decides everything (joiners, leavers,
a pending stop) whenever it forms the next round, and tells the new round.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from elastic_ring.ring import runtime


@dataclass(frozen=True)
class Notice:
    """What the driver asks of one round's ring at its next commit."""

    round_id: int
    change: bool = False    # re-form at the next commit
    persist: bool = False   # write that commit durably first
    stop: bool = False      # the job ends at that commit (written durably)
    persist_id: int = 0     # the driver's number for the persist it asked for (0: none)
    persist_by: float | None = None  # retry that write until then (this process's monotonic clock), e.g. a drain

    def merged(self, other: "Notice") -> "Notice":
        bys = [b for b in (self.persist_by, other.persist_by) if b is not None]
        return Notice(self.round_id, self.change or other.change, self.persist or other.persist,
                      self.stop or other.stop, max(self.persist_id, other.persist_id), min(bys) if bys else None)


_lock = threading.Lock()
_notices: dict[int, Notice] = {}
_done_persist_id = 0  # the newest persist request already acted on: a copy of it that arrives late is dropped


def _current_round() -> int:
    comm = runtime.current_or_none()
    return comm.spec.round_id if comm is not None else 0


def post(notice: Notice) -> None:
    """Record ``notice`` (thread-safe); flags for one round accumulate."""
    if not isinstance(notice, Notice):
        raise TypeError(f"post expects a Notice, got {type(notice).__name__}")
    with _lock:
        if notice.persist_id and notice.persist_id <= _done_persist_id and not (notice.change or notice.stop):
            return  # that persist was agreed on and done at a commit already (this copy of it came late)
        previous = _notices.get(notice.round_id)
        _notices[notice.round_id] = notice if previous is None else previous.merged(notice)


def pending(round_id: int | None = None) -> Notice:
    """The notice for ``round_id`` (default: the current ring's round); older notices are dropped."""
    round_id = _current_round() if round_id is None else round_id
    with _lock:
        for stale in [r for r in _notices if r < round_id]:
            del _notices[stale]
        return _notices.get(round_id, Notice(round_id))


def consume(round_id: int | None = None, persist_id: int = 0) -> None:
    """Drop the notices for ``round_id`` (default: the current round) and older ones; ``persist_id``: the persist
    request the ring agreed on and acted on (a late copy of it is then dropped)."""
    global _done_persist_id
    round_id = _current_round() if round_id is None else round_id
    with _lock:
        for done in [r for r in _notices if r <= round_id]:
            del _notices[done]
        _done_persist_id = max(_done_persist_id, persist_id)


def reset() -> None:
    """Forget every notice (a worker does this before it runs a new job)."""
    global _done_persist_id
    with _lock:
        _notices.clear()
        _done_persist_id = 0


# The commit's view, for the current round ------------------------------------------------------------------
def request_membership_change(persist: bool = False, round_id: int | None = None) -> None:
    """Ask every rank to re-form at the next commit of ``round_id`` (default: the current round)."""
    post(Notice(_current_round() if round_id is None else round_id, change=True, persist=persist))


def request_stop(round_id: int | None = None) -> None:
    """Ask every rank to stop at the next commit of ``round_id`` (default: the current round), written durably."""
    post(Notice(_current_round() if round_id is None else round_id, stop=True, persist=True))


def membership_change_requested() -> bool:
    return pending().change


def persist_requested() -> bool:
    return pending().persist


def stop_requested() -> bool:
    return pending().stop


def persist_id() -> int:
    return pending().persist_id


def persist_by() -> float | None:
    """Until when this process retries the write asked for (its own monotonic clock), or None (the writer's budget)."""
    return pending().persist_by


def clear_membership_change(persist_id: int = 0) -> None:
    """Consume the current round's notices (after every rank agreed on them at a commit)."""
    consume(persist_id=persist_id)
