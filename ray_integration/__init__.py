"""ray_integration: the membership driver, the worker actors and ``ElasticTrainer``.

Uses ``elastic_ring`` and ``state``.
"""

from .config import TrainerConfig
from .driver import RunFailed
from .events import Event
from .trainer import ElasticTrainer, Result
from .worker import WorkerError

__all__ = ["ElasticTrainer", "Event", "Result", "RunFailed", "TrainerConfig", "WorkerError"]
