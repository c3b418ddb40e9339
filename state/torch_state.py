"""TorchState and ObjectState: the two ready-made States.

``TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)``
keeps a model, an optimizer, an LR scheduler, an :class:`ElasticSampler` and
plain values, each with the handler of its type (see :mod:`state.handlers`).
``ObjectState(**values)`` keeps plain picklable values only.
"""

from __future__ import annotations

from typing import Any

import torch

from .handlers import ValueHandler
from .state import State


class TorchState(State):
    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **values: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchState model= must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TorchState optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        named = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(**named, **values)


class ObjectState(State):
    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        for name, handler in self._handlers.items():
            if not isinstance(handler, ValueHandler):
                raise TypeError(f"ObjectState keeps plain values; {name!r} is a {type(handler.value).__name__}: use TorchState")
