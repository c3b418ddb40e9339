"""``ray_integration.train``: ``ray.train`` for a Ray Train script that imports it instead.

    import ray_integration.train as train                       # was: import ray.train as train
    from ray_integration.train import Checkpoint, RunConfig, ScalingConfig
    from ray_integration.train.torch import TorchTrainer        # was: from ray.train.torch import TorchTrainer

* The calls inside the training function: ``report(metrics, checkpoint=None, ...)`` (Ray Train's signature),
  ``get_checkpoint()``, ``get_context()`` (a :class:`TrainContext`), ``get_dataset_shard(name)``,
  ``get_preemption_info()`` (Ray Train's ``PreemptionInfo`` of this worker's node, or None). Under the drop-in
  ``TorchTrainer`` (:mod:`ray_integration.train.torch`) they follow Ray Train V2's semantics on an elastic ring
  (:mod:`._dropin`); under ``ElasticTrainer`` they are its Ray Train layer (docs/ray_train.md).
* Ray's own classes, re-exported (not copied; imported when first named, so importing ``ray_integration`` does
  not import ``ray.train``): ``Checkpoint``, ``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
  ``CheckpointConfig``, ``CheckpointUploadMode``, ``DataConfig``, ``Result`` (what ``TorchTrainer.fit()`` returns)
  and the errors ``fit()`` raises: ``TrainingFailedError``, ``WorkerGroupError``, ``ControllerError``.
* ``torch``: :mod:`ray_integration.train.torch` (``TorchTrainer``, ``prepare_model``, ``prepare_data_loader``...).

It owns Ray Train's layer: these calls (private modules ``_report``, ``_checkpoint``, ``_context``, ``_dataset``,
``_dropin`` and ``_held`` for the drop-in's re-entry and checkpoints, ``_model``, ``_loader``, ``_devices`` for
``ray.train.torch``'s helpers) and the translation of Ray Train's ``ScalingConfig`` / ``RunConfig`` into
``ElasticTrainer``'s options (``_config``). It may import ``ray_integration.data`` and nothing else of
ray_integration; the trainer (the front door) and ``ray_integration.train.torch`` (a front door too) import it.
Reading a run's checkpoints on the driver afterwards is :func:`ray_integration.load_checkpoint`.
"""

from ._context import TrainContext, get_context
from ._dataset import get_dataset_shard
from ._dropin import get_checkpoint
from ._preemption import get_preemption_info
from ._report import report

#: Ray's own names, re-exported from ``ray.train`` when first used.
_FROM_RAY = ("Checkpoint", "CheckpointConfig", "CheckpointUploadMode", "ControllerError", "DataConfig",
             "FailureConfig", "Result", "RunConfig", "ScalingConfig", "TrainingFailedError", "WorkerGroupError")


def __getattr__(name: str):
    if name in _FROM_RAY:
        import ray.train

        return getattr(ray.train, name)
    if name == "get_all_reported_checkpoints":
        raise AttributeError("ray_integration.train has no get_all_reported_checkpoints (Ray Train V2's list of every "
                             "reported checkpoint during a run): read them after fit() from Result.best_checkpoints")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Checkpoint", "CheckpointConfig", "CheckpointUploadMode", "ControllerError", "DataConfig",
           "FailureConfig", "Result", "RunConfig", "ScalingConfig", "TrainContext", "TrainingFailedError",
           "WorkerGroupError", "get_checkpoint", "get_context", "get_dataset_shard", "get_preemption_info",
           "report"]
