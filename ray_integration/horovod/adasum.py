"""Adasum (``hvd.allreduce(t, op=hvd.Adasum)``): Horovod's adaptive summation over elastic_ring's collectives.

Two vectors combine as ``adasum(a, b) = (1 - a·b / (2|a|²)) a + (1 - a·b / (2|b|²)) b``: their sum when they are
orthogonal, their average when they are parallel. A coefficient stays 1 when its vector's squared norm is below
``sqrt(DBL_MIN)`` (Horovod's zero-norm guard). The ranks (a power of two, as in Horovod) combine as a binary tree in
rank order: ``{0, 1}, {2, 3}, ...`` first, then ``{0, 1}`` with ``{2, 3}``, and so on; the lower ranks are ``a``.
Each tensor has its own coefficients (Horovod's per-layer dot products). Dot products and norms are taken in
float64, each level's combination is computed in float64 and stored in the tensor's dtype (float16, bfloat16,
float32, float64), as Horovod's ``ScaledAdd`` does.

How it runs (Horovod's vector-halving layout, over our collectives): every tensor is cut into one slice per rank;
an ``alltoall`` gives rank ``j`` every rank's slice ``j``; at each of the ``log2(W)`` levels each rank computes the
partial dot products and norms of its slice, one small ``allgather`` of those float64 scalars gives every rank the
totals (added in rank order), and each rank combines its slice; a last ``allgather`` of the slices gives everyone
the result. Every element of the result is computed by exactly one rank, so the result is the same, bit for bit,
on every rank. Cost per rank for ``N`` elements: the ``alltoall`` (elastic_ring's sends every rank's whole tensor:
``(W-1)·N`` received) plus ``(W-1)/W·N`` for the last ``allgather``, and ``log2(W)`` allgathers of ``3·K·W/2^l``
scalars (``K`` tensors): about ``W/2`` times a ring allreduce's traffic, and the latency of ``log2(W) + 2``
collectives.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

import elastic_ring as er
from elastic_ring.ring import process_sets as _process_sets

#: Horovod's ``Adasum`` op (its value is ours: pass ``hvd.Adasum``).
Adasum = "adasum"

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SQRT_DBL_MIN = sys.float_info.min ** 0.5


def is_adasum(op: object) -> bool:
    return isinstance(op, str) and op.lower() == Adasum


def check(tensors: Sequence[torch.Tensor], members: int) -> None:
    """Horovod's conditions: dense floating-point tensors, a power-of-two number of ranks."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"op=Adasum reduces torch.Tensors, got {type(t).__name__}")
        if t.is_sparse:
            raise ValueError("op=Adasum reduces dense tensors; a sparse tensor is reduced with op=Sum or op=Average")
        if t.dtype not in _DTYPES:
            raise ValueError(f"op=Adasum reduces float16, bfloat16, float32 or float64 tensors, not {t.dtype}: "
                             "cast it, or use op=Sum / op=Average")
    if members <= 0 or members & (members - 1):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet ({members} ranks, "
                                  "as in Horovod): run 1, 2, 4, 8, ... workers, or use op=Average")


def _slices(n: int, parts: int) -> list[int]:
    """``n`` elements cut into ``parts`` slices (the first ``n % parts`` one longer)."""
    return [n // parts + (1 if j < n % parts else 0) for j in range(parts)]


def adasum(tensors: Sequence[torch.Tensor], name: str | None = None) -> list[torch.Tensor]:
    """The Adasum of every rank's ``tensors`` (new tensors), on the current ring or process-set scope; call
    :func:`check` first. Tensors of one dtype go together (one exchange per dtype, in first-seen order)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    label = name or "adasum"
    for dtype, indices in by_dtype.items():
        reduced = _adasum_same_dtype([tensors[i] for i in indices], f"{label}.{str(dtype)[6:]}")
        for i, r in zip(indices, reduced):
            out[i] = r
    return out  # type: ignore[return-value]


def _adasum_same_dtype(tensors: list[torch.Tensor], label: str) -> list[torch.Tensor]:
    comm = _process_sets.current()
    world, me = comm.size, comm.rank
    with torch.no_grad():
        flats = [t.detach().reshape(-1) for t in tensors]
        if world == 1:
            return [t.detach().clone() for t in tensors]
        cuts = [_slices(f.numel(), world) for f in flats]
        # rank j's rows: slice j of every tensor, in tensor order
        pieces = [f.split(c) for f, c in zip(flats, cuts)]
        send = torch.cat([pieces[k][j] for j in range(world) for k in range(len(flats))])
        splits = [sum(c[j] for c in cuts) for j in range(world)]
        received, _ = er.alltoall(send, splits, name=f"{label}.slices")
        mine = [c[me] for c in cuts]  # this rank's slice length of each tensor
        device = tensors[0].device
        owner = torch.repeat_interleave(torch.arange(len(flats), device=device),
                                        torch.tensor(mine, device=device))  # column -> tensor
        rows = received.reshape(world, sum(mine)).to(device)
        level = 0
        while rows.shape[0] > 1:
            rows = _combine_level(rows, owner, len(flats), f"{label}.level{level}")
            level += 1
        gathered = er.allgather(rows[0], name=f"{label}.result")
    out = []
    by_rank = gathered.split(splits)
    parts_of = [list(r.split([c[j] for c in cuts])) for j, r in enumerate(by_rank)]
    for k, t in enumerate(tensors):
        out.append(torch.cat([parts_of[j][k] for j in range(world)]).reshape(t.shape))
    return out


def _combine_level(rows: torch.Tensor, owner: torch.Tensor, count: int, label: str) -> torch.Tensor:
    """One level of the tree on this rank's slice: rows ``2i`` and ``2i + 1`` combine into row ``i``."""
    a, b = rows[0::2].double(), rows[1::2].double()
    pairs = a.shape[0]
    index = owner.unsqueeze(0).expand(pairs, -1)
    stats = torch.zeros((3, pairs, count), dtype=torch.float64, device=a.device)
    for j, product in enumerate((a * b, a * a, b * b)):  # per tensor: a·b, |a|², |b|² of this slice
        stats[j].scatter_add_(1, index, product)
    every = er.allgather(stats.reshape(1, -1), name=label)  # one row per rank
    total = every[0].clone()
    for r in range(1, every.shape[0]):  # in rank order: the same sum on every rank
        total += every[r]
    dot, a_norm, b_norm = total.reshape(3, pairs, count)
    a_coeff = torch.where(a_norm >= _SQRT_DBL_MIN, 1.0 - dot / a_norm * 0.5, torch.ones_like(dot))
    b_coeff = torch.where(b_norm >= _SQRT_DBL_MIN, 1.0 - dot / b_norm * 0.5, torch.ones_like(dot))
    a_coeff, b_coeff = (c.gather(1, index) for c in (a_coeff, b_coeff))
    return (a_coeff * a + b_coeff * b).to(rows.dtype)
