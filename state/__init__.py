"""state: commit / restore / sync of training state, durable checkpoints, the elastic sampler.

Uses ``elastic_ring`` only (never Ray, never ``ray_integration``).
"""

from .checkpoint_policy import CheckpointConfig
from .checkpoint_store import CheckpointError, CheckpointStore
from .membership import (
    TrainingStopped, clear_membership_change, membership_change_requested, request_membership_change, request_stop,
)
from .sampler import ElasticSampler
from .state import State, set_default_checkpointing, set_resume_listener
from .torch_state import ObjectState, TorchState

__all__ = [
    "CheckpointConfig", "CheckpointError", "CheckpointStore", "ElasticSampler", "ObjectState", "State",
    "TorchState", "TrainingStopped", "clear_membership_change", "request_stop", "set_default_checkpointing", "set_resume_listener", "membership_change_requested", "request_membership_change",
]
