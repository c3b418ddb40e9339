"""state: commit / restore / sync of training state, durable checkpoints, the elastic sampler.

Uses ``elastic_ring`` only (never Ray, never ``ray_integration``).
"""

from .checkpoint_errors import CheckpointCorrupt, CheckpointError, CheckpointRefused
from .checkpoint_lease import CheckpointLease
from .checkpoint_policy import CheckpointConfig, check_checkpoint_uri
from .checkpoint_store import CheckpointStore
from .checkpoint_writer import flush_checkpoints, set_checkpoint_listener
from .membership import (
    TrainingStopped, clear_membership_change, membership_change_requested, request_membership_change, request_stop,
)
from .sampler import ElasticSampler
from .state import State, set_default_checkpointing, set_resume_listener
from .torch_state import ObjectState, TorchState

__all__ = [
    "CheckpointConfig", "CheckpointCorrupt", "CheckpointError", "CheckpointLease", "CheckpointRefused",
    "CheckpointStore", "ElasticSampler", "ObjectState", "State", "TorchState", "TrainingStopped",
    "check_checkpoint_uri", "clear_membership_change", "flush_checkpoints", "membership_change_requested",
    "request_membership_change", "request_stop", "set_checkpoint_listener", "set_default_checkpointing",
    "set_resume_listener",
]
