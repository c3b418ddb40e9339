"""``ray_integration.train``: Ray Train's calls inside the training function, as ``ray.train`` names them.

    from ray_integration.train import get_checkpoint, get_context, get_dataset_shard, report

* ``report(metrics, checkpoint=None)``: Ray Train's report (a dict of metrics, and optionally a
  ``ray.train.Checkpoint`` of a local directory, uploaded by rank 0 in the background). Rank 0's metrics reach
  ``Result.metrics`` by the path of ``er.report(**metrics)``, elastic_ring's own report (the one other report).
* ``get_checkpoint()``: the newest reported checkpoint of the run's location, in a local directory (or None).
* ``get_context()``: a :class:`TrainContext`, this worker's place in the current ring.
* ``get_dataset_shard(name)``: this worker's part of ``ElasticTrainer(datasets={name: ds})``.

It owns Ray Train's layer: these calls (private modules ``_report``, ``_checkpoint``, ``_context``,
``_dataset``) and the translation of Ray Train's ``ScalingConfig`` / ``RunConfig`` into ``ElasticTrainer``'s
options (``_config``). It may import ``ray_integration.data`` (the dataset shards) and nothing else of
ray_integration; the trainer (the front door) imports it. Reading a run's checkpoints on the driver afterwards
is :func:`ray_integration.load_checkpoint`.
"""

from ._checkpoint import get_checkpoint
from ._context import TrainContext, get_context
from ._dataset import get_dataset_shard
from ._preemption import get_preemption_info
from ._report import report

__all__ = ["TrainContext", "get_checkpoint", "get_context", "get_dataset_shard", "get_preemption_info", "report"]
