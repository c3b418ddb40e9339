"""What the ring's members are told of their nodes' drains: the answer of ``get_preemption_info()`` in ``fn``.

Ray Train's ``PreemptionInfo``: the earliest deadline (Ray's own value, UNIX milliseconds, passed on untouched:
the driver never turns a worker's clock into its own or back) and, for each draining node, the ranks of the current
ring on it. :class:`Preemption` makes a new numbered notice whenever that changes (a node begins draining, the ring
re-forms and its ranks move, the leavers are gone); the loop pushes it to every member's queue (inside a notice of
the same step when there is one: a drain's), and the members agree on the newest one when ``fn`` asks
(``elastic_ring.collectives.preemption``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .formation import Ring


class Preemption:
    def __init__(self) -> None:
        self.seq = 0
        self._last: tuple | None = None

    def notice(self, ring: Ring | None, records: Mapping[str, Any], draining: Mapping[str, int]) -> dict | None:
        """The notice to send the ring's members now, or None when they know it already (or there is nothing
        to say: no member was ever on a draining node)."""
        nodes: dict[str, list[int]] = {}
        if ring is not None:
            for rank, worker_id in enumerate(ring.worker_ids):
                record = records[worker_id]
                if record.node_id in draining and not record.dead and not record.finished:
                    nodes.setdefault(record.node_id, []).append(rank)
        deadlines = [draining[node] for node in nodes if draining[node]]
        key = (ring.round_id if ring is not None else 0, min(deadlines) if deadlines else None,
               tuple(sorted((node, tuple(ranks)) for node, ranks in nodes.items())))
        if key == self._last or (not nodes and (self._last is None or not self._last[2])):
            self._last = key
            return None
        self._last = key
        self.seq += 1
        return {"seq": self.seq, "deadline_ms": key[1], "nodes": nodes}
