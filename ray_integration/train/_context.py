"""Ray Train's ``get_context()`` inside the training function: this worker's place in the current ring."""

from __future__ import annotations

import posixpath

import elastic_ring as er
from elastic_ring.ring import runtime as ring_runtime
from state.checkpoints.config import default_checkpointing as default_config


class TrainContext:
    """Ray Train's ``get_context()``: this worker's place in the current ring (after a re-form, the new ring's)."""

    def get_world_rank(self) -> int:
        return er.rank()

    def get_world_size(self) -> int:
        return er.size()

    def get_local_rank(self) -> int:
        return er.local_rank()

    def get_local_world_size(self) -> int:
        return er.local_size()

    def get_node_rank(self) -> int:
        """The index of this worker's node among the ring's nodes (in rank order: rank 0's node is 0)."""
        er.size()  # forms the ring if it is not formed yet
        return ring_runtime.current().spec.placement.node_rank

    def get_experiment_name(self) -> str | None:
        """RunConfig's ``name``: the last part of the run's location (None without one)."""
        config = default_config()
        return None if config is None else posixpath.basename(config.uri.rstrip("/"))

    # Ray Train V2 raises DeprecationWarning for V1's Tune-era names
    def get_metadata(self) -> None:
        _deprecated("get_metadata")

    def get_trial_name(self) -> None:
        _deprecated("get_trial_name", "get_experiment_name()")

    def get_trial_id(self) -> None:
        _deprecated("get_trial_id")

    def get_trial_resources(self) -> None:
        _deprecated("get_trial_resources")

    def get_trial_dir(self) -> None:
        _deprecated("get_trial_dir", "get_storage_path()")

    def get_storage(self) -> None:
        """Ray Train V2's ``get_storage()`` (a ``StorageContext``, Ray's developer API) has no equivalent here."""
        raise NotImplementedError("TrainContext.get_storage() (Ray Train's StorageContext) is not available here: "
                                  "get_context().get_storage_path() is the run's location (storage_path/name), and "
                                  "get_checkpoint() / report(checkpoint=...) read and write checkpoints there")

    def get_storage_path(self) -> str | None:
        """The run's location (``storage_path/name``), or None."""
        config = default_config()
        return None if config is None else config.uri


def _deprecated(name: str, instead: str | None = None) -> None:
    hint = f"; use get_context().{instead}" if instead else ""
    raise DeprecationWarning(f"TrainContext.{name}() is deprecated in Ray Train V2 and is not available{hint}")


_context = TrainContext()


def get_context() -> TrainContext:
    return _context
