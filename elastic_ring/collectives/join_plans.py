"""Join plans, validated: what a rank waiting in ``join()`` mirrors (:mod:`elastic_ring.collectives.join`).

A plan is plain JSON from the ring (a peer's description of its call). :func:`parse` turns it into a
:class:`Mirror` (the op, the compressor, every tensor's dtype and shape) or raises
:class:`~elastic_ring.TensorMismatchError` naming what is wrong, without allocating anything. The ranks that
make a call validate its plan with it before they send it (:func:`elastic_ring.collectives.agreement.agree`):
a plan a joined rank could not mirror is sent as "cannot be answered", so every rank that made the call raises
``TensorMismatchError`` and the joined ranks go on waiting, instead of a joined rank failing after the others
started to move data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import TensorMismatchError
from ..core.ops import ReduceOp
from ..reduction.compression import Compression, Compressor

#: The most elements a joined rank allocates for one call (all its tensors together): plans come from the ring.
MAX_ELEMENTS = 1 << 34

#: The kinds of call a joined rank mirrors.
RUNS = ("none", "allreduce", "allgather", "broadcast", "broadcast_bytes", "buckets")


@dataclass(frozen=True)
class Mirror:
    """A validated plan: ``run`` and what its data path needs."""

    run: str
    op: ReduceOp | None = None
    compressor: Compressor | None = None
    layout: list[tuple[torch.dtype, list[int]]] = field(default_factory=list)
    root: int | None = None
    threshold: int = 0


def parse(plan: Any) -> Mirror:
    """``plan`` as a :class:`Mirror`; :class:`TensorMismatchError` when a joined rank could not mirror it."""
    if not isinstance(plan, dict) or plan.get("run") not in RUNS:
        run = plan.get("run") if isinstance(plan, dict) else plan
        raise TensorMismatchError(f"a joined rank was asked to mirror an unknown call {run!r:.100}; every rank must "
                                  "run the same elastic_ring version")
    run = plan["run"]
    if run == "none":
        return Mirror(run)
    if run == "allreduce":
        layout = _layout(plan.get("tensors"))
        return Mirror(run, op=_op(plan.get("op")), compressor=_compressor(plan.get("compression")), layout=layout,
                      threshold=_count(plan.get("threshold"), "threshold"))
    if run == "allgather":
        return Mirror(run, layout=_layout([[plan.get("dtype"), [0, *_list(plan.get("rest"))]]]))
    if run == "broadcast":
        return Mirror(run, layout=_layout(plan.get("tensors")), root=_count(plan.get("root"), "root"),
                      threshold=_count(plan.get("threshold"), "threshold"))
    if run == "broadcast_bytes":
        return Mirror(run, root=_count(plan.get("root"), "root"))
    buckets = plan.get("buckets")  # "buckets": a DistributedOptimizer step, [dtype, numel] per bucket
    if not isinstance(buckets, list) or not all(isinstance(b, list) and len(b) == 2 for b in buckets):
        raise TensorMismatchError(f"a joined rank got a step plan with malformed buckets {buckets!r:.100}")
    return Mirror(run, op=_op(plan.get("op")), layout=_layout([[d, [n]] for d, n in buckets]))


def _op(name: Any) -> ReduceOp:
    try:
        return ReduceOp.parse(name)
    except (TypeError, ValueError):
        raise TensorMismatchError(f"a joined rank got a plan with an unknown op {name!r:.100}") from None


def _compressor(name: Any) -> Compressor:
    compressor = getattr(Compression, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(compressor, Compressor):
        raise TensorMismatchError(f"a joined rank got a plan with compression {name!r:.100}, which it cannot mirror "
                                  "(only elastic_ring's own Compression.none / Compression.fp16)")
    return compressor


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TensorMismatchError(f"a joined rank got a plan with a malformed {what} {value!r:.100}")
    return value


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TensorMismatchError(f"a joined rank got a plan with an unknown dtype {name!r:.100}")
    return dtype


def _list(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise TensorMismatchError(f"a joined rank got a plan with a malformed shape {shape!r:.100}")
    return shape


def _layout(entries: Any) -> list[tuple[torch.dtype, list[int]]]:
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 2 for e in entries):
        raise TensorMismatchError(f"a joined rank got a plan with malformed tensors {entries!r:.100}")
    layout = [(_dtype(d), _list(s)) for d, s in entries]
    total = 0
    for _, shape in layout:
        elements = 1
        for d in shape:
            elements *= d
        total += elements
    if total > MAX_ELEMENTS:
        raise TensorMismatchError(f"a joined rank would allocate {total} elements for this call (more than "
                                  f"{MAX_ELEMENTS}); refused")
    return layout
