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

Their arguments are validated before the signature check and a problem found
on any rank makes every rank raise (:func:`elastic_ring.collectives.tensors.agree`):
bad ``splits`` or a 0-dim tensor on one rank never leaves its peers waiting.

Both move more bytes than a dedicated backend call would (the reducescatter
reduces the whole tensor; the alltoall gathers every rank's whole tensor on
every rank): correct on gloo and NCCL alike, meant for the sizes Horovod
scripts use them with (routing tables, embeddings of a batch), not for
gradient-sized traffic.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.constants import FUSION_THRESHOLD_BYTES
from ..core.ops import Average, ReduceOp
from ..reduction.compression import Compression
from ..reduction.signature import describe
from ..ring import process_sets
from .tensors import _check_reducible, _names, _reduce, agree, allgather, gather_rows, loose_entries, refuse


def _block(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s (offset, rows) of ``n`` rows split over ``size`` ranks, Horovod's way."""
    base, extra = divmod(n, size)
    rows = base + (1 if rank < extra else 0)
    offset = rank * base + min(rank, extra)
    return offset, rows


def _reducescatter_problem(tensors, op) -> BaseException | None:
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return TypeError("grouped_reducescatter expects a list of torch.Tensor")
    if any(t.dim() == 0 for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        return ValueError(f"reducescatter needs tensors with at least one dimension (it splits the first); got "
                          f"shapes {shapes}")
    try:
        op = ReduceOp.parse(op)
    except ValueError as exc:
        return exc
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        return ValueError(f"reducescatter reduces with op=Average or op=Sum, not op={op.value}")
    return None


def grouped_reducescatter(tensors: Sequence[torch.Tensor], op: ReduceOp | str = Average, name: str | None = None,
                          timeout_s: float | None = None) -> list[torch.Tensor]:
    """Reduce every tensor over the ranks; each rank keeps its block of each tensor's first dimension."""
    problem = _reducescatter_problem(tensors, op)
    if problem is not None:
        refuse(process_sets.current(), "reducescatter", loose_entries(tensors, name or "reducescatter"), timeout_s,
               problem)
    op = ReduceOp.parse(op)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_ReducescatterGrad.apply(op, name, timeout_s, *tensors))
    return _reducescatter(list(tensors), op, name, timeout_s)


def reducescatter(tensor: torch.Tensor, op: ReduceOp | str = Average, name: str | None = None,
                  timeout_s: float | None = None) -> torch.Tensor:
    """This rank's block of the reduced ``tensor`` (split along the first dimension)."""
    return grouped_reducescatter([tensor], op, name, timeout_s)[0]


def _reducescatter(tensors: list[torch.Tensor], op: ReduceOp, name: str | None, timeout_s: float | None):
    comm = process_sets.current()
    names = _names(tensors, name, "reducescatter")
    agree(comm, f"reducescatter(op={op.value})", [(n, describe(t)) for n, t in zip(names, tensors)], timeout_s, None)
    _check_reducible(tensors, names, op)
    with torch.no_grad():
        reduced = _reduce(comm, [t.detach() for t in tensors], op, Compression.none, FUSION_THRESHOLD_BYTES, timeout_s,
                          False)
    out = []
    for t in reduced:
        offset, rows = _block(t.shape[0], comm.size, comm.rank)
        out.append(t.narrow(0, offset, rows).clone())
    return out


class _ReducescatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, timeout_s, *tensors):
        ctx.op, ctx.name, ctx.timeout_s = op, name, timeout_s
        ctx.scope = process_sets.active()
        return tuple(_reducescatter(list(tensors), op, name, timeout_s))

    @staticmethod
    def backward(ctx, *grads):
        out = []
        with process_sets.scope_of(ctx.scope):
            size = process_sets.current().size
            for g in grads:
                full = allgather(g.contiguous(), name=f"{ctx.name or 'reducescatter'}.grad", timeout_s=ctx.timeout_s)
                out.append(full * size if ctx.op is ReduceOp.SUM else full)
        return (None, None, None, *out)


def _alltoall_counts(tensor, splits, size: int) -> list[int]:
    """Rows to send to each rank; ValueError / TypeError for what cannot be sent."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("alltoall expects a tensor with at least one dimension (it splits the first)")
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits divides the first dimension ({tensor.shape[0]}) equally "
                             f"over {size} ranks; pass splits= (rows per rank) when it does not divide")
        return [tensor.shape[0] // size] * size
    try:
        counts = [int(c) for c in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"alltoall splits={splits!r} must be {size} row counts (one per rank): {exc}") from None
    if len(counts) != size or any(c < 0 for c in counts) or sum(counts) != tensor.shape[0]:
        raise ValueError(f"alltoall splits={counts} must give {size} non-negative row counts (one per rank) "
                         f"that add up to the first dimension, {tensor.shape[0]}")
    return counts


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None = None, name: str | None = None,
             timeout_s: float | None = None):
    """Send ``splits[j]`` rows to rank ``j``; return the rows every rank sent here (rank order), and, when
    ``splits`` is given, a tensor of how many came from each rank (Horovod's return)."""
    comm = process_sets.current()
    label = name or "alltoall"
    try:
        counts = _alltoall_counts(tensor, splits, comm.size)
    except (TypeError, ValueError) as exc:
        refuse(comm, "alltoall", loose_entries(tensor, label), timeout_s, exc)
    if torch.is_grad_enabled() and tensor.requires_grad:
        output, received = _AlltoallGrad.apply(tensor, counts, name, timeout_s)
    else:
        output, received = _alltoall(tensor.detach(), counts, name, timeout_s)
    return (output, received) if splits is not None else output


def _alltoall(tensor: torch.Tensor, counts: list[int], name: str | None, timeout_s: float | None):
    """One check, one allgather of every rank's splits, one allgather of the rows."""
    comm = process_sets.current()
    rank, size = comm.rank, comm.size
    label = name or "alltoall"
    agree(comm, "alltoall", [(label, describe(tensor, ignore_first_dim=True))], timeout_s, None)
    if size == 1:
        return tensor.clone(), torch.tensor(counts, dtype=torch.int32)
    mine = torch.tensor(counts, dtype=torch.int64, device=comm.device)
    every = torch.empty((size, size), dtype=torch.int64, device=comm.device)
    comm.allgather(every, mine, timeout_s).wait()
    every_count = every.cpu().tolist()
    rows = gather_rows(comm, tensor, [sum(c) for c in every_count], timeout_s)  # every rank's whole tensor
    pieces, start = [], 0
    for r in range(size):
        sent = every_count[r]
        offset = start + sum(sent[:rank])
        pieces.append(rows.narrow(0, offset, sent[rank]))
        start += sum(sent)
    received = torch.tensor([every_count[r][rank] for r in range(size)], dtype=torch.int32)
    return torch.cat(pieces), received


class _AlltoallGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, counts, name, timeout_s):
        output, received = _alltoall(tensor.detach(), counts, name, timeout_s)
        ctx.received, ctx.name, ctx.timeout_s = received.tolist(), name, timeout_s
        ctx.scope = process_sets.active()
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        with process_sets.scope_of(ctx.scope):
            back, _ = _alltoall(grad.contiguous(), ctx.received, f"{ctx.name or 'alltoall'}.grad", ctx.timeout_s)
        return back, None, None, None
