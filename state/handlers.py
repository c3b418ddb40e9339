"""Handlers of training state, chosen by the type of the value they hold.

A handler knows how to take a host-memory snapshot of its value (commit), put
a snapshot back (restore), and turn the value into a tree of tensors and plain
values and back (sync over the ring, durable checkpoints).

=================  ===========================================================
value              handler
=================  ===========================================================
``nn.Module``      :class:`ModuleHandler`: ``state_dict`` (parameters, buffers)
``Optimizer``      :class:`OptimizerHandler`: ``state_dict`` (moments, lr, ...)
LR scheduler       :class:`StateDictHandler`: its ``state_dict``
``ElasticSampler`` :class:`StateDictHandler`: epoch and progress (tiny)
anything else      :class:`ValueHandler`: a deep copy (must be picklable)
=================  ===========================================================
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .samplers.sampler import ElasticSampler
from .samplers.stream import ElasticStream
from .snapshot import SnapshotBuffer, copy_tree


class Handler:
    """Holds one value of the state."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def snapshot(self) -> Any:
        raise NotImplementedError

    def restore(self, snapshot: Any) -> None:
        raise NotImplementedError

    def to_tree(self) -> Any:
        raise NotImplementedError

    def load_tree(self, tree: Any) -> None:
        raise NotImplementedError


class ModuleHandler(Handler):
    """Parameters and buffers, restored in place (the model object stays the same)."""

    def __init__(self, value: torch.nn.Module) -> None:
        super().__init__(value)
        self._buffer = SnapshotBuffer()

    def snapshot(self) -> Any:
        return self._buffer.take(self.value.state_dict())

    def restore(self, snapshot: Any) -> None:
        self.value.load_state_dict(snapshot)  # copies into the existing tensors

    def to_tree(self) -> Any:
        return self.value.state_dict()

    def load_tree(self, tree: Any) -> None:
        self.value.load_state_dict(tree)


class OptimizerHandler(Handler):
    """Optimizer state and hyperparameters. Restores from a copy: on the CPU,
    ``load_state_dict`` keeps the tensors it is given, and later steps would
    otherwise write into the snapshot."""

    def __init__(self, value: torch.optim.Optimizer) -> None:
        super().__init__(value)
        self._buffer = SnapshotBuffer()

    def snapshot(self) -> Any:
        return self._buffer.take(self.value.state_dict())

    def restore(self, snapshot: Any) -> None:
        self.value.load_state_dict(copy_tree(snapshot))

    def to_tree(self) -> Any:
        return self.value.state_dict()

    def load_tree(self, tree: Any) -> None:
        self.value.load_state_dict(copy_tree(tree))


class StateDictHandler(Handler):
    """Anything with ``state_dict()`` / ``load_state_dict()`` of plain values (schedulers, samplers)."""

    def snapshot(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def restore(self, snapshot: Any) -> None:
        self.value.load_state_dict(copy.deepcopy(snapshot))

    def to_tree(self) -> Any:
        return self.value.state_dict()

    def load_tree(self, tree: Any) -> None:
        self.value.load_state_dict(copy.deepcopy(tree))


class ValueHandler(Handler):
    """A plain value (``epoch``, ``step``, a dict of counters): replaced on restore."""

    def snapshot(self) -> Any:
        return copy_tree(self.value)

    def restore(self, snapshot: Any) -> None:
        self.value = copy_tree(snapshot)

    def to_tree(self) -> Any:
        return self.value

    def load_tree(self, tree: Any) -> None:
        self.value = copy_tree(tree)


def handler_for(value: Any) -> Handler:
    """The handler for ``value``, by type."""
    if isinstance(value, torch.nn.Module):
        return ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerHandler(value)
    if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, ElasticSampler, ElasticStream)):
        return StateDictHandler(value)
    try:
        copy.deepcopy(value)
    except Exception as exc:  # re-raised with the fix
        raise TypeError(
            f"cannot keep a value of type {type(value).__name__} in the state: it cannot be copied ({exc}); "
            "keep plain values (numbers, strings, dicts, lists, tensors) or objects with state_dict()"
        ) from exc
    return ValueHandler(value)
