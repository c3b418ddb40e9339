"""state: commit / restore / sync of training state, durable checkpoints, the elastic samplers.

What a training script calls is exported here: :class:`State`, :class:`TorchState`, :class:`ObjectState`,
:class:`ElasticSampler`, :class:`ElasticStream`, :class:`CheckpointConfig`, :func:`flush_checkpoints` and the public
errors (:mod:`state.errors`). The plumbing is imported from the module that owns it (the worker runtime's hooks:
``state.checkpoints.config.set_default_checkpointing``, ``state.checkpoints.hooks.set_checkpoint_listener``,
``state.state.set_resume_listener``; the stores and the lease: ``state.checkpoints.store.CheckpointStore``,
``state.checkpoints.reported.ReportedCheckpoints``, ``state.checkpoints.lease.CheckpointLease``; the notices:
``state.membership``).

The core sits at the root (``state.py``, ``torch_state.py``, ``handlers.py``, ``snapshot.py``, ``recovery.py``,
``membership.py``, ``step_link.py``, ``errors.py``) and may import both sub-packages: :mod:`state.samplers`
(positions in the data) and :mod:`state.checkpoints` (durable checkpoints), which never import the core but its
leaves ``errors.py`` and ``snapshot.py`` (see their docstrings and ``tests/test_layering.py``). Uses
``elastic_ring`` only (never Ray, never ``ray_integration``).
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


_shadowing().check("elastic_ring")  # before importing it: a user's elastic_ring.py would take its name
del _shadowing


from .checkpoints.config import CheckpointConfig
from .checkpoints.hooks import flush_checkpoints
from .errors import (
    CheckpointCorrupt, CheckpointError, CheckpointLeaseLost, CheckpointRefused, StateError, TrainingStopped,
)
from .samplers.sampler import ElasticSampler
from .samplers.stream import ElasticStream
from .state import State
from .torch_state import ObjectState, TorchState

__all__ = [
    "CheckpointConfig", "CheckpointCorrupt", "CheckpointError", "CheckpointLeaseLost", "CheckpointRefused",
    "ElasticSampler", "ElasticStream", "ObjectState", "State", "StateError", "TorchState", "TrainingStopped",
    "flush_checkpoints",
]
