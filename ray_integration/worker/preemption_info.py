"""What ``get_preemption_info()`` returns in an ``ElasticTrainer`` worker: Ray Train's own ``ray.train.PreemptionInfo``
(the type Ray Train's users know) when the script uses ``ray.train`` (it is imported in the worker), else
elastic_ring's :class:`~elastic_ring.collectives.preemption.Preemption`, with the same fields and properties.
Importing ``ray.train`` takes seconds of CPU; it is never done here, at the notice, on a node about to go."""

from __future__ import annotations

import sys
from typing import Any

from elastic_ring.collectives.preemption import Preemption


def preemption_info(deadline_ms: int | None, node_to_ranks: dict[str, list[int]]) -> Any:
    ray_train = sys.modules.get("ray.train")
    ray_type = getattr(ray_train, "PreemptionInfo", None) if ray_train is not None else None
    if ray_type is None:  # the script does not use ray.train (or a Ray without the class)
        return Preemption(deadline_ms, node_to_ranks)
    return ray_type(deadline_ms=deadline_ms, preempted_node_to_ranks=node_to_ranks)
