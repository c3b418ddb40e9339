"""ray_integration: the membership driver, the worker actors and ``ElasticTrainer``.

Uses ``elastic_ring`` and ``state``.
"""


def _shadowing():
    """``elastic_ring.shadowing``, loaded from its file beside this package: the name ``elastic_ring`` may
    be a user's file, and importing it would run that file and fail on it."""
    import importlib.util
    import os
    import sys

    name = "elastic_ring.shadowing"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elastic_ring", "shadowing.py")
    if not os.path.isfile(path):  # the packages do not sit side by side (runtime_env py_modules): import it
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # one copy, whichever way it is reached (elastic_ring/__init__ binds it)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_shadowing().check("elastic_ring", "state")  # before importing them: a user's state.py would take a name
del _shadowing


from .config import TrainerConfig
from .driver import RunFailed
from .events import Event
from .result import Result
from .train_api import TrainContext, get_checkpoint, get_context, load_checkpoint, report
from .trainer import ElasticTrainer
from .worker import WorkerError


def get_dataset_shard(name: str, **options):
    """Ray Train's ``get_dataset_shard(name)``: this worker's part of ``ElasticTrainer(datasets={name: ...})``;
    ``options`` as :func:`ray_integration.data.get_dataset_shard` takes them (imported when first called)."""
    from .data import get_dataset_shard as shard

    return shard(name, **options)


__all__ = ["ElasticTrainer", "Event", "Result", "RunFailed", "TrainContext", "TrainerConfig", "WorkerError",
           "get_checkpoint", "get_context", "get_dataset_shard", "load_checkpoint", "report"]
