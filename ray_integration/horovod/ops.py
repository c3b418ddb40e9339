"""Horovod's collectives (allreduce, allgather, broadcast, reducescatter, alltoall, their grouped and sparse
forms, objects, barrier, join) over elastic_ring's, with Horovod's arguments and scaling."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import elastic_ring as er
from elastic_ring.collectives.agreement import unanswerable_while_joined
from elastic_ring.collectives.handles import Handle
from elastic_ring.core.ops import Average, ReduceOp
from elastic_ring.reduction.compression import Compression

from . import adasum as _adasum
from .adasum import Adasum
from .errors import _hvd_call
from .process_sets import _agreed, _on, _root, global_process_set
from .session import launch_async, release_name
from .topology import size


def _op(average: bool | None, op: ReduceOp | str | None, adasum_for: str | None = None) -> ReduceOp | str:
    """The reduction ``average=`` / ``op=`` ask for; ``Adasum`` only where ``adasum_for`` says who refuses it
    is None (the allreduce family)."""
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average; please provide only one of them.")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if _adasum.is_adasum(op):
        if adasum_for is not None:
            raise NotImplementedError(f"op=Adasum is not offered by {adasum_for} (nor by Horovod): Adasum is an "
                                      "allreduce (hvd.allreduce / grouped_allreduce and their _async / in-place forms)")
        return Adasum
    return ReduceOp.parse(op)


def _members(process_set: Any) -> int:
    """How many ranks ``process_set`` has (the ring's size for the global one)."""
    if process_set is None or process_set is global_process_set:
        return size()
    return len(process_set.ranks or ())


def _reduce_op(average: bool | None, op: ReduceOp | str | None, tensors: Any, process_set: Any) -> ReduceOp | str:
    """:func:`_op` for the allreduce family: ``Adasum`` checked against the tensors and the set's size."""
    reduce_op = _op(average, op)
    if reduce_op == Adasum:
        _adasum.check(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors], _members(process_set))
    return reduce_op


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: integers in float64 and back (truncating), half precision in float32 and back."""
    if factor == 1.0:
        return t
    if not t.is_floating_point():
        return (t.to(torch.float64) * factor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * factor).to(t.dtype)
    return t * factor


def _scaled(tensors: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    return [_scale(t, factor) for t in tensors]


def _sparse_op(average: bool | None, op: ReduceOp | str | None) -> ReduceOp:
    reduce_op = _op(average, op, adasum_for="the reduction of a sparse tensor")
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"a sparse tensor is reduced with op=Sum or op=Average, not op={reduce_op.value}")
    return reduce_op


def _refused_while_joined(call: str):
    """Scope a call that Horovod refuses while a rank has joined (every allgather and broadcast): the calling
    ranks raise ``TensorMismatchError`` (a ``RuntimeError``), the joined ranks go on waiting. elastic_ring's own
    ``er.allgather`` / ``er.broadcast`` (and ``broadcast_object``, ``broadcast_parameters``) answer them: no rows
    from a joined rank, a root that has not joined."""
    answered = "" if call == "allgather_object" else f"; elastic_ring's er.{call} answers a joined rank"
    return unanswerable_while_joined(
        f"hvd.{call} cannot run while a rank has joined, as in Horovod, which refuses every allgather and "
        f"broadcast until all ranks have called join() (call it before any rank joins, or after join() returns"
        f"{answered})")


@_hvd_call
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Horovod's allreduce (differentiable): ``postscale * reduce(prescale * tensor)``. A sparse tensor is
    reduced as :func:`sparse_allreduce_async` does (Sum or Average; the result is sparse)."""
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        reduce_op = _agreed("sparse_allreduce", [], process_set, lambda: _sparse_op(average, op))
        scaled = tensor if prescale_factor == 1.0 else tensor * prescale_factor
        out = _sparse_result(scaled, *_sparse_parts(scaled, name, reduce_op, process_set))
        return out if postscale_factor == 1.0 else out * postscale_factor
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


@_hvd_call
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    return grouped_allreduce_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)[0]


@_hvd_call
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    reduce_op = _agreed("grouped_allreduce", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    if reduce_op == Adasum:
        with _on(process_set):
            reduced = _adasum.adasum(_scaled(tensors, prescale_factor), name=name)
        return _scaled(reduced, postscale_factor)
    with _on(process_set):
        reduced = er.grouped_allreduce(_scaled(tensors, prescale_factor), op=reduce_op, name=name,
                                       compression=compression)
    return _scaled(reduced, postscale_factor)


@_hvd_call
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    reduce_op = _agreed("grouped_allreduce_", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    with torch.no_grad(), _on(process_set):
        for t in tensors:
            t.copy_(_scale(t, prescale_factor))
        if reduce_op == Adasum:
            for t, reduced in zip(tensors, _adasum.adasum(list(tensors), name=name)):
                t.copy_(reduced)
        else:
            er.grouped_allreduce_(list(tensors), op=reduce_op, name=name)
        for t in tensors:
            t.copy_(_scale(t, postscale_factor))
    return list(tensors)


@_hvd_call
def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    with _on(process_set), _refused_while_joined("allgather"):
        return er.allgather(tensor, name=name)


@_hvd_call
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    with _on(process_set), _refused_while_joined("allgather"):
        return [er.allgather(t, name=None if name is None else f"{name}.{i}") for i, t in enumerate(tensors)]


@_hvd_call
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    with _on(process_set) as ranks, _refused_while_joined("broadcast"):
        return er.broadcast(tensor, _agreed("broadcast", tensor, process_set, lambda: _root(root_rank, ranks)),
                            name=name)


@_hvd_call
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    with torch.no_grad(), _on(process_set) as ranks, _refused_while_joined("broadcast_"):
        return er.broadcast_(tensor, _agreed("broadcast_", tensor, process_set, lambda: _root(root_rank, ranks)),
                             name=name)


@_hvd_call
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none,
                  op: ReduceOp | str = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


@_hvd_call
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression=Compression.none,
                          op: ReduceOp | str = Average, process_set: Any = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    def validate() -> ReduceOp:
        if compression is not Compression.none:
            raise NotImplementedError("reducescatter with compression is not supported by elastic_ring; leave it out")
        return _op(None, op, adasum_for="reducescatter")

    reduce_op = _agreed("grouped_reducescatter", tensors, process_set, validate)
    with _on(process_set):
        out = er.grouped_reducescatter(_scaled(tensors, prescale_factor), op=reduce_op, name=name)
    return _scaled(out, postscale_factor)


@_hvd_call
def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set: Any = global_process_set):
    with _on(process_set):
        return er.alltoall(tensor, splits, name=name)


# ------------------------------------------------------------------ sparse tensors
class _SparseHandle:
    """What :func:`sparse_allreduce_async` returns: call it (or pass it to :func:`synchronize`) for the result.
    Its two allgathers (indices, values) run as one ``_async`` operation (``handle``: queued, or paired by name)."""

    def __init__(self, tensor: torch.Tensor, handle: Handle) -> None:
        self._tensor, self._handle = tensor, handle
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._handle.done()

    def __call__(self) -> torch.Tensor:
        release_name(self._handle)  # delivered: its name is free again
        if self._result is None and self._error is None:
            try:
                indices, values, divisor = er.synchronize(self._handle)
            except Exception as exc:  # noqa: BLE001 - raised now and by every later call, as Horovod's handle
                self._error = exc
            else:
                self._result = _sparse_result(self._tensor, indices, values, divisor)
        if self._error is not None:
            raise self._error
        return self._result


def _sparse_result(tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                   divisor: int | None) -> torch.Tensor:
    if divisor is not None:
        values = values / divisor
    return torch.sparse_coo_tensor(indices.transpose(0, 1), values, tensor.size(), device=tensor.device,
                                   check_invariants=False)


@_hvd_call
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp | str,
                           process_set: Any = global_process_set) -> _SparseHandle:
    """Horovod's sparse allreduce: every rank's indices and values are allgathered, so the result holds every
    rank's entries (uncoalesced: entries at the same index add up), the values divided by the set's size for
    ``op=Average``. Returns a handle at once (the allgathers run in the background, queued or paired by name as
    every ``_async`` call's): call it (as Horovod's) or pass it to :func:`synchronize`; its ``name`` is held until
    then (a second one raises ``ValueError`` at once)."""
    handle = launch_async("sparse_allreduce", "sparse_allreduce_async", name, process_set,
                          lambda: _sparse_parts(tensor, name, op, process_set))
    return _SparseHandle(tensor, handle)


def _sparse_parts(tensor: torch.Tensor, name: str | None, op: ReduceOp | str,
                  process_set: Any) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Every rank's indices and values of a sparse ``tensor``, and the divisor of an average (None: a sum)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async reduces a sparse COO tensor (tensor.is_sparse); use allreduce_async "
                         "for a dense one")
    reduce_op = _agreed("sparse_allreduce", [], process_set, lambda: _sparse_op(None, op))
    # in order; a mismatch with a peer stops before the second, so that it cannot pair with the peer's next call
    indices = allgather(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                        process_set=process_set)
    values = allgather(tensor._values().contiguous(), name=f"{name}.values", process_set=process_set)
    return indices, values, _members(process_set) if reduce_op is ReduceOp.AVERAGE else None


# ------------------------------------------------------------------ objects, barrier, join
@_hvd_call
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    with _on(process_set) as ranks, _refused_while_joined("broadcast_object"):
        return er.broadcast_object(obj, _agreed("broadcast_object", [], process_set, lambda: _root(root_rank, ranks)),
                                   name=name)


@_hvd_call
def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list:
    with _on(process_set), _refused_while_joined("allgather_object"):
        return er.allgather_object(obj, name=name)


@_hvd_call
def barrier(process_set: Any = global_process_set) -> None:
    with _on(process_set):
        er.barrier()


@_hvd_call
def join(device: int = -1, *, timeout_s: float | None = None) -> int:
    """Horovod's ``join``: this rank ran out of data. It blocks, taking part in the other ranks' collectives
    (allreduce with the op's neutral element, zeros for Sum / Average, so ``Average`` still divides by the full
    size; barrier), until every rank has joined, and returns the rank that joined last, the same on every rank
    (``elastic_ring.join``). As in Horovod, every hvd allgather and broadcast (objects, ``broadcast_parameters``
    included), reducescatter and alltoall raise ``RuntimeError`` on the ranks that call them while a rank has
    joined (``er.allgather`` / ``er.broadcast`` answer a joined rank). Optimizer steps are answered (zero
    gradients, Average divides by the full size): ``hvd.DistributedOptimizer`` leads every step with its check by
    default (``strict_checks=True``). One built with ``strict_checks=False`` carries a step's agreement in its
    last bucket after the ring's first step, which no joined rank can answer, so ``join()`` raises
    ``RuntimeError`` at once in a process whose such optimizer has stepped. ``device`` is Horovod's device for
    the zeros: accepted, the ring's device is used.

    ``timeout_s`` (elastic_ring's): how long the joined rank waits for the others' next collective (default
    :data:`elastic_ring.collectives.join.JOIN_WAIT_S`, 30 minutes; Horovod waits without limit). Reaching it
    fails the whole ring (``HorovodInternalError`` here, and on the others at their next collective; the
    elastic loop re-forms). A lost peer or an aborted round ends the wait at once."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise ValueError(f"join(device={device!r}): device is a device id (an int, -1 for the CPU)")
    try:
        return er.join(timeout_s=timeout_s)
    except RuntimeError as exc:
        if type(exc) is not RuntimeError or "strict_checks=True" not in str(exc):
            raise  # a failed collective (HorovodInternalError via _hvd_call), a mismatch, ...
        raise RuntimeError(
            f"hvd.join(): {exc}. In this API: build every rank's optimizer as hvd.DistributedOptimizer(...) "
            "without strict_checks=False (its default, strict_checks=True, leads every step with a check)") from exc
