"""``er.get_preemption_info()``: the warning before some of the ring's nodes are reclaimed, as Ray Train's.

This package knows nothing of Ray. What a rank knows of its ring's preemptions is *posted* from above (the Ray
worker runtime posts the driver's notices: :func:`post`), and what the call returns is *made* by a function installed
from above (:func:`install`: ``ElasticTrainer``'s workers make Ray Train's ``ray.train.PreemptionInfo``, the type its
users know). Without one, it is :class:`Preemption`, with the same fields and properties.

Like Ray Train's, the call is a collective: every rank calls it the same number of times and all get the same
answer, the newest notice any rank holds (one tiny MAX agreement on the notices' numbers; only when there is one,
the notices themselves, authenticated). ``None`` until a node hosting a rank of the ring drains, and again once no
rank of the ring is on a draining node. Outside a ring it answers this process's own notice.

A notice is ``{"seq": n, "deadline_ms": ms or None, "nodes": {node_id: [ranks]}}``; ``deadline_ms`` is the earliest
drain deadline, as the cluster gave it (UNIX milliseconds: compare it with the time of a clock you trust, or better,
react at once: the driver writes the state durably before the deadline by itself).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..ring import runtime
from .objects import allgather_object
from .tensors import agree_max


@dataclass(frozen=True)
class Preemption:
    """What :func:`get_preemption_info` returns when nothing else is installed: Ray Train's fields."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]

    @property
    def preempted_node_ids(self) -> list[str]:
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})


def _default(deadline_ms: int | None, node_to_ranks: dict[str, list[int]]) -> Any:
    return Preemption(deadline_ms, node_to_ranks)


_lock = threading.Lock()
_notice: dict | None = None
_make: Callable[[int | None, dict[str, list[int]]], Any] = _default


def post(notice: dict | None) -> None:
    """This rank's newest notice (any thread); an older one than it holds is ignored. None forgets it."""
    global _notice
    if notice is not None and not (isinstance(notice, dict) and isinstance(notice.get("seq"), int)
                                   and isinstance(notice.get("nodes"), dict)):
        raise TypeError(f"a preemption notice is a dict with 'seq', 'deadline_ms' and 'nodes', got {notice!r}")
    with _lock:
        if notice is None or _notice is None or notice["seq"] > _notice["seq"]:
            _notice = notice


def install(make: Callable[[int | None, dict[str, list[int]]], Any] | None) -> None:
    """What :func:`get_preemption_info` returns is ``make(deadline_ms, node_to_ranks)`` (None: :class:`Preemption`);
    installing also forgets any notice of an earlier job."""
    global _make
    _make = make or _default
    post(None)


def _local() -> dict | None:
    with _lock:
        return _notice


def get_preemption_info() -> Any:
    """``None`` while no node hosting a rank of this ring is being preempted; else the preemption: its earliest
    deadline (``deadline_ms``, UNIX ms, None if the cluster gave none) and the ranks on each preempted node
    (``preempted_node_to_ranks``, ``preempted_node_ids``, ``preempted_ranks``). A collective: call it on every
    rank, the same number of times (as Ray Train's)."""
    notice = _local()
    comm = runtime.current_or_none()
    if comm is not None and comm.size > 1:
        newest = agree_max("get_preemption_info", [notice["seq"] if notice else 0])[0]
        if newest == 0:
            return None
        notices = allgather_object(notice, name="get_preemption_info")
        notice = next(n for n in notices if isinstance(n, dict) and n.get("seq") == newest)
    if notice is None or not notice["nodes"]:
        return None
    nodes = {str(node): sorted(int(r) for r in ranks) for node, ranks in notice["nodes"].items()}
    deadline = notice.get("deadline_ms")
    return _make(int(deadline) if deadline else None, nodes)
