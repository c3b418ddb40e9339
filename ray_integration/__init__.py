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


def get_dataset_shard(dataset_name: str | None = None, **options):
    """Ray Train's ``get_dataset_shard(dataset_name)``: this worker's part of ``ElasticTrainer(datasets={name:
    ...})``; ``options`` as :func:`ray_integration.data.get_dataset_shard` takes them (imported when first called).
    ``name=`` (this function's keyword before) is accepted too."""
    from .data import get_dataset_shard as shard

    if "name" in options:
        if dataset_name is not None:
            raise TypeError(f"get_dataset_shard got dataset_name={dataset_name!r} and name={options['name']!r}; "
                            "give one (dataset_name, as Ray Train's)")
        dataset_name = options.pop("name")
    if dataset_name is None:
        raise TypeError("get_dataset_shard() needs the dataset's name: get_dataset_shard('train') for "
                        "ElasticTrainer(datasets={'train': ds})")
    return shard(dataset_name, **options)


__all__ = ["ElasticTrainer", "Event", "Result", "RunFailed", "TrainContext", "TrainerConfig", "WorkerError",
           "get_checkpoint", "get_context", "get_dataset_shard", "load_checkpoint", "report"]
