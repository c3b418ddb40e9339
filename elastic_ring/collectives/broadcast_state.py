"""Broadcast a model's parameters and an optimizer's state from one rank to all.

Used at the start of training (and by the state layer's sync) so that every
rank starts from the same weights and optimizer state.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ..reduction.optimizer import _DistributedMixin
from ..ring import runtime
from .objects import broadcast_tree
from .tensors import grouped_broadcast_


def broadcast_parameters(
    params: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    timeout_s: float | None = None,
) -> None:
    """Overwrite parameters (and buffers, for a module) in place with root's values.

    ``params`` is a module (its ``state_dict()``: parameters and buffers), a
    state dict, or ``(name, tensor)`` pairs such as ``model.named_parameters()``.
    """
    if isinstance(params, torch.nn.Module):
        items = list(params.state_dict().items())
    elif isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = list(params)
    if not all(isinstance(t, torch.Tensor) for _, t in items):
        raise TypeError("broadcast_parameters expects tensors: a module, a state dict or (name, tensor) pairs")
    with torch.no_grad():
        grouped_broadcast_([t.data if isinstance(t, torch.nn.Parameter) else t for _, t in items], root_rank,
                           name=[n for n, _ in items], timeout_s=timeout_s)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, timeout_s: float | None = None) -> None:
    """Give every rank root's optimizer state and hyperparameters (e.g. Adam moments, lr)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _initialize_state(optimizer)
    state = broadcast_tree(optimizer.state_dict(), root_rank, name="optimizer_state", timeout_s=timeout_s)
    if runtime.rank() != root_rank:
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """As Horovod: an optimizer that never stepped has no state yet (no momentum buffers, no Adam moments), so
    it takes one local step on zero gradients first, and every rank then holds root's state tensors; the
    gradients stay zeros, as Horovod leaves them. Unlike Horovod, the parameters are restored afterwards: the
    step changes no weight (weight decay would have). A DistributedOptimizer takes its wrapped optimizer's own
    step: no collective, no count."""
    if optimizer.state_dict()["state"]:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    step = super(_DistributedMixin, optimizer).step if isinstance(optimizer, _DistributedMixin) else optimizer.step
    try:
        step()
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
