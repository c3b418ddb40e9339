"""Who gives the ring its state after a re-form, and from which point: a pure decision, tested with tables.

Every rank of a new ring reports four small integers (one allgather, at the start of ``State.sync``):

* ``holds``: it holds the job's state (it completed a sync before). A joiner does not.
* ``trust``: how its live state came out of the failure that caused this re-form:
  ``CONSISTENT`` (no failure since its last sync, e.g. a join or a drain), ``WHOLE`` (the state is
  whole: see :func:`failure_trust`), or ``DIRTY`` (it may be half-updated).
* ``version``: how far its live state got: +1 for every applied optimizer step and every commit,
  counted from the version its last sync gave every rank. Ranks of one ring move in lock step, so a
  larger version is a later state of the same history.
* ``commit_version``: the version of its last commit.

The rule (see docs/elasticity.md for the proof):

1. No rank holds state: the job starts (or resumes from its newest checkpoint) on rank 0 (``FRESH``).
2. Some holder is not ``DIRTY``: the ring continues from the newest live state among those
   (``LIVE``): the root is the one with the largest ``version`` (lowest rank on a tie). Nothing
   committed or applied by a whole state is lost; the step in flight is discarded (a rank that
   applied it has the largest version and becomes the root: then not even that step is lost).
3. Every holder is ``DIRTY``: each rolls back to its last commit, and the root is the holder with
   the newest commit (``ROLLBACK``). This is the only case that loses work (back to that commit).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

CONSISTENT, WHOLE, DIRTY = 0, 1, 2


class Mode(enum.Enum):
    FRESH = "fresh"
    LIVE = "live"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class RankStatus:
    holds: bool
    trust: int
    version: int
    commit_version: int

    def as_row(self) -> list[int]:
        return [int(self.holds), self.trust, self.version, self.commit_version]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "RankStatus":
        holds, trust, version, commit_version = (int(x) for x in row)
        if trust not in (CONSISTENT, WHOLE, DIRTY):
            raise ValueError(f"unknown trust code {trust}")
        return cls(bool(holds), trust, version, commit_version)


@dataclass(frozen=True)
class SyncDecision:
    root: int
    mode: Mode


def failure_trust(linked: bool, surfaced_whole: bool, inside_apply: bool) -> int:
    """How a rank's live state came out of a failed collective (``WHOLE`` or ``DIRTY``).

    * ``linked``: the state's sampler advances with its DistributedOptimizer's apply
      (:mod:`state.step_link`), so applied steps and recorded batches agree everywhere but inside
      the apply;
    * ``surfaced_whole``: the failure surfaced where the state is whole whatever the loop: in the
      optimizer's gradient reduction (before anything is applied), a commit's agreement, a sync or
      a re-form (``CommError.live_state_consistent``);
    * ``inside_apply``: it surfaced inside the wrapped optimizer's own ``step()`` (an optimizer that
      runs collectives of its own): parameters may be half updated.

    Whole: not inside the apply, and either linked (any collective of the loop, the user's own
    included, falls between two applies) or surfaced where the state is whole. Dirty: inside the
    apply, or a collective of the user's own in a state whose batch bookkeeping is not linked to
    the optimizer (no ElasticSampler, no or several DistributedOptimizers): the user's counters may
    then be one step apart from the model.
    """
    if inside_apply:
        return DIRTY
    return WHOLE if linked or surfaced_whole else DIRTY


def decide_sync(ranks: Sequence[RankStatus]) -> SyncDecision:
    """The sync's root and mode for the ring whose rank ``r`` reported ``ranks[r]``."""
    if not ranks:
        raise ValueError("a ring has at least one rank")
    holders = [r for r, s in enumerate(ranks) if s.holds]
    if not holders:
        return SyncDecision(0, Mode.FRESH)
    whole = [r for r in holders if ranks[r].trust != DIRTY]
    if whole:
        return SyncDecision(max(whole, key=lambda r: (ranks[r].version, -r)), Mode.LIVE)
    return SyncDecision(max(holders, key=lambda r: (ranks[r].commit_version, -r)), Mode.ROLLBACK)
