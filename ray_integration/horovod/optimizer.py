"""Horovod's ``DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state`` over
elastic_ring's, with sparse gradients handed back sparse."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

import elastic_ring as er
from elastic_ring.core.ops import Average, ReduceOp
from elastic_ring.reduction.compression import Compression
from elastic_ring.reduction.optimizer import _DistributedMixin

from .errors import _horovod_errors, _hvd_call
from . import adasum as _adasum
from . import step_reduced
from .ops import Adasum, _op, _refused_while_joined
from .process_sets import ProcessSet, global_process_set
from .topology import size


def _parameter_items(params: Any, prefix: str | None) -> list[tuple[str, torch.Tensor]]:
    """Horovod's ``params``: a module, a dict (sorted by name, as Horovod), or a list of tensors and / or
    ``(name, tensor)`` pairs (``model.parameters()``, ``model.named_parameters()``)."""
    if isinstance(params, torch.nn.Module):
        items: list[tuple[Any, Any]] = list(params.state_dict().items())
    elif isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda item: str(item[0]))
    elif isinstance(params, torch.Tensor) or isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}: pass model.state_dict(), "
                         "model.named_parameters() or a list of tensors")
    else:
        items = [p if isinstance(p, tuple) and len(p) == 2 else (None, p) for p in params]
    named = []
    for i, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {i} ({name!r}) is a {type(tensor).__name__}, not a tensor")
        label = f"parameter.{i}" if name is None else str(name)
        named.append((label if prefix is None else f"{prefix}.{label}", tensor))
    return named


@_hvd_call
def broadcast_parameters(params, root_rank: int, prefix: str | None = None) -> None:
    """Overwrite the parameters in place with root's (``model.state_dict()``, ``model.named_parameters()`` or a
    list of tensors such as ``list(model.parameters())``)."""
    with _refused_while_joined("broadcast_parameters"):
        er.broadcast_parameters(_parameter_items(params, prefix), root_rank)


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and m.sparse for p in m.parameters()}


@_hvd_call
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              prefix: str | None = None) -> None:
    """Give every rank root's optimizer state. ``model`` (Horovod's): a fresh optimizer's sparse parameters
    (``nn.Embedding(sparse=True)``) get sparse zero gradients for the step that creates its state, as in
    Horovod (``SparseAdam`` takes sparse gradients for all of them)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if isinstance(model, torch.nn.Module) and not optimizer.state_dict()["state"]:
        sparse = _sparse_parameters(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None and (isinstance(optimizer, torch.optim.SparseAdam)
                                                           or id(p) in sparse):
                    p.grad = torch.zeros_like(p).to_sparse()
    with _refused_while_joined("broadcast_optimizer_state"):
        er.broadcast_optimizer_state(optimizer, root_rank)


class _SparseGradients:
    """Between elastic_ring's DistributedOptimizer and the wrapped optimizer's class: the sparse gradients
    reduced dense are handed back sparse before the wrapped optimizer's own step."""

    _hvd_sparse: dict

    def step(self, closure=None):  # noqa: D401 - torch's signature
        _resparsify(self)
        return super().step(closure)  # type: ignore[misc]


class _HorovodOptimizer:
    """The outermost class of hvd.DistributedOptimizer: Horovod's errors and sparse gradients after
    ``synchronize()``."""

    def synchronize(self) -> None:
        with _horovod_errors():
            super().synchronize()  # type: ignore[misc]
        _resparsify(self)

    def step(self, closure=None):  # noqa: D401 - torch's signature
        with _horovod_errors():
            return super().step(closure)  # type: ignore[misc]


def _resparsify(optimizer: Any) -> None:
    """The gradients that arrived sparse this step, reduced dense, as sparse tensors again (Horovod's
    layout: ``sparse_as_dense=True`` all dimensions sparse, else the gradient's own sparse dimensions)."""
    pending = getattr(optimizer, "_hvd_sparse", None)
    if not pending:
        return
    for p, sparse_dim in list(pending.items()):
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            p.grad = grad.to_sparse() if sparse_dim is None else grad.to_sparse(sparse_dim)
    pending.clear()


def _densify_hooks(params: list[torch.Tensor], pending: dict, sparse_as_dense: bool) -> list:
    """Post-accumulate hooks, registered before the reducer's: a sparse gradient becomes dense (and is
    remembered), so the fused reduction takes it."""

    def densify(p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.is_sparse:
            pending[p] = None if sparse_as_dense else grad.sparse_dim()
            p.grad = grad.to_dense()

    return [p.register_post_accumulate_grad_hook(densify) for p in params]


def _translate_hook_errors(reducer: Any) -> None:
    """Buckets launch from the reducer's gradient hooks, inside ``loss.backward()``: a failure there raises
    :class:`HorovodInternalError` too (as a failed enqueue in Horovod's hooks does). The reducer's hooks are
    registered again, wrapped, in its own handle list (so its ``remove_hooks`` still removes them)."""
    handles, ready, params = (getattr(reducer, "_hooks", None), getattr(reducer, "_on_grad_ready", None),
                              getattr(reducer, "_params", None))
    if not (isinstance(handles, list) and callable(ready) and isinstance(params, list) and len(handles) == len(params)):
        return  # another reducer layout: its errors stay elastic_ring.CommError (still caught by the elastic loop)

    def on_grad_ready(param: torch.Tensor) -> None:
        with _horovod_errors():
            ready(param)

    for handle in handles:
        handle.remove()
    reducer._hooks = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in params]


def _partial_set(process_set: Any) -> bool:
    """Whether ``process_set`` is a set of fewer ranks than the ring (one naming every rank is the ring)."""
    if process_set is None or process_set is global_process_set:
        return False
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set={process_set!r} is not a process set: pass hvd.global_process_set or a "
                         "registered hvd.ProcessSet(ranks)")
    members = process_set.ranks
    return members is None or sorted(members) != list(range(size()))


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp | str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, strict_checks: bool = True) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer signature over ``elastic_ring.DistributedOptimizer``.

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced dense, in the fused buckets, and handed back to
    the wrapped optimizer sparse (``SparseAdam`` works), with ``sparse_as_dense`` either way: ``True`` as
    Horovod's (all dimensions sparse), ``False`` in the gradient's own layout. Horovod moves them by an allgather
    of indices and values when ``False``; the values are the same.

    ``process_set=`` a set smaller than the ring, and ``op=Adasum`` (Horovod's delta optimizer), reduce at the step
    in this layer (:mod:`.step_reduced`: Horovod's semantics, no overlap with the backward pass).

    ``strict_checks`` (an extension, elastic_ring's): the default ``True`` checks every step with its own small
    collective before any gradient bucket goes out, as Horovod's coordinator negotiates every step; this is what
    lets :func:`join` answer the steps of ranks that still have data (uneven batches), so Horovod's usual pattern
    (uneven data, the default optimizer, ``hvd.join()``) runs unchanged. ``False`` is the faster opt-out
    (``elastic_ring.DistributedOptimizer``'s default): after the ring's first step the step's agreement rides
    inside its last bucket (no extra collective), and ``hvd.join()`` then raises at once. The check's cost,
    measured with ``python -m benchmarks.step`` on 2 gloo ranks of a loaded 2-core CPU machine (two runs,
    medians over 9 blocks each, noisy): 6-9 % of the step's throughput on a 4x1024 MLP (53 ms steps), 15-25 % on
    a 30x64 MLP (5-9 ms steps, overhead-bound); docs/migration.md. The process-set and Adasum forms reduce with checked
    collectives at every step already and accept either value."""
    if not isinstance(strict_checks, bool):
        raise ValueError(f"strict_checks={strict_checks!r} must be True or False")
    if gradient_predivide_factor != 1.0:
        raise NotImplementedError("gradient_predivide_factor is not supported by elastic_ring: the average is "
                                  "divided once, while the gradient is copied into its bucket; leave it at 1.0")
    if num_groups or groups is not None:
        raise NotImplementedError("num_groups / groups are not supported by elastic_ring: gradients are fused by "
                                  "size and autotuned (fusion_threshold_bytes in elastic_ring.DistributedOptimizer)")
    reduce_op = _op(None, op)
    partial_set = _partial_set(process_set)
    if reduce_op == Adasum:
        if partial_set:
            raise NotImplementedError("DistributedOptimizer(op=Adasum) over a process set is not supported (nor by "
                                      "Horovod): use the global set, or op=Average with process_set=")
        _adasum.check([], size())  # Horovod's power-of-two rule, here at construction (Horovod: at the step)
        if size() > 1:  # Horovod: one rank steps as the plain optimizer
            return step_reduced.build(optimizer, named_parameters, step_reduced._AdasumDelta, op=Adasum,
                                      compression=compression, process_set=global_process_set,
                                      backward_passes_per_step=backward_passes_per_step)
        reduce_op = ReduceOp.AVERAGE
    if partial_set:
        return step_reduced.build(optimizer, named_parameters, step_reduced._ProcessSetReduced, op=reduce_op,
                                  compression=compression, process_set=process_set,
                                  backward_passes_per_step=backward_passes_per_step)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, _DistributedMixin):
        er.DistributedOptimizer(optimizer, named_parameters)  # raises its TypeError / ValueError
    base = type(optimizer)
    inner_cls = type(base.__name__, (_SparseGradients, base), {})
    inner = inner_cls.__new__(inner_cls)
    inner.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks with `optimizer`
    pending: dict = {}
    params = list({id(p): p for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad}.values())
    hooks = _densify_hooks(params, pending, sparse_as_dense)  # before the reducer's hooks: they run first
    try:
        wrapped = er.DistributedOptimizer(inner, named_parameters, compression=compression,
                                          backward_passes_per_step=backward_passes_per_step, op=reduce_op,
                                          strict_checks=strict_checks)
    except BaseException:
        for hook in hooks:
            hook.remove()
        raise
    wrapped.__class__ = type(type(wrapped).__name__, (_HorovodOptimizer, type(wrapped)), {})
    wrapped._hvd_sparse = pending
    wrapped._hvd_hooks = hooks
    reducer = wrapped._er_reducer
    _translate_hook_errors(reducer)
    wrapped._parameter_names = dict(zip(reducer._params, reducer._names))  # Horovod's attribute: parameter -> name
    return wrapped
