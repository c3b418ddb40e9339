"""Ray Train's ``get_preemption_info()`` inside the training function.

``ElasticTrainer``'s workers answer it with Ray Train's own ``ray.train.PreemptionInfo`` (``deadline_ms``,
``preempted_node_to_ranks``, ``preempted_node_ids``, ``preempted_ranks``; elastic_ring's ``Preemption``, with the same
fields, when the script does not use ``ray.train``) while a node hosting a rank of the ring drains, else ``None``; it is elastic_ring's ``er.get_preemption_info()`` (one implementation), a collective as Ray
Train's is. What it buys a script: a just-in-time report of its own, e.g.::

    info = get_preemption_info()
    if info is not None and not saved:
        report(metrics, checkpoint=Checkpoint.from_directory(tmp))   # the run resumes from it if it must
        saved = True

The job's own state needs no such code: the driver writes it durably before the deadline by itself, timed from
the measured write (docs/elasticity.md, "Preemption notices").
"""

from __future__ import annotations

from typing import Any

from elastic_ring.collectives.preemption import get_preemption_info as _ring_preemption_info


def get_preemption_info() -> Any:
    """``None`` until a node hosting a rank of this ring is being preempted; then a ``ray.train.PreemptionInfo``
    (the earliest deadline in UNIX ms, and the ranks on each preempted node). Call it on every rank, the same
    number of times: like Ray Train's, it is a collective, and every rank gets the same answer."""
    return _ring_preemption_info()
