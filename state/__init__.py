"""state: commit / restore / sync of training state, durable checkpoints, the elastic sampler.

Uses ``elastic_ring`` only (never Ray, never ``ray_integration``).
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


from .checkpoint_errors import CheckpointCorrupt, CheckpointError, CheckpointLeaseLost, CheckpointRefused
from .checkpoint_lease import CheckpointLease
from .checkpoint_policy import CheckpointConfig, check_checkpoint_uri
from .checkpoint_store import CheckpointStore
from .checkpoint_writer import flush_checkpoints, set_checkpoint_listener
from .reported_checkpoints import ReportedCheckpoints
from .membership import (
    TrainingStopped, clear_membership_change, membership_change_requested, request_membership_change, request_stop,
)
from .sampler import ElasticSampler
from .stream import ElasticStream
from .state import State, default_checkpointing, set_default_checkpointing, set_resume_listener
from .torch_state import ObjectState, TorchState

__all__ = [
    "CheckpointConfig", "CheckpointCorrupt", "CheckpointError", "CheckpointLeaseLost", "CheckpointLease", "CheckpointRefused",
    "CheckpointStore", "ElasticSampler", "ElasticStream", "ObjectState", "ReportedCheckpoints", "State", "TorchState", "TrainingStopped",
    "check_checkpoint_uri", "clear_membership_change", "default_checkpointing", "flush_checkpoints", "membership_change_requested",
    "request_membership_change", "request_stop", "set_checkpoint_listener", "set_default_checkpointing",
    "set_resume_listener",
]
