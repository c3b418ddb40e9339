"""The pure decisions about a series of checkpoints: their names, their order (which one is newest), the next
number to claim, and what to prune. Plain functions of their arguments (no I/O), tested with tables in
``tests/test_checkpoint_policy.py``.

:func:`order_key` is *the* order of checkpoints: loading takes the newest first, ``Result.checkpoint`` names the
newest, and pruning keeps the newest ``keep_last``; all of them ask :func:`by_age`. Today a checkpoint's age is its
sequence number (the order in which writes claimed their numbers).
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


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory as listing and pruning see it: complete once its manifest exists."""

    seq: int
    run_id: str | None = None
    complete: bool = True


def order_key(entry: Entry) -> tuple:
    """How checkpoints are ordered, oldest first (the one place to change it)."""
    return (entry.seq,)


def by_age(entries: Iterable[Entry]) -> list[Entry]:
    """The complete ones among ``entries``, oldest first: the last is the newest checkpoint."""
    return sorted((e for e in entries if e.complete), key=order_key)


def plan_prune(entries: list[Entry], newest: int, run_id: str | None, keep_last: int,
               lease_held: bool) -> list[int]:
    """Sequence numbers to delete after checkpoint ``newest`` was written and verified.

    * Never ``newest`` itself, and never anything claimed after it (another writer's, possibly in flight).
    * Candidates are this run's directories; with ``lease_held`` (the location's lease names this
      run, so no other run is live) every run's.
    * Among candidates up to ``newest``, the ``keep_last`` newest complete ones (:func:`by_age`) are kept;
      older complete ones are deleted, and so are incomplete ones (failed writes, interrupted prunes).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    candidates = [e for e in entries if e.seq <= newest and (lease_held or (run_id is not None and e.run_id == run_id))]
    keep = {e.seq for e in by_age(candidates)[-keep_last:]} | {newest}
    return sorted(e.seq for e in candidates if e.seq < newest and e.seq not in keep)


def next_sequence(existing: list[int]) -> int:
    """The sequence number to claim next: one past every directory seen (complete or not)."""
    return max(existing, default=0) + 1
