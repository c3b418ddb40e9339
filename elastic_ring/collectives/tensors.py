"""Tensor collectives over the current ring, Horovod-style.

Every function here:

1. checks with one tiny allreduce that all ranks passed tensors of the same
   names, dtypes and shapes (:mod:`elastic_ring.reduction.signature`), raising
   :class:`TensorMismatchError` on every rank otherwise;
2. validates its arguments before that check without raising, and folds
   "my arguments are invalid" into the check as a flag (:func:`~elastic_ring.collectives.agreement.agree`): a bad
   argument on *one* rank (a 0-dim tensor, bad ``splits``, an unpicklable
   object) makes every rank raise, with a message naming the rank and its
   problem, and the ring stays usable, instead of leaving its peers waiting in
   the collective until they time out;
3. runs with a timeout (``timeout_s``, default: the ring's
   ``collective_timeout_s``); a lost peer or a timeout raises
   :class:`CommError` on every survivor;
4. gives its check a *join plan* (what data path follows), so that a rank
   waiting in ``join()`` mirrors it with neutral data
   (:mod:`elastic_ring.collectives.join`).

Grouped collectives fuse their tensors into buffers of at most
``fusion_threshold_bytes`` (see :mod:`elastic_ring.reduction.fusion`), launch each
buffer's collective as soon as it is packed, and unpack in order. A single
contiguous tensor already in the wire dtype is reduced in place, with no
buffer. An average in a low-precision wire dtype is divided while it is cast,
so it overflows only if the average itself does. The in-place collectives
reuse fusion buffers from a bounded pool that belongs to the current ring
(emptied when another ring uses it, when its ring is garbage-collected, or by
:func:`release_buffers`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..backends.base import Communicator
from ..core.constants import FUSION_POOL_MAX_BYTES, FUSION_THRESHOLD_BYTES
from ..core.ops import Average, ReduceOp
from ..reduction import fusion
from ..reduction.compression import Compression, Compressor, check_compressor
from ..reduction.signature import NOTHING_MORE, describe, start_check, verify_same
from .agreement import agree, dtype_name, layout_of, loose_entries, refuse  # noqa: F401 - their old home
from ..ring import process_sets, runtime

#: Fusion buffers of the in-place collectives, reused across calls of one ring.
_POOL = fusion.BufferPool(FUSION_POOL_MAX_BYTES)


def release_buffers() -> None:
    """Free the pooled fusion buffers (the runtime calls this when it tears a ring down)."""
    _POOL.clear()


runtime.add_teardown_hook(release_buffers)  # a torn-down ring's buffers go with it


#: Dtypes both backends reduce and move natively.
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int32, torch.int64)
#: Integer dtypes a backend lacks: reduced in a wider one and cast back (exact; a sum that overflows the
#: narrow dtype wraps as the narrow dtype's own arithmetic would).
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _names(tensors: Sequence[torch.Tensor], name: str | Sequence[str] | None, kind: str) -> list[str]:
    if isinstance(name, (list, tuple)):
        if len(name) != len(tensors) or not all(isinstance(n, str) for n in name):
            raise ValueError(f"{kind}: name must be a string or one string per tensor ({len(tensors)})")
        return list(name)
    base = name or kind
    return [base] if len(tensors) == 1 else [f"{base}.{i}" for i in range(len(tensors))]


def _check_tensors(tensors: Sequence[torch.Tensor], kind: str) -> None:
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{kind} expects a list of torch.Tensor")


def _check_reducible(tensors: Sequence[torch.Tensor], names: Sequence[str], op: ReduceOp) -> None:
    """Raised on every rank alike (after the signature check): a local input error, never a ring failure."""
    for t, n in zip(tensors, names):
        if t.dtype not in _REDUCIBLE and t.dtype not in _WIDER:
            raise ValueError(f"cannot allreduce tensor {n!r} of dtype {t.dtype}; cast it to a float or int dtype")


def _fused_allreduce(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    op: ReduceOp,
    compressor: Compressor,
    threshold_bytes: int,
    timeout_s: float | None,
    inplace: bool,
) -> list[torch.Tensor]:
    return _launch_fused(comm, tensors, op, compressor, threshold_bytes, timeout_s, inplace, pooled=True).finish()


class Pending:
    """Buckets of one fused allreduce in flight: :meth:`done` polls, :meth:`finish` waits and returns the results."""

    def __init__(self, works: list, finish) -> None:
        self._works, self._finish = works, finish

    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def finish(self) -> list[torch.Tensor]:
        return self._finish()


def _launch_fused(comm, tensors, op, compressor, threshold_bytes, timeout_s, inplace, pooled: bool) -> Pending:
    """Launch the buckets; ``pooled``: reuse the ring's pooled buffers (only when the caller waits before its
    next collective; an asynchronous caller gets buffers of its own)."""
    size = comm.size
    base_op = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
    buckets = fusion.plan_buckets(fusion.metas_of(tensors), threshold_bytes, compressor)
    in_flight = []
    for slot, bucket in enumerate(buckets):
        first = tensors[bucket.indices[0]]
        direct = (
            inplace and len(bucket.indices) == 1 and first.dtype == bucket.wire_dtype and first.is_contiguous()
        )
        prescale = op is ReduceOp.AVERAGE and fusion.needs_prescale(bucket.wire_dtype)
        divisor = size if prescale else None
        if direct:  # reduced in place: no buffer at all
            buffer = first.view(-1)
            if divisor is not None:
                buffer.div_(divisor)
        else:
            # In place, results are copied out, so pooled buffers can be reused;
            # otherwise the results are views of the buffer and it must be new.
            target = _POOL.acquire(bucket, slot, owner=comm) if inplace and pooled else fusion.allocate(bucket)
            buffer = fusion.pack(bucket, tensors, target, divisor)
        work = comm.allreduce(buffer, base_op, timeout_s)
        in_flight.append((bucket, buffer, work, direct, prescale))
    return Pending([work for _, _, work, _, _ in in_flight],
                   lambda: _finish_fused(in_flight, tensors, op, size, inplace))


def _finish_fused(in_flight, tensors, op, size, inplace) -> list[torch.Tensor]:
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket, buffer, work, direct, prescale in in_flight:
        work.wait()
        if op is ReduceOp.AVERAGE and not prescale:
            if buffer.is_floating_point():
                buffer.div_(size)
            else:  # as Horovod (its sum times 1/size, cast back): the sum divided, truncated toward zero
                buffer.div_(size, rounding_mode="trunc")
        if direct:
            results[bucket.indices[0]] = tensors[bucket.indices[0]]
        elif inplace:
            fusion.unpack_(bucket, buffer, tensors)
            for i in bucket.indices:
                results[i] = tensors[i]
        else:
            for i, view in zip(bucket.indices, fusion.unpack_views(bucket, buffer, tensors)):
                results[i] = view
    return results  # type: ignore[return-value]


def _grouped_allreduce(tensors, op, name, compression, fusion_threshold_bytes, timeout_s, inplace, kind):
    threshold = FUSION_THRESHOLD_BYTES if fusion_threshold_bytes is None else fusion_threshold_bytes
    return _checked_allreduce(tensors, op, name, compression, threshold, timeout_s, inplace, kind, wait=True).finish()


def start_grouped_allreduce(tensors, op, name, compression, timeout_s, inplace, kind) -> Pending:
    """Check and launch an allreduce without waiting for it (Horovod's ``_async``); ``finish()`` gives the
    results. Dtypes reduced through a wider one, autograd and world size 1 complete at once."""
    return _checked_allreduce(tensors, op, name, compression, FUSION_THRESHOLD_BYTES, timeout_s, inplace, kind,
                              wait=False)


def _checked_allreduce(tensors, op, name, compression, threshold, timeout_s, inplace, kind, wait: bool) -> Pending:
    """Every allreduce: validate, check the signature with the peers, then reduce (through autograd when a tensor
    needs it). ``wait=False`` leaves a plain fused reduction in flight, on buffers of its own."""
    comm = process_sets.current()
    try:
        _check_tensors(tensors, kind)
        op = ReduceOp.parse(op)
        compressor = check_compressor(compression)
        names = _names(tensors, name, kind)
    except (TypeError, ValueError) as exc:
        refuse(comm, kind, loose_entries(tensors, kind), timeout_s, exc)
    agree(comm, f"{kind}(op={op.value}, compression={compressor.name})",
          [(n, describe(t)) for n, t in zip(names, tensors)], timeout_s, None,
          join_plan=lambda: allreduce_plan(tensors, op, compressor, threshold))
    _check_reducible(tensors, names, op)
    if not inplace and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out = list(_AllreduceGrad.apply(comm, op, compressor, threshold, timeout_s, *tensors))
        return Pending([], lambda: out)
    with torch.no_grad():
        if not wait and comm.size > 1 and not any(t.dtype in _WIDER or t.requires_grad for t in tensors):
            return _launch_fused(comm, list(tensors), op, compressor, threshold, timeout_s, inplace, pooled=False)
        out = _reduce(comm, list(tensors), op, compressor, threshold, timeout_s, inplace)
    return Pending([], lambda: out)


def allreduce_plan(tensors: Sequence[torch.Tensor], op: ReduceOp, compressor: Compressor, threshold: int) -> Any:
    """What a joined rank mirrors for this allreduce (None: it cannot: a dtype no backend reduces, a compressor
    of the user's own)."""
    if any(t.dtype not in _REDUCIBLE and t.dtype not in _WIDER for t in tensors):
        return None
    if getattr(Compression, compressor.name, None) is not compressor:
        return None
    return {"run": "allreduce", "op": op.value, "compression": compressor.name, "threshold": threshold,
            "tensors": layout_of(tensors)}


def _reduce(comm, tensors, op, compressor, threshold, timeout_s, inplace) -> list[torch.Tensor]:
    """The data path of every allreduce (no autograd): dtypes a backend lacks go through a wider one."""
    if comm.size == 1:
        return list(tensors) if inplace else [t.clone() for t in tensors]
    widened = [t.to(_WIDER[t.dtype]) if t.dtype in _WIDER else t for t in tensors]
    if all(w is t for w, t in zip(widened, tensors)):
        return _fused_allreduce(comm, tensors, op, compressor, threshold, timeout_s, inplace)
    reduced = _fused_allreduce(comm, widened, op, compressor, threshold, timeout_s, True)
    out = []
    for original, result in zip(tensors, reduced):
        if result.dtype == original.dtype:
            out.append(result if not inplace else original)
        elif inplace:
            out.append(original.copy_(result))
        else:
            out.append(result.to(original.dtype))
    return out


class _AllreduceGrad(torch.autograd.Function):
    """Allreduce with Horovod's gradient: the gradient of an allreduce is the allreduce (same op) of the
    gradient. Every rank must backpropagate through it, as every rank called it."""

    @staticmethod
    def forward(ctx, comm, op, compressor, threshold, timeout_s, *tensors):
        ctx.op, ctx.compressor, ctx.threshold, ctx.timeout_s = op, compressor, threshold, timeout_s
        ctx.scope = process_sets.active()  # backward reduces on the same process set
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(_reduce(comm, [t.detach() for t in tensors], op, compressor, threshold, timeout_s, False))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise RuntimeError(f"allreduce with op={ctx.op.value} has no gradient; only Average and Sum are "
                               "differentiable (detach the tensor, or reduce it with op=Sum)")
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                 for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        with process_sets.scope_of(ctx.scope):
            reduced = _grouped_allreduce(grads, ctx.op, "allreduce.grad", ctx.compressor, ctx.threshold,
                                         ctx.timeout_s, False, "grouped_allreduce")
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    name: str | None = None,
    compression: Compressor = Compression.none,
    fusion_threshold_bytes: int | None = None,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors over all ranks with fusion; returns new tensors."""
    return _grouped_allreduce(tensors, op, name, compression, fusion_threshold_bytes, timeout_s, False, "grouped_allreduce")


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = Average,
    name: str | None = None,
    compression: Compressor = Compression.none,
    fusion_threshold_bytes: int | None = None,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the same tensors."""
    return _grouped_allreduce(tensors, op, name, compression, fusion_threshold_bytes, timeout_s, True, "grouped_allreduce_")


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    name: str | None = None,
    compression: Compressor = Compression.none,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Sum, Average, Min or Max); returns a new tensor."""
    return _grouped_allreduce([tensor], op, name, compression, None, timeout_s, False, "allreduce")[0]


def allreduce_(
    tensor: torch.Tensor,
    op: ReduceOp | str = Average,
    name: str | None = None,
    compression: Compressor = Compression.none,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return _grouped_allreduce([tensor], op, name, compression, None, timeout_s, True, "allreduce_")[0]


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    """A view gloo and NCCL can move: complex as real pairs, every dtype they lack (bool, int16, uint16,
    uint32, uint64, float8 ...) as its bytes. A byte view needs a contiguous last dimension: callers pass
    contiguous tensors or copy back."""
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype in _REDUCIBLE:
        return t
    return t.view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)


def _from_wire(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_complex:
        return torch.view_as_complex(out)
    return out if out.dtype == dtype else out.view(dtype)


def grouped_broadcast_(
    tensors: Sequence[torch.Tensor],
    root_rank: int = 0,
    name: str | Sequence[str] | None = None,
    fusion_threshold_bytes: int | None = None,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Overwrite ``tensors`` on every rank with root's, fused by dtype; returns them."""
    comm = process_sets.current()
    try:
        _check_tensors(tensors, "grouped_broadcast_")
        names = _names(tensors, name, "broadcast")
    except (TypeError, ValueError) as exc:
        refuse(comm, f"grouped_broadcast_(root={root_rank})", loose_entries(tensors, "broadcast"), timeout_s, exc)
    threshold = FUSION_THRESHOLD_BYTES if fusion_threshold_bytes is None else fusion_threshold_bytes
    valid_root = isinstance(root_rank, int) and not isinstance(root_rank, bool) and 0 <= root_rank < comm.size
    agree(comm, f"grouped_broadcast_(root={root_rank})", [(n, describe(t)) for n, t in zip(names, tensors)],
          timeout_s, None, join_plan=lambda: {"run": "broadcast", "root": root_rank, "threshold": threshold,
                                              "tensors": layout_of(tensors)} if valid_root else None)
    if not valid_root:
        raise ValueError(f"root_rank={root_rank!r} is not a rank of this ring (world size {comm.size})")
    if comm.size == 1:
        return list(tensors)
    return broadcast_data(comm, tensors, root_rank, threshold, timeout_s)


def broadcast_data(comm: Communicator, tensors: Sequence[torch.Tensor], root_rank: int, threshold: int,
                   timeout_s: float | None) -> list[torch.Tensor]:
    """The broadcast's data path, after its check: fused by dtype, in place."""
    staged = [t if t.is_contiguous() or t.dtype in _REDUCIBLE else t.contiguous() for t in tensors]
    wires = [_as_wire(t) for t in staged]
    buckets = fusion.plan_buckets(fusion.metas_of(wires), threshold, Compression.none)
    in_flight = []
    for slot, bucket in enumerate(buckets):
        first = wires[bucket.indices[0]]
        direct = len(bucket.indices) == 1 and first.is_contiguous()
        buffer = first.view(-1) if direct else _POOL.acquire(bucket, slot, owner=comm)
        if not direct and comm.rank == root_rank:
            fusion.pack(bucket, wires, buffer)
        in_flight.append((bucket, buffer, direct, comm.broadcast(buffer, root_rank, timeout_s)))
    with torch.no_grad():
        for bucket, buffer, direct, work in in_flight:
            work.wait()
            if not direct and comm.rank != root_rank:
                fusion.unpack_(bucket, buffer, wires)
        for original, copy in zip(tensors, staged):
            if copy is not original:  # a non-contiguous tensor moved as bytes through a contiguous copy
                original.copy_(copy)
    return list(tensors)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's; returns ``tensor``."""
    return grouped_broadcast_([tensor], root_rank, name=name, timeout_s=timeout_s)[0]


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> torch.Tensor:
    """Root's ``tensor`` on every rank, as a new tensor. Differentiable as in Horovod: the gradient is the
    average of every rank's gradient on the root, and zero elsewhere."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _BroadcastGrad.apply(tensor, root_rank, name, timeout_s)
    return broadcast_(tensor.detach().clone(), root_rank, name=name, timeout_s=timeout_s)


class _BroadcastGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, timeout_s):
        ctx.root_rank, ctx.name, ctx.timeout_s = root_rank, name, timeout_s
        ctx.scope = process_sets.active()
        return broadcast_(tensor.detach().clone(), root_rank, name=name, timeout_s=timeout_s)

    @staticmethod
    def backward(ctx, grad):
        with process_sets.scope_of(ctx.scope):
            reduced = allreduce(grad.contiguous(), op=Average, name=f"{ctx.name or 'broadcast'}.grad",
                                timeout_s=ctx.timeout_s)
            if process_sets.current().rank != ctx.root_rank:
                reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def allgather(tensor: torch.Tensor, name: str | None = None, timeout_s: float | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    The first dimension may differ per rank; the other dimensions and the
    dtype must match. Differentiable as in Horovod: the gradient is this
    rank's slice of the *average* of every rank's gradient (Horovod's
    convention, which treats each rank's loss as a share of an averaged one).
    """
    if isinstance(tensor, torch.Tensor) and torch.is_grad_enabled() and tensor.requires_grad:
        return _AllgatherGrad.apply(tensor, name, timeout_s)
    return _allgather(tensor, name, timeout_s)


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, timeout_s):
        ctx.name, ctx.timeout_s, ctx.rows = name, timeout_s, tensor.shape[0] if tensor.dim() else 0
        ctx.scope = process_sets.active()
        out = _allgather(tensor.detach(), name, timeout_s)
        return out

    @staticmethod
    def backward(ctx, grad):
        with process_sets.scope_of(ctx.scope):
            rows = allgather(torch.tensor([ctx.rows]), name=f"{ctx.name or 'allgather'}.grad.rows",
                             timeout_s=ctx.timeout_s)
            offset = int(rows[: process_sets.current().rank].sum())
            averaged = allreduce(grad.contiguous(), op=Average, name=f"{ctx.name or 'allgather'}.grad",
                                 timeout_s=ctx.timeout_s)
        return averaged.narrow(0, offset, ctx.rows), None, None


def _allgather(tensor: torch.Tensor, name: str | None, timeout_s: float | None) -> torch.Tensor:
    comm = process_sets.current()
    label = name or "allgather"
    problem = None
    if not isinstance(tensor, torch.Tensor):
        problem = TypeError(f"allgather expects a torch.Tensor, got {type(tensor).__name__}")
    elif tensor.dim() == 0:
        problem = ValueError(f"allgather of {label!r} needs a tensor with at least one dimension; use tensor.view(1)")
    entries = loose_entries(tensor, label) if problem is not None else [(label, describe(tensor, ignore_first_dim=True))]
    agree(comm, "allgather", entries, timeout_s, problem,
          join_plan=lambda: {"run": "allgather", "dtype": dtype_name(tensor.dtype), "rest": list(tensor.shape[1:])})
    if comm.size == 1:
        return tensor.detach().clone()
    return gather_rows(comm, tensor, None, timeout_s)


def gather_rows(comm: Communicator, tensor: torch.Tensor, sizes: list[int] | None,
                timeout_s: float | None) -> torch.Tensor:
    """The allgather's data path, after its check: every rank's rows, in rank order. ``sizes`` (every rank's
    first dimension) when the caller knows them already, else one more small allgather learns them."""
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    inner = 1
    for d in rest:
        inner *= d
    # as rows of one flat dimension, so that the wire view (bytes, real pairs) keeps the row count
    local = _as_wire(tensor.detach().contiguous().reshape(rows, inner)).to(comm.device)
    if sizes is None:
        counts = torch.empty((comm.size, 1), dtype=torch.int64, device=comm.device)
        comm.allgather(counts, torch.tensor([local.shape[0]], dtype=torch.int64, device=comm.device), timeout_s).wait()
        sizes = [int(c) for c in counts.view(-1).tolist()]
    longest = max(sizes)
    if local.shape[0] < longest:
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        local = padded
    gathered = local.new_empty((comm.size, longest, *local.shape[1:]))
    comm.allgather(gathered, local, timeout_s).wait()
    out = torch.cat([gathered[r, : sizes[r]] for r in range(comm.size)]) if longest else gathered.view(0, *local.shape[1:])
    out = _from_wire(out.contiguous(), tensor.dtype)
    return out.reshape(out.shape[0], *rest).to(tensor.device)


def barrier(timeout_s: float | None = None) -> None:
    """Return once every rank has entered the barrier."""
    comm = process_sets.current()
    verify_same(comm, "barrier", [], timeout_s, join_plan=NOTHING_MORE)

    # The signature check is an allreduce that needs every rank: it is the barrier.


def agree_max(kind: str, values: Sequence[int], timeout_s: float | None = None) -> list[int]:
    """One small collective on the current ring: check that every rank is making the
    same ``kind`` of call, and return the maximum over ranks of each of ``values``
    (small non-negative ints, e.g. flags). Raises :class:`TensorMismatchError` on
    every rank if some rank is making another call."""
    return start_check(process_sets.current(), kind, [], timeout_s, values, join_plan=NOTHING_MORE).finish()
