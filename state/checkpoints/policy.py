"""The pure decisions about a series of checkpoints: their names, their order (which one is newest), the next
number to claim, and what to prune. Plain functions of their arguments (no I/O), tested with tables in
``tests/test_checkpoint_policy.py``.

:func:`order_key` is *the* order of checkpoints: loading takes the newest first, ``Result.checkpoint`` names the
newest, and pruning keeps the newest ``keep_last``; all of them ask :func:`by_age`. "Newest" means the newest
*state*, not the latest write: a state checkpoint's manifest carries the state's order (:class:`StateOrder`: its
lineage, the round of the commit, the state's version), and checkpoints are ordered by it, then by sequence number.
A late write of an older state (a leaving rank 0's queued write that lands after the new rank 0's) therefore never
becomes the newest and never prunes a newer one. A checkpoint without an order (written before the order existed, or
a reported checkpoint) sorts below every ordered one, and among its kind by sequence number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

_DIR = re.compile(r"^ckpt-(\d{12})$")


def checkpoint_dir(seq: int) -> str:
    """The base name of checkpoint ``seq``'s directory (7 -> ``ckpt-000000000007``)."""
    return f"ckpt-{seq:012d}"


def parse_checkpoint_dir(name: str) -> int | None:
    """The sequence number of a checkpoint directory's base name (``ckpt-000000000007`` -> 7), else None.
    Anchored: ``old-ckpt-000000000005`` or ``ckpt-000000000005.bak`` are not checkpoints."""
    match = _DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, order=True)
class StateOrder:
    """Where a state checkpoint's commit stands in the job's history, compared field by field.

    * ``lineage``: how many resumes from a checkpoint lie behind this state (a run that resumes from a checkpoint
      of lineage ``n`` writes ``n + 1``): every later run's states are newer, though its round ids start again.
    * ``round_id``: the ring's round when the commit was taken: a later round continues the history (its state
      came from the newest live state or the newest commit at its sync), so a write of an earlier round is older.
    * ``version``: how far the state got in that round (one per applied step and per commit).
    """

    lineage: int
    round_id: int
    version: int

    def as_list(self) -> list[int]:
        return [self.lineage, self.round_id, self.version]

    @classmethod
    def parse(cls, value: object) -> "StateOrder | None":
        """A manifest's ``order`` field, or None when it is missing or malformed (a checkpoint without one)."""
        if isinstance(value, (list, tuple)) and len(value) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            return cls(*value)
        return None


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory as listing and pruning see it: complete once its manifest exists; ``order``: the
    state's order from its manifest (None: a checkpoint without one)."""

    seq: int
    run_id: str | None = None
    complete: bool = True
    order: StateOrder | None = None


def order_key(entry: Entry) -> tuple:
    """How checkpoints are ordered, oldest first (the one place to change it): by the state's order, then by
    sequence number; those without an order before all others."""
    if entry.order is None:
        return (0, (), entry.seq)
    return (1, (entry.order.lineage, entry.order.round_id, entry.order.version), entry.seq)


def by_age(entries: Iterable[Entry]) -> list[Entry]:
    """The complete ones among ``entries``, oldest first: the last is the newest checkpoint."""
    return sorted((e for e in entries if e.complete), key=order_key)


def plan_prune(entries: list[Entry], newest: int, run_id: str | None, keep_last: int,
               lease_held: bool) -> list[int]:
    """Sequence numbers to delete after checkpoint ``newest`` was written and verified.

    * Never ``newest`` itself, and never anything claimed after it (another writer's, possibly in flight).
    * Candidates are this run's directories; with ``lease_held`` (the location's lease names this
      run, so no other run is live) every run's.
    * Among candidates up to ``newest``, the ``keep_last`` newest complete ones (:func:`by_age`, the state's order)
      are kept; older complete ones are deleted, and so are incomplete ones (failed writes, interrupted prunes).
      ``newest`` is the number just written, not necessarily the newest state: a late write of an older state
      keeps the newer ones (it is itself removed by a later prune).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    candidates = [e for e in entries if e.seq <= newest and (lease_held or (run_id is not None and e.run_id == run_id))]
    keep = {e.seq for e in by_age(candidates)[-keep_last:]} | {newest}
    return sorted(e.seq for e in candidates if e.seq < newest and e.seq not in keep)


def next_sequence(existing: list[int]) -> int:
    """The sequence number to claim next: one past every directory seen (complete or not)."""
    return max(existing, default=0) + 1
