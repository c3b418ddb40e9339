"""``join()``: Horovod's join for uneven inputs.

A rank that ran out of data calls :func:`join`. It blocks there and takes part
in the collectives the other ranks still run, until every rank of the ring (of
the process set, inside ``process_sets.scope``) has called ``join()``; then
every rank returns the rank that joined last, the same on all.

How: each collective starts with its cross-rank check
(:mod:`elastic_ring.reduction.signature`); a joined rank answers every check
with a mark, and the ranks then swap their calls' descriptions and *join plans*
(what data path follows). A joined rank mirrors that data path with neutral
data:

* allreduce (every op, grouped, ``_async``, through autograd): the op's neutral
  element, so the result is the reduction over the ranks that have data, and
  ``Average`` still divides by the full size (Horovod's ``tensor * (size - 1) /
  size``). Sum and Average: zeros (as Horovod); Product: ones; Min / Max: the
  dtype's largest / smallest value (+inf / -inf for floats). Horovod sends
  zeros for every op, which puts a 0 into a Min, Max or Product;
* allgather: no rows (Horovod refuses an allgather while a rank has joined);
* broadcast, ``broadcast_object`` / ``broadcast_tree``: receives and discards,
  when the root has not joined. A broadcast whose root has joined raises
  :class:`~elastic_ring.TensorMismatchError` on every rank that called it
  (Horovod refuses every broadcast while a rank has joined);
* barrier, ``agree_max``, ``State.commit``'s agreement: nothing more;
* a ``DistributedOptimizer`` step with a leading check (``strict_checks=True``,
  or a ring's first step): zero gradient buckets, so Average divides by the full
  size, as Horovod;
* anything else (reducescatter, alltoall, ``allgather_object``, a call the ranks
  disagree on) raises on the ranks that called it; the joined ranks go on
  waiting (as Horovod's).

``er`` and ``hvd``: the allgather and broadcast answers above are elastic_ring's
(``er.*``). Horovod refuses every allgather and broadcast while a rank has
joined, and ``hvd.*`` keeps that: the hvd layer runs them (every form, objects,
``broadcast_parameters``) inside
:func:`~elastic_ring.collectives.agreement.unanswerable_while_joined`, a
``contextvars`` scope in which every call's join plan is "cannot be answered",
so its callers raise :class:`~elastic_ring.TensorMismatchError` (a
``RuntimeError``) and the joined ranks wait on; nothing else changes.

A lean ``DistributedOptimizer`` step (``strict_checks=False`` after the ring's
first step: its agreement rides in its last bucket, with no check a joined rank
could answer) cannot be joined: :func:`join` raises at once on a rank whose
process has such an optimizer.

Every wait of a joined rank has the collective's deadline (``timeout_s``,
default ``collective_timeout_s``): a joined rank waits that long for the next
collective of the others, and raises :class:`~elastic_ring.CommError` past it.
A failure (a lost peer, an aborted round) raises ``CommError`` out of ``join()``,
and the elastic loop re-forms as for any collective; the joined state belongs
to the ``join()`` call, so after a re-form the loop re-enters and the ranks call
``join()`` again when they run out of data.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.base import Communicator
from ..backends.byte_collectives import broadcast_bytes
from ..core.errors import TensorMismatchError
from ..core.ops import ReduceOp
from ..reduction import reducer as _reducer
from ..reduction.compression import Compression
from ..reduction.signature import JoinProbe, judge, swap_views
from ..ring import process_sets
from . import tensors as _tensors

#: The largest tensor (elements) a joined rank allocates from a peer's plan: plans are plain JSON from the ring.
_MAX_ELEMENTS = 1 << 34


def join(timeout_s: float | None = None) -> int:
    """Wait, answering the other ranks' collectives with neutral data, until every rank has joined.

    Returns the rank that joined last (the same on every rank; a rank of the process set inside
    ``process_sets.scope``): its state is the newest, broadcast from it to bring the others up to date.
    Raises ``RuntimeError`` at once when this process has a ``DistributedOptimizer`` whose steps no joined rank
    can answer (``strict_checks=False`` after the ring's first step), and :class:`~elastic_ring.CommError` when a
    peer is lost or the others run no collective within ``timeout_s`` (default ``collective_timeout_s``).
    """
    comm = process_sets.current()
    if process_sets.active() is None:  # the gradient reduction runs on the whole ring, never in a process set
        blockers = _reducer.join_blockers(comm)
        if blockers:
            raise RuntimeError(
                "join() cannot answer the other ranks' next steps: " + "; ".join(blockers) + ". After a ring's "
                "first step such an optimizer carries the step's agreement inside its last gradient bucket, with "
                "no check that a joined rank could answer; build it with DistributedOptimizer(..., "
                "strict_checks=True) to use join(), or give every rank the same number of batches "
                "(ElasticSampler, DistributedSampler(drop_last=True))")
    if comm.size == 1:
        return comm.rank
    first = True
    while True:
        last = JoinProbe(comm, first, timeout_s).finish()
        first = False
        if last is not None:
            _reducer.after_join(comm)
            return last
        verdict = judge(swap_views(comm, {"joined": True}, timeout_s))
        if verdict.error is None:
            serve(comm, verdict.plan, timeout_s)


def serve(comm: Communicator, plan: Any, timeout_s: float | None) -> None:
    """Run the data path of ``plan`` (the others' call) with neutral data, as a joined rank."""
    run = plan["run"]
    if run == "none":
        return
    if run == "allreduce":
        op = ReduceOp.parse(plan["op"])
        compressor = getattr(Compression, plan["compression"])
        tensors = [neutral(dtype, shape, op, comm.device) for dtype, shape in _layout(plan["tensors"])]
        with torch.no_grad():
            _tensors._reduce(comm, tensors, op, compressor, int(plan["threshold"]), timeout_s, True)
    elif run == "allgather":
        rest = _shape(plan["rest"])
        _tensors.gather_rows(comm, torch.empty((0, *rest), dtype=_dtype(plan["dtype"]), device=comm.device), None,
                             timeout_s)
    elif run == "broadcast":
        tensors = [torch.empty(shape, dtype=dtype, device=comm.device) for dtype, shape in _layout(plan["tensors"])]
        _tensors.broadcast_data(comm, tensors, int(plan["root"]), int(plan["threshold"]), timeout_s)
    elif run == "broadcast_bytes":
        comm.payload_name("broadcast_object")  # keep the object collectives' sequence numbers (their MACs) in step
        broadcast_bytes(comm, None, int(plan["root"]), timeout_s)
    elif run == "buckets":  # a DistributedOptimizer step: its buckets in launch order, reduced with op
        op = ReduceOp.parse(plan["op"])
        works = [comm.allreduce(neutral(dtype, [numel], op, comm.device), op, None)
                 for dtype, numel in ((_dtype(d), int(n)) for d, n in plan["buckets"])]
        for work in works:
            work.wait()
    else:
        raise TensorMismatchError(f"a joined rank was asked to mirror an unknown call {run!r}; every rank must run "
                                  "the same elastic_ring version")


def neutral(dtype: torch.dtype, shape: list[int], op: ReduceOp, device: torch.device) -> torch.Tensor:
    """A tensor that leaves ``op``'s reduction unchanged: zeros for Sum / Average, ones for Product, the largest
    value for Min and the smallest for Max."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return torch.zeros(shape, dtype=dtype, device=device)
    if op is ReduceOp.PRODUCT:
        return torch.ones(shape, dtype=dtype, device=device)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if dtype.is_floating_point:
        value = float("inf") if op is ReduceOp.MIN else float("-inf")
    else:
        value = info.max if op is ReduceOp.MIN else info.min
    return torch.full(shape, value, dtype=dtype, device=device)


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TensorMismatchError(f"a joined rank got a plan with an unknown dtype {name!r}")
    return dtype


def _shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise TensorMismatchError(f"a joined rank got a plan with a malformed shape {shape!r:.100}")
    elements = 1
    for d in shape:
        elements *= d
    if elements > _MAX_ELEMENTS:
        raise TensorMismatchError(f"a joined rank got a plan with a tensor of {elements} elements; refused")
    return shape


def _layout(entries: Any) -> list[tuple[torch.dtype, list[int]]]:
    if not isinstance(entries, list):
        raise TensorMismatchError(f"a joined rank got a plan with malformed tensors {entries!r:.100}")
    return [(_dtype(e[0]), _shape(e[1])) for e in entries]
