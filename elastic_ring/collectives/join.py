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
* barrier, ``agree_max``, ``State.commit``'s agreement: nothing more; a layer that raises on the values such a
  call agrees on registers :func:`add_answer_listener`, so that the joined rank raises the same out of ``join()``;
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

A joined rank waits for the others' next collective up to its own deadline: ``timeout_s`` of :func:`join`,
default :data:`JOIN_WAIT_S` (30 minutes), not ``collective_timeout_s``, so that a gap between the others'
collectives (an evaluation pass, a checkpoint write) does not end it (Horovod's join waits without limit).
Once a collective has started, its data moves with the collective's deadline as usual. Reaching the join
deadline is a failure of the whole ring: the joined rank raises :class:`~elastic_ring.CommError` and aborts its
communicator, so the others' next collective raises ``CommError`` too and the elastic loop re-forms. A failure
(a lost peer, an aborted round) ends the wait at once with ``CommError`` out of ``join()``, and the elastic
loop re-forms as for any collective; the joined state belongs to the ``join()`` call, so after a re-form the
loop re-enters and the ranks call ``join()`` again when they run out of data.

Plans are validated (:mod:`elastic_ring.collectives.join_plans`) by the ranks that make the call, before they
send them: one that a joined rank could not mirror (an unknown compressor, a tensor too large) makes every
caller raise ``TensorMismatchError`` while the joined ranks wait on. Should mirroring still fail on a joined
rank (a peer on another version, memory), it aborts the communicator, so the others fail at once with
``CommError`` instead of waiting for their deadline.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..backends.base import Communicator
from ..backends.byte_collectives import broadcast_bytes
from ..core.errors import CommError
from ..core.ops import ReduceOp
from ..reduction import reducer as _reducer
from ..reduction.signature import JoinProbe, judge, swap_views
from ..ring import process_sets
from . import tensors as _tensors
from .join_plans import Mirror, parse

#: How long a joined rank waits for the others' next collective by default (seconds): long, as Horovod's join
#: waits without limit; reaching it fails the ring (see the module's docstring).
JOIN_WAIT_S = 30 * 60.0


def join(timeout_s: float | None = None) -> int:
    """Wait, answering the other ranks' collectives with neutral data, until every rank has joined.

    Returns the rank that joined last (the same on every rank; a rank of the process set inside
    ``process_sets.scope``): its state is the newest, broadcast from it to bring the others up to date.
    ``timeout_s``: how long to wait for the others' next collective (default :data:`JOIN_WAIT_S`, 30 minutes);
    reaching it raises :class:`~elastic_ring.CommError` here and fails the ring (the others' next collective
    raises ``CommError``; the elastic loop re-forms). A lost peer or an aborted round raises ``CommError`` at once.
    Raises ``RuntimeError`` at once when this process has a ``DistributedOptimizer`` whose steps no joined rank
    can answer (``strict_checks=False`` after the ring's first step).
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise ValueError(f"join(timeout_s={timeout_s!r}): give a positive number of seconds, or None for "
                         f"JOIN_WAIT_S ({JOIN_WAIT_S:g} s)")
    wait_s = JOIN_WAIT_S if timeout_s is None else float(timeout_s)
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
        probe = JoinProbe(comm, first, wait_s)
        last = probe.finish()
        first = False
        if last is not None:
            _reducer.after_join(comm)
            return last
        views = swap_views(comm, {"joined": True}, None)
        verdict = judge(views)
        if verdict.error is None:
            serve(comm, verdict.plan, None)
            kind = next(v["kind"] for v in views if not v.get("joined"))
            for listener in list(_answer_listeners.get(kind, ())):
                listener(list(probe.values))  # may raise: out of join(), as the others raise after the call


#: ``kind`` -> the functions called when a joined rank answered a check of that kind (see add_answer_listener).
_answer_listeners: dict[str, list[Callable[[list[int]], None]]] = {}


def add_answer_listener(kind: str, fn: Callable[[list[int]], None]) -> None:
    """Call ``fn(values)`` on a joined rank each time it answered a call of ``kind`` (e.g. ``er.agree_max(kind,
    ...)``), with the maxima of its values over the ranks that made it (zeros beyond them). What ``fn`` raises
    comes out of ``join()``: a layer whose call makes every caller raise on some values (``State.commit``'s
    agreement raising ``MembershipChanged``) raises the same on the joined rank. Idempotent per ``fn``."""
    if not isinstance(kind, str) or not kind or not callable(fn):
        raise ValueError(f"add_answer_listener(kind={kind!r}, fn={fn!r}): give a non-empty kind and a callable")
    listeners = _answer_listeners.setdefault(kind, [])
    if fn not in listeners:
        listeners.append(fn)


def remove_answer_listener(kind: str, fn: Callable[[list[int]], None]) -> None:
    """Undo :func:`add_answer_listener` (nothing when ``fn`` is not there)."""
    listeners = _answer_listeners.get(kind, [])
    if fn in listeners:
        listeners.remove(fn)


def serve(comm: Communicator, plan: object, timeout_s: float | None) -> None:
    """Run the data path of ``plan`` (the others' call) with neutral data, as a joined rank. A plan that cannot
    be mirrored here (the others validated it before sending it) aborts the communicator: the others are
    already moving data and would otherwise wait for their deadline."""
    try:
        mirror = parse(plan)
        prepared = _prepare(mirror, comm.device)
    except CommError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here must fail the ring at once, not by a timeout
        raise comm.fail(exc) from exc
    _run(comm, mirror, prepared, timeout_s)


def _prepare(mirror: Mirror, device: torch.device) -> list[torch.Tensor]:
    """The tensors a joined rank sends or receives for ``mirror`` (allocated before anything is sent)."""
    if mirror.run in ("allreduce", "buckets"):
        return [neutral(dtype, shape, mirror.op, device) for dtype, shape in mirror.layout]
    if mirror.run in ("allgather", "broadcast"):
        return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in mirror.layout]
    return []


def _run(comm: Communicator, mirror: Mirror, tensors: list[torch.Tensor], timeout_s: float | None) -> None:
    run = mirror.run
    if run == "allreduce":
        with torch.no_grad():
            _tensors._reduce(comm, tensors, mirror.op, mirror.compressor, mirror.threshold, timeout_s, True)
    elif run == "allgather":
        _tensors.gather_rows(comm, tensors[0], None, timeout_s)
    elif run == "broadcast":
        _tensors.broadcast_data(comm, tensors, mirror.root, mirror.threshold, timeout_s)
    elif run == "broadcast_bytes":
        comm.payload_name("broadcast_object")  # keep the object collectives' sequence numbers (their MACs) in step
        broadcast_bytes(comm, None, mirror.root, timeout_s)
    elif run == "buckets":  # a DistributedOptimizer step: its buckets in launch order, reduced with op
        works = [comm.allreduce(t, mirror.op, None) for t in tensors]
        for work in works:
            work.wait()


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
