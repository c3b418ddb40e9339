"""Preemption notices: what the driver knows of a drain's writes, and the pure decisions of when to write.

A draining node has a deadline (Ray's wall-clock milliseconds, turned into time left once, on the driver's own
monotonic clock: :meth:`~.loop.Driver.poll_drains`). When its members hold the job's state and the ring left
behind would keep none of it, or would be too small (:func:`~.decisions.persist_before_leaving`), the state must
reach storage before the node dies. It gets there just in time:

1. at the notice the driver asks for a *probe*: the next step boundary's commit is written durably while the ring
   trains on (a fallback, and the measure of how long a write takes here, from the driver's ask to the write
   landing, all on the driver's clock);
2. the ring keeps training; once the time left is at most :data:`PERSIST_FACTOR` times the longest write measured
   plus :data:`PERSIST_MARGIN_S` (:func:`persist_due`), the driver asks for the *final* write: the next step
   boundary's commit is written, and the ring re-forms at it without waiting for the write;
3. "saved" means that write landed: every write the driver asks for has a number, its events carry it
   (:class:`PersistLog`), and the release of the leavers and the resume read that, never timestamps.

A notice seen in any state is handled the same way (:func:`drain_step` in a running ring, :func:`keepers_step` in a
re-forming one), and a holder lost during the drain does not cancel it: the survivors that hold the state keep
training, or are formed into a ring that only writes, and the final write is asked for again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from ..config import Limits

#: The final write is asked for when the time left is at most this times the longest write measured, ...
PERSIST_FACTOR = 1.5
#: ... plus this margin (the notice reaching the ring, a step to its boundary, the leavers leaving afterwards).
PERSIST_MARGIN_S = 2.0
#: How many of the newest measured writes the expected duration is taken from.
MEASURED = 5
#: A leaving holder with no taker is let go (its state in a checkpoint) this long before its node's drain
#: deadline, so that it leaves by itself rather than being killed with the node.
DRAIN_MARGIN_S = 5.0
#: While the final write is still landing, the leavers wait for it until this long before the deadline; then they
#: go all the same (the leaving rank 0 flushes it before it returns, until its node goes).
RELEASE_LATE_S = 1.0


@dataclass(frozen=True)
class PersistView:
    """One write the driver asked for, as a state sees it (times on the driver's clock)."""

    persist_id: int
    final: bool       # the drain's last write (the ring re-forms at it), not a probe (the ring trains on)
    round_id: int     # the round it was asked of (a ring answer's write: that ring's round)
    age_s: float      # since it was asked
    started: bool     # rank 0 took the commit and handed it to its writer
    saved: bool       # a write answering it landed (this commit, or a newer state)
    failed: bool      # its write failed for good (retried until the drain's deadline)

    def pending(self, round_id: int) -> bool:
        """Still to land, and still able to: asked of this round, not failed (a write asked of an earlier round
        that never started never will: that ring re-formed before its step boundary)."""
        return not self.saved and not self.failed and (self.started or self.round_id == round_id)


@dataclass(frozen=True)
class DrainView:
    """What a state knows of the current drain's writes."""

    can_persist: bool                 # the job has a checkpoint location
    need_s: float | None = None       # the longest of the newest writes measured (ask to landing); None: none yet
    probe: PersistView | None = None  # this drain's newest probe
    final: PersistView | None = None  # this drain's newest final write


def persist_due(left_s: float | None, drain: DrainView) -> bool:
    """Time for the final write: no deadline is known, or the time left is at most PERSIST_FACTOR times the write
    expected (the longest measured, or the age of the first probe still in flight: it takes at least that long)
    plus PERSIST_MARGIN_S."""
    if left_s is None:
        return True
    probe = drain.probe
    in_flight = probe.age_s if probe is not None and not probe.saved and not probe.failed else 0.0
    return left_s <= PERSIST_FACTOR * max(drain.need_s or 0.0, in_flight) + PERSIST_MARGIN_S


class DrainStep(enum.Enum):
    NONE = "none"        # keep training
    LEAVE = "leave"      # re-form at the next step boundary (the leavers leave, or hand the state to ready joiners)
    PROBE = "probe"      # write the next step boundary's commit; the ring trains on
    PERSIST = "persist"  # write the next step boundary's commit, the leavers' last: the ring re-forms at it


def drain_step(needs_persist: bool, notified: bool, takers_ready: bool, left_s: float | None,
               drain: DrainView, round_id: int) -> DrainStep:
    """What a running ring with leaving members does now. ``needs_persist``: the state must reach storage before
    they go (:func:`~.decisions.persist_before_leaving`); ``notified``: the ring was already told to re-form;
    ``takers_ready``: workers wait to join (the leavers can hand the state over live now)."""
    if not needs_persist or not drain.can_persist or takers_ready:
        return DrainStep.NONE if notified else DrainStep.LEAVE  # (no location: they leave, wait for a taker)
    final = drain.final
    if final is not None and (final.saved or final.pending(round_id)):
        return DrainStep.NONE
    if persist_due(left_s, drain):
        return DrainStep.PERSIST
    probe = drain.probe
    if probe is None or not probe.saved and not probe.pending(round_id):
        return DrainStep.PROBE
    return DrainStep.NONE


class KeepersStep(enum.Enum):
    WAIT = "wait"          # a taker may still come, or the final write is on its way
    HANDOVER = "handover"  # hand the live state to the takers, then the leavers go
    TRAIN = "train"        # form a ring of the leaving holders: they train on until the final write is due
    PERSIST = "persist"    # form a ring of them that only writes the state (commits after its sync) and re-forms
    RELEASE = "release"    # let them go: the state is in a checkpoint (or its final write is still landing)
    FAIL = "fail"


@dataclass(frozen=True)
class Keepers:
    step: KeepersStep
    saved: bool = False  # RELEASE: the final write landed (else an older checkpoint, or a write still landing)


def keepers_step(keepers: int, takers: int, left_s: float | None, waited_s: float, limits: Limits,
                 drain: DrainView | None, checkpoint: bool, round_id: int) -> Keepers:
    """Only leaving members (``keepers`` of them, all at the rendezvous) hold the state. Hand it to any taker at
    once. Without one: if the drain's final write landed, or is landing, wait for a taker while the deadline allows
    and let them go DRAIN_MARGIN_S before it; else, while a write still fits before the deadline, keep them training
    (enough of them for min_workers, the final write not due yet) or form them into a ring that writes; near the
    deadline, let them go if any checkpoint of the job exists, else fail."""
    if takers > 0:
        return Keepers(KeepersStep.HANDOVER)
    near = left_s <= DRAIN_MARGIN_S if left_s is not None else waited_s > limits.capacity_wait_s
    final = drain.final if drain is not None else None
    if final is not None and final.saved:
        return Keepers(KeepersStep.RELEASE, saved=True) if near else Keepers(KeepersStep.WAIT)
    if final is not None and final.pending(round_id) and final.started:  # landing: wait for it while time allows
        late = left_s <= RELEASE_LATE_S if left_s is not None else waited_s > limits.capacity_wait_s
        return Keepers(KeepersStep.RELEASE) if late else Keepers(KeepersStep.WAIT)
    if drain is not None and drain.can_persist and (left_s is None or left_s > (drain.need_s or 0.0)):
        if keepers >= max(1, limits.min_workers) and not persist_due(left_s, drain):
            return Keepers(KeepersStep.TRAIN)
        return Keepers(KeepersStep.PERSIST)
    if near:
        return Keepers(KeepersStep.RELEASE) if checkpoint else Keepers(KeepersStep.FAIL)
    return Keepers(KeepersStep.WAIT)


# ------------------------------------------------------------------ the driver's record of the writes it asked for
@dataclass
class _Persist:
    persist_id: int
    final: bool
    round_id: int
    asked_at: float
    started: bool = False
    landed_at: float | None = None
    failed: bool = False
    writer: str | None = None  # the worker that took the commit (its persist_started event)


@dataclass
class PersistLog:
    """The writes the driver asked for, by number, kept up to date from the workers' checkpoint events (a write
    tagged ``persist: n`` answers every request up to ``n``: it holds that commit or a newer state)."""

    persists: dict[int, _Persist] = field(default_factory=dict)
    measured: list[float] = field(default_factory=list)

    def ask(self, final: bool, round_id: int, now: float) -> int:
        persist_id = max(self.persists, default=0) + 1
        self.persists[persist_id] = _Persist(persist_id, final, round_id, now)
        return persist_id

    def apply(self, event: dict, now: float, worker: str | None = None) -> None:
        """A checkpoint event of ``worker``."""
        persist_id = event.get("persist")
        if not isinstance(persist_id, int) or isinstance(persist_id, bool) or persist_id not in self.persists:
            return
        kind = event.get("kind")
        if kind == "persist_started":
            self.persists[persist_id].started, self.persists[persist_id].writer = True, worker
        elif kind == "checkpoint_written":
            for asked in self.persists.values():
                if asked.persist_id <= persist_id and asked.landed_at is None:
                    asked.started, asked.landed_at, asked.failed = True, now, False
                    if asked.persist_id == persist_id:
                        self.measured = (self.measured + [now - asked.asked_at])[-MEASURED:]
        elif kind == "checkpoint_failed" and self.persists[persist_id].landed_at is None:
            self.persists[persist_id].failed = True

    def landing(self, working: Callable[[str], bool]) -> bool:
        """A write the driver asked for is still on its way: started, neither landed nor failed, and its writer
        still works (``working(worker)``: alive and not returned; a writer that returned flushed it or failed)."""
        return any(p.started and p.landed_at is None and not p.failed and p.writer is not None and working(p.writer)
                   for p in self.persists.values())

    def view(self, since: float | None, now: float, can_persist: bool,
             working: Callable[[str], bool] | None = None) -> DrainView:
        """The drain that began at ``since`` (driver clock): its newest probe and final write. A write that started
        on a writer no longer ``working`` (dead, or returned without its write landing) counts as failed: it will
        not land, and the holders left can write again."""
        mine = [p for p in self.persists.values() if since is not None and p.asked_at >= since]
        probe = max((p for p in mine if not p.final), key=lambda p: p.persist_id, default=None)
        final = max((p for p in mine if p.final), key=lambda p: p.persist_id, default=None)
        return DrainView(can_persist, max(self.measured) if self.measured else None, _view(probe, now, working),
                         _view(final, now, working))


def _view(p: _Persist | None, now: float, working: Callable[[str], bool] | None) -> PersistView | None:
    if p is None:
        return None
    orphaned = (working is not None and p.started and p.landed_at is None and p.writer is not None
                and not working(p.writer))
    return PersistView(p.persist_id, p.final, p.round_id, now - p.asked_at, p.started, p.landed_at is not None,
                       p.failed or orphaned)
