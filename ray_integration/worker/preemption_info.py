"""What ``get_preemption_info()`` returns in an ``ElasticTrainer`` worker: Ray Train's own ``ray.train.PreemptionInfo``
(the type Ray Train's users know; imported when first made, since importing ``ray.train`` is slow), or elastic_ring's
:class:`~elastic_ring.collectives.preemption.Preemption`, with the same fields, where Ray has no such class."""

from __future__ import annotations

from typing import Any

from elastic_ring.collectives.preemption import Preemption


def prepare() -> None:
    """Import Ray Train's class now (importing ``ray.train`` takes seconds: better in the thread that receives the
    driver's notice than in fn's call of the collective, where every other rank would wait for it)."""
    try:
        import ray.train  # noqa: F401
    except ImportError:
        pass


def preemption_info(deadline_ms: int | None, node_to_ranks: dict[str, list[int]]) -> Any:
    try:
        from ray.train import PreemptionInfo
    except ImportError:  # a Ray without it (before 2.60), or without ray.train's extras
        return Preemption(deadline_ms, node_to_ranks)
    return PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks=node_to_ranks)
