"""Deciding the next ring: typed membership records and a pure function from them to ranks.

Keeping this free of Ray and of I/O lets the rules be tested with tables:

* ranks are contiguous per node, so the ring crosses each node boundary once;
* nodes are ordered oldest first (a node's age is that of its oldest member);
* rank 0 is a survivor that holds committed state (never a joiner), so
  ``state.sync()`` from rank 0 hands everyone the committed state: the node
  of the oldest stateful member comes first, and within every node stateful
  members come before joiners, oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from elastic_ring.core.spec import RingSpec, placements


@dataclass(frozen=True)
class Member:
    """A live worker as the driver knows it."""

    worker_id: str
    node_id: str
    joined_seq: int       # order in which workers became ready: smaller is older
    has_state: bool       # True once it completed a sync (holds the committed state)


@dataclass(frozen=True)
class Ring:
    """One round: who has which rank."""

    round_id: int
    worker_ids: tuple[str, ...]   # indexed by rank
    node_ids: tuple[str, ...]     # node of each rank

    @property
    def world_size(self) -> int:
        return len(self.worker_ids)

    def rank_of(self, worker_id: str) -> int:
        return self.worker_ids.index(worker_id)


def form_ring(members: list[Member], round_id: int) -> Ring:
    """The ring of ``members`` for round ``round_id`` (see the module docstring for the rules)."""
    if not members:
        raise ValueError("cannot form a ring of no members")
    ids = [m.worker_id for m in members]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate worker ids in {ids}")
    by_node: dict[str, list[Member]] = {}
    for m in members:
        by_node.setdefault(m.node_id, []).append(m)
    stateful = [m for m in members if m.has_state]
    anchor = min(stateful, key=lambda m: m.joined_seq).node_id if stateful else None

    def node_key(node: str) -> tuple[int, int, str]:
        return (0 if node == anchor else 1, min(m.joined_seq for m in by_node[node]), node)

    ordered: list[Member] = []
    for node in sorted(by_node, key=node_key):
        ordered += sorted(by_node[node], key=lambda m: (not m.has_state, m.joined_seq, m.worker_id))
    return Ring(round_id=round_id, worker_ids=tuple(m.worker_id for m in ordered),
                node_ids=tuple(m.node_id for m in ordered))


def parent_ranks(parent: Ring | None, ring: Ring) -> tuple[int, ...] | None:
    """For each rank of ``ring``, its rank in ``parent`` (-1 for a newcomer); None without a parent or when
    nobody of the parent is in ``ring``. What an NCCL ring needs to shrink or grow instead of a full init."""
    if parent is None:
        return None
    old = {w: rank for rank, w in enumerate(parent.worker_ids)}
    ranks = tuple(old.get(w, -1) for w in ring.worker_ids)
    return ranks if any(r >= 0 for r in ranks) else None


def ring_specs(ring: Ring, parent: Ring | None, lineage: bool, bind_hosts: Sequence[str | None],
               **common: Any) -> list[RingSpec]:
    """Each rank's answer for ``ring``: its own :class:`~elastic_ring.Placement` (node, local and cross rank and
    size), never the node table, so that an answer's size and its validation do not grow with the ring; the node
    table is computed once (O(n)). ``lineage``: name the parent round and each rank's rank in it (an NCCL
    ``shrink_grow`` ring); ``bind_hosts``: each rank's address; ``common``: the fields every rank shares."""
    ranks = parent_ranks(parent, ring) if lineage else None
    places = placements(ring.node_ids)
    first = RingSpec(round_id=ring.round_id, rank=0, world_size=ring.world_size, bind_host=bind_hosts[0],
                     **places[0]._asdict(), parent_round=parent.round_id if ranks else None, parent_ranks=ranks,
                     **common)  # validated in full once; each rank's own values by for_each_rank
    return first.for_each_rank(places, bind_hosts)
