"""Reducescatter and alltoall, with Horovod's semantics, built on the ring's allreduce and allgather.

* :func:`reducescatter` reduces over the ranks and gives rank ``r`` its block of
  the first dimension: ``n // size`` rows, one more for the first ``n % size``
  ranks (Horovod's split). Differentiable with Horovod's gradient: the allgather
  of the gradient, times the world size for a sum (Horovod's convention, as for
  its allgather: each rank's loss counts as a share of an averaged one).
* :func:`alltoall` sends ``splits[j]`` rows of the first dimension to rank
  ``j`` (equal splits when ``splits`` is None) and returns what every rank sent
  to this one, in rank order, and (with ``splits``) how many rows came from
  each. Differentiable: the gradient goes back by an alltoall with the
  received splits.

Both move more bytes than a dedicated backend call would (the reducescatter
reduces the whole tensor; the alltoall gathers every rank's whole tensor on
every rank): correct on gloo and NCCL alike, meant for the sizes Horovod
scripts use them with (routing tables, embeddings of a batch), not for
gradient-sized traffic.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import runtime
from .collectives import allgather, grouped_allreduce
from .ops import Average, ReduceOp


def _block(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s (offset, rows) of ``n`` rows split over ``size`` ranks, Horovod's way."""
    base, extra = divmod(n, size)
    rows = base + (1 if rank < extra else 0)
    offset = rank * base + min(rank, extra)
    return offset, rows


def grouped_reducescatter(tensors: Sequence[torch.Tensor], op: ReduceOp | str = Average, name: str | None = None,
                          timeout_s: float | None = None) -> list[torch.Tensor]:
    """Reduce every tensor over the ranks; each rank keeps its block of each tensor's first dimension."""
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("grouped_reducescatter expects a list of torch.Tensor")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors with at least one dimension (it splits the first)")
    op = ReduceOp.parse(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"reducescatter reduces with op=Average or op=Sum, not op={op.value}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_ReducescatterGrad.apply(op, name, timeout_s, *tensors))
    return _reducescatter(list(tensors), op, name, timeout_s)


def reducescatter(tensor: torch.Tensor, op: ReduceOp | str = Average, name: str | None = None,
                  timeout_s: float | None = None) -> torch.Tensor:
    """This rank's block of the reduced ``tensor`` (split along the first dimension)."""
    return grouped_reducescatter([tensor], op, name, timeout_s)[0]


def _reducescatter(tensors: list[torch.Tensor], op: ReduceOp, name: str | None, timeout_s: float | None):
    reduced = grouped_allreduce([t.detach() for t in tensors], op=op, name=name or "reducescatter", timeout_s=timeout_s)
    rank, size = runtime.rank(), runtime.size()
    out = []
    for t in reduced:
        offset, rows = _block(t.shape[0], size, rank)
        out.append(t.narrow(0, offset, rows).clone())
    return out


class _ReducescatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, timeout_s, *tensors):
        ctx.op, ctx.name, ctx.timeout_s = op, name, timeout_s
        return tuple(_reducescatter(list(tensors), op, name, timeout_s))

    @staticmethod
    def backward(ctx, *grads):
        size = runtime.size()
        out = []
        for g in grads:
            full = allgather(g.contiguous(), name=f"{ctx.name or 'reducescatter'}.grad", timeout_s=ctx.timeout_s)
            out.append(full * size if ctx.op is ReduceOp.SUM else full)
        return (None, None, None, *out)


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None, name: str | None = None,
             timeout_s: float | None = None):
    """Send ``splits[j]`` rows to rank ``j``; return the rows every rank sent here (rank order), and, when
    ``splits`` is given, a tensor of how many came from each rank (Horovod's return)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("alltoall expects a tensor with at least one dimension (it splits the first)")
    size = runtime.size()
    given = splits is not None
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits divides the first dimension ({tensor.shape[0]}) equally "
                             f"over {size} ranks; pass splits= (rows per rank) when it does not divide")
        counts = [tensor.shape[0] // size] * size
    else:
        counts = [int(c) for c in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(counts) != size or any(c < 0 for c in counts) or sum(counts) != tensor.shape[0]:
            raise ValueError(f"alltoall splits={counts} must give {size} non-negative row counts (one per rank) "
                             f"that add up to the first dimension, {tensor.shape[0]}")
    if torch.is_grad_enabled() and tensor.requires_grad:
        output, received = _AlltoallGrad.apply(tensor, counts, name, timeout_s)
    else:
        output, received = _alltoall(tensor.detach(), counts, name, timeout_s)
    return (output, received) if given else output


def _alltoall(tensor: torch.Tensor, counts: list[int], name: str | None, timeout_s: float | None):
    rank, size = runtime.rank(), runtime.size()
    label = name or "alltoall"
    every_count = allgather(torch.tensor([counts], dtype=torch.int64), name=f"{label}.splits", timeout_s=timeout_s)
    rows = allgather(tensor, name=label, timeout_s=timeout_s)  # every rank's whole tensor, in rank order
    pieces, start = [], 0
    for r in range(size):
        sent = every_count[r].tolist()
        offset = start + sum(sent[:rank])
        pieces.append(rows.narrow(0, offset, sent[rank]))
        start += sum(sent)
    received = every_count[:, rank].to(torch.int32)
    return torch.cat(pieces) if pieces else rows[:0], received


class _AlltoallGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, counts, name, timeout_s):
        output, received = _alltoall(tensor.detach(), counts, name, timeout_s)
        ctx.received, ctx.name, ctx.timeout_s = received.tolist(), name, timeout_s
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = _alltoall(grad.contiguous(), ctx.received, f"{ctx.name or 'alltoall'}.grad", ctx.timeout_s)
        return back, None, None, None
