"""Horovod's ``_async`` calls, ``poll`` and ``synchronize``.

Each call returns a handle at once; its collective runs in the background (:func:`.session.launch_async`).
Unnamed, it runs on its communicator's ordered queue, in call order, shared with the synchronous calls
(:mod:`elastic_ring.collectives.ordered`); ``poll`` is False until it ran and its data arrived. Named, it is
paired by name with the other ranks' operations of the same name, whatever order they were submitted in, as
Horovod's coordinator pairs them (:mod:`elastic_ring.collectives.negotiation`): it waits, parked, until this rank
synchronizes it. A ``name`` held by an operation of this process not synchronized yet is refused at once with a
``ValueError``, as Horovod's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch

import elastic_ring as er
from elastic_ring.collectives.handles import Handle, single
from elastic_ring.collectives.tensors import start_grouped_allreduce
from elastic_ring.core.ops import Average, ReduceOp
from elastic_ring.reduction.compression import Compression

from .errors import _hvd_call
from .ops import (Adasum, _reduce_op, _SparseHandle, allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                  grouped_allgather, grouped_allreduce, grouped_allreduce_, grouped_reducescatter, reducescatter)
from .process_sets import _agreed, _on, global_process_set
from .session import launch_async, release_name


def _async(prefix: str) -> Callable[[Callable], Callable]:
    """Decorate an ``_async`` call whose body runs its collective (returning the output, or the allreduce in
    flight): the call returns a handle at once and the body runs in the background, queued or paired by name
    (:func:`.session.launch_async`; ``prefix``: Horovod's op prefix of the name)."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # raises the call's own TypeError
            bound.apply_defaults()
            return launch_async(prefix, fn.__name__, bound.arguments.get("name"), bound.arguments.get("process_set"),
                                lambda: fn(*args, **kwargs))

        return call

    return decorate


@_hvd_call
def poll(handle: Any) -> bool:
    """Whether the handle's collective is done (:func:`synchronize` will not block). False while it waits to run
    or its data is in flight; a named operation waits until this rank synchronizes it (it is paired then)."""
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


def _fast(reduce_op: Any, prescale_factor: float, postscale_factor: float) -> bool:
    """An allreduce that runs as one fused collective in flight (no scaling, no Adasum)."""
    return prescale_factor == postscale_factor == 1.0 and reduce_op != Adasum


@_hvd_call
@_async("allreduce")
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async", tensor, process_set,
                        lambda: _reduce_op(average, op, tensor, process_set))
    if _fast(reduce_op, prescale_factor, postscale_factor) and not (isinstance(tensor, torch.Tensor)
                                                                      and tensor.is_sparse):
        with _on(process_set):  # its data in flight while the script works
            return single(start_grouped_allreduce([tensor], reduce_op, name, Compression.none, None, False,
                                                  "allreduce"))
    return allreduce(tensor, None, name, Compression.none, reduce_op, prescale_factor, postscale_factor, process_set)


@_hvd_call
@_async("allreduce")
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set):
    reduce_op = _agreed("allreduce_async_", tensor, process_set,
                        lambda: _reduce_op(average, op, tensor, process_set))
    if _fast(reduce_op, prescale_factor, postscale_factor):
        with _on(process_set):
            return single(start_grouped_allreduce([tensor], reduce_op, name, Compression.none, None, True,
                                                  "allreduce_"))
    return allreduce_(tensor, None, name, reduce_op, prescale_factor, postscale_factor, process_set)


@_hvd_call
@_async("grouped_allreduce")
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    if _fast(reduce_op, prescale_factor, postscale_factor):
        with _on(process_set):
            return start_grouped_allreduce(list(tensors), reduce_op, name, Compression.none, None, False,
                                           "grouped_allreduce")
    return grouped_allreduce(tensors, None, name, Compression.none, reduce_op, prescale_factor, postscale_factor,
                             process_set)


@_hvd_call
@_async("grouped_allreduce")
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = global_process_set):
    reduce_op = _agreed("grouped_allreduce_async_", tensors, process_set,
                        lambda: _reduce_op(average, op, tensors, process_set))
    if _fast(reduce_op, prescale_factor, postscale_factor):
        with _on(process_set):
            return start_grouped_allreduce(list(tensors), reduce_op, name, Compression.none, None, True,
                                           "grouped_allreduce_")
    return grouped_allreduce_(tensors, None, name, reduce_op, prescale_factor, postscale_factor, process_set)


@_hvd_call
@_async("allgather")
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set):
    return allgather(tensor, name, process_set)


@_hvd_call
@_async("grouped_allgather")
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set):
    return grouped_allgather(tensors, name, process_set)


@_hvd_call
@_async("reducescatter")
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0):
    return reducescatter(tensor, name, Compression.none, op, process_set, prescale_factor, postscale_factor)


@_hvd_call
@_async("grouped_reducescatter")
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | str = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    return grouped_reducescatter(tensors, name, Compression.none, op, process_set, prescale_factor, postscale_factor)


@_hvd_call
@_async("alltoall")
def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: Any = global_process_set):
    return alltoall(tensor, splits, name, process_set)


@_hvd_call
@_async("broadcast")
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set):
    return broadcast(tensor, root_rank, name, process_set)


@_hvd_call
@_async("broadcast")
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set):
    return broadcast_(tensor, root_rank, name, process_set)
