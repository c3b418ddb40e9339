"""``hvd.elastic``: Horovod's elastic API over elastic_ring's elastic loop and ``state``.

``run`` is ``elastic_ring.ring.elastic.run``; ``State``, ``ObjectState`` and
``TorchState`` are the state layer's (``TorchState(model, optimizer, **values)``
as in Horovod, with ``commit()``, ``sync()`` and ``register_reset_callbacks``);
``ElasticSampler`` is the state layer's exactly-once sampler. Unlike Horovod's,
it is a *batch* sampler: ``DataLoader(ds, batch_sampler=ElasticSampler(ds,
batch_size=B))``; given Horovod's way (``sampler=`` plus ``batch_size=``), it
raises a TypeError that says this.
"""

from __future__ import annotations

from elastic_ring.ring.elastic import run
from state import ElasticSampler, ObjectState, State, TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
