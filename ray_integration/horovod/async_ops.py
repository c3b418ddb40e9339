"""Horovod's ``_async`` calls, ``poll`` and ``synchronize``: launched at the call, paired by call order
(:mod:`elastic_ring.collectives.handles`). As Horovod, a ``name`` held by an operation of this process not
synchronized yet is refused at once with a ``ValueError`` (:func:`.session.named_async`)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch

import elastic_ring as er
from elastic_ring.collectives.handles import Handle
from elastic_ring.core.ops import Average, ReduceOp
from elastic_ring.reduction.compression import Compression

from .errors import _hvd_call
from .ops import (Adasum, _reduce_op, _SparseHandle, allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                  grouped_allgather, grouped_allreduce, grouped_allreduce_, grouped_reducescatter, reducescatter)
from .process_sets import _agreed, _on, global_process_set
from .session import named_async, release_name


def _named(fn: Callable) -> Callable:
    """Decorate an ``_async`` call: its ``name`` is held until its handle is synchronized (a second one of the
    same name, on the same process set, raises ``ValueError`` at once: :func:`.session.named_async`)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # raises the call's own TypeError
        bound.apply_defaults()
        return named_async(fn.__name__, bound.arguments.get("name"), bound.arguments.get("process_set"),
                           lambda: fn(*args, **kwargs))

    return call


@_hvd_call
def poll(handle: Any) -> bool:
    """Whether the handle's collective is done (:func:`synchronize` will not block)."""
    if isinstance(handle, _SparseHandle):
        return handle.done()
    return er.poll(handle)


@_hvd_call
def synchronize(handle: Any) -> Any:
    """Wait for the handle's collective and return its output, or raise the error it met. As Horovod's, a handle
    that was synchronized already gives None. A :func:`sparse_allreduce_async` handle gives its sparse result."""
    if isinstance(handle, _SparseHandle):
        return handle()  # releases its name
    if isinstance(handle, Handle) and handle._taken:
        return None
    release_name(handle)  # the name is free again, whatever the operation met (it is delivered now)
    return er.synchronize(handle)


@_hvd_call
@_named
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async", tensor, process_set,
                        lambda: _reduce_op(average, op, tensor, process_set))
    if (prescale_factor == postscale_factor == 1.0 and reduce_op != Adasum
            and not (isinstance(tensor, torch.Tensor) and tensor.is_sparse)):
        with _on(process_set):  # launched now, runs while the script works
            return er.allreduce_async(tensor, op=reduce_op, name=name)
    return Handle(lambda: allreduce(tensor, None, name, Compression.none, reduce_op, prescale_factor,
                                    postscale_factor, process_set))


@_hvd_call
@_named
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async_", tensor, process_set,
                        lambda: _reduce_op(average, op, tensor, process_set))
    if prescale_factor == postscale_factor == 1.0 and reduce_op != Adasum:
        with _on(process_set):
            return er.allreduce_async_(tensor, op=reduce_op, name=name)
    return Handle(lambda: allreduce_(tensor, None, name, reduce_op, prescale_factor, postscale_factor, process_set))


@_hvd_call
@_named
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    if prescale_factor == postscale_factor == 1.0 and reduce_op != Adasum:
        with _on(process_set):
            return er.grouped_allreduce_async(list(tensors), op=reduce_op, name=name)
    return Handle(lambda: grouped_allreduce(tensors, None, name, Compression.none, reduce_op, prescale_factor,
                                            postscale_factor, process_set))


@_hvd_call
@_named
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async_", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    if prescale_factor == postscale_factor == 1.0 and reduce_op != Adasum:
        with _on(process_set):
            return er.grouped_allreduce_async_(list(tensors), op=reduce_op, name=name)
    return Handle(lambda: grouped_allreduce_(tensors, None, name, reduce_op, prescale_factor, postscale_factor,
                                             process_set))


@_named
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set):
    return Handle(lambda: allgather(tensor, name, process_set))


@_named
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set):
    return Handle(lambda: grouped_allgather(tensors, name, process_set))


@_named
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0):
    return Handle(lambda: reducescatter(tensor, name, Compression.none, op, process_set, prescale_factor,
                                        postscale_factor))


@_named
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | str = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    return Handle(lambda: grouped_reducescatter(tensors, name, Compression.none, op, process_set, prescale_factor,
                                                postscale_factor))


@_named
def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: Any = global_process_set):
    return Handle(lambda: alltoall(tensor, splits, name, process_set))


@_named
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set):
    return Handle(lambda: broadcast(tensor, root_rank, name, process_set))


@_named
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set):
    return Handle(lambda: broadcast_(tensor, root_rank, name, process_set))
