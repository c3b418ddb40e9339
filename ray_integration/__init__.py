"""ray_integration: ``ElasticTrainer`` on Ray, its driver and its worker actors. Uses ``elastic_ring`` and ``state``.

The root is the front door, what a user calls: :class:`ElasticTrainer` (:mod:`.trainer`), its options
:class:`TrainerConfig` (:mod:`.config`), what a run returns (:class:`Result`, :mod:`.result`, with its
:class:`Event` history), :func:`load_checkpoint` (a run's checkpoints, afterwards), the launcher
(``python -m ray_integration.launch``) and every public error (:mod:`.errors`, under
:class:`RayIntegrationError`). The sub-packages, each importing only those below it (``tests/test_layering.py``)::

    trainer, result, launch          the front door: may import everything below
    driver/                          the membership driver (the driver's process)
    worker/                          the worker actor and its rendezvous (each worker's process)
    train/   horovod/                Ray Train's and Horovod's APIs inside fn
    data/    wire/                   Ray Data input; the driver <-> worker contract
    config, errors                   the options and the errors: import nothing of ray_integration

Ray Train's calls inside ``fn`` (``report``, ``get_checkpoint``, ``get_context``, ``get_dataset_shard``) are
``ray_integration.train``'s; Horovod's API is ``ray_integration.horovod``.
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
from .driver.events import Event
from .errors import RayIntegrationError, RunFailed, WorkerError
from .result import Result
from .train._checkpoint import load_checkpoint
from .trainer import ElasticTrainer

__all__ = ["ElasticTrainer", "Event", "RayIntegrationError", "Result", "RunFailed", "TrainerConfig", "WorkerError",
           "load_checkpoint"]

