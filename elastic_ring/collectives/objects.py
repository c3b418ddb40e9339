"""Collectives of Python objects and of trees that hold tensors, authenticated.

* ``broadcast_object`` / ``allgather_object``: pickled objects as byte tensors.
  Every payload is sealed with the job's secret (HMAC-SHA256 over the round,
  the collective's sequence number, the sender and the bytes; see
  :mod:`elastic_ring.core.auth`) and unpickled only after its MAC checks, so
  nothing a stranger injects into the ring's sockets is ever unpickled.
* ``broadcast_tree``: a pytree (dicts, lists, tuples, ... as
  ``torch.utils._pytree`` flattens them) whose leaves are tensors or plain
  values: the tree's structure and plain leaves travel as one authenticated
  object, the tensors as fused tensor broadcasts. Receivers need no tensors of
  their own, so it serves the state sync to a fresh worker and optimizer-state
  broadcast alike. Every tensor leaf lands where such a leaf lives on the
  receiver: CPU leaves on the CPU, CUDA leaves on the receiver's own device.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends.byte_collectives import allgather_bytes, broadcast_bytes
from ..core.auth import seal, unseal
from ..ring import process_sets
from .tensors import agree, grouped_broadcast_


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> Any:
    """Return root's ``obj`` on every rank (pickled and authenticated; ``obj`` is ignored elsewhere, and the
    root gets ``obj`` itself back). Raises :class:`~elastic_ring.AuthenticationError` on a receiver whose
    payload was tampered with."""
    return _broadcast_object(obj, root_rank, name, timeout_s, None)


def _broadcast_object(obj: Any, root_rank: int, name: str | None, timeout_s: float | None,
                      problem: BaseException | None) -> Any:
    comm = process_sets.current()
    pickled = None
    if problem is None and comm.rank == root_rank and comm.size > 1:
        try:
            pickled = pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling error is this rank's argument error
            problem = TypeError(f"broadcast_object: the root's object cannot be pickled: {type(exc).__name__}: {exc}")
    valid_root = isinstance(root_rank, int) and not isinstance(root_rank, bool) and 0 <= root_rank < comm.size
    agree(comm, f"broadcast_object(root={root_rank})", [(name or "object", "pickle")], timeout_s, problem,
          join_plan={"run": "broadcast_bytes", "root": root_rank} if valid_root else None)
    if comm.size == 1:
        return obj
    label = f"{comm.payload_name('broadcast_object')}/from{root_rank}"
    data = seal(comm.auth_key, "payload", label, pickled) if comm.rank == root_rank else None
    received = broadcast_bytes(comm, data, root_rank, timeout_s)
    if comm.rank == root_rank:
        return obj
    return pickle.loads(unseal(comm.auth_key, "payload", label, received))


def allgather_object(obj: Any, name: str | None = None, timeout_s: float | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (each payload authenticated before it is unpickled)."""
    comm = process_sets.current()
    pickled, problem = None, None
    if comm.size > 1:
        try:
            pickled = pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling error is this rank's argument error
            problem = TypeError(f"allgather_object: this rank's object cannot be pickled: {type(exc).__name__}: {exc}")
    agree(comm, "allgather_object", [(name or "object", "pickle")], timeout_s, problem)
    if comm.size == 1:
        return [obj]
    label = comm.payload_name("allgather_object")
    mine = seal(comm.auth_key, "payload", f"{label}/from{comm.rank}", pickled)
    rows = allgather_bytes(comm, mine, timeout_s)
    return [obj if r == comm.rank else pickle.loads(unseal(comm.auth_key, "payload", f"{label}/from{r}", row))
            for r, row in enumerate(rows)]


@dataclass(frozen=True)
class _TensorLeaf:
    """Placeholder of a tensor leaf in a broadcast tree: what the receiver allocates, and where it lives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def broadcast_tree(tree: Any = None, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> Any:
    """Return root's ``tree`` on every rank; tensor leaves travel as fused tensor broadcasts.

    Receivers get new tensors: a leaf that is on the CPU at the root is on the CPU
    at the receiver, a CUDA leaf is on the receiver's ring device; ``tree`` is
    ignored on them. Plain leaves must be picklable.
    """
    comm = process_sets.current()
    is_root = comm.rank == root_rank
    skeleton, problem = None, None
    if is_root:
        try:
            leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_namedtuple)
            layout = [_TensorLeaf(tuple(x.shape), x.dtype, x.device.type == "cpu") if isinstance(x, torch.Tensor)
                      else x for x in leaves]
            skeleton = (pytree.treespec_dumps(spec), layout)
        except Exception as exc:  # noqa: BLE001 - a tree the root cannot describe is its argument error
            problem = TypeError(f"broadcast_tree: the root's tree cannot be sent: {type(exc).__name__}: {exc}")
    spec_text, layout = _broadcast_object(skeleton, root_rank, name or "tree", timeout_s, problem)
    if is_root and comm.size == 1:
        return tree
    slots = [i for i, x in enumerate(layout) if isinstance(x, _TensorLeaf)]
    if is_root:
        send = [leaves[i].detach().to(comm.device).contiguous() for i in slots]
    else:
        send = [torch.empty(layout[i].shape, dtype=layout[i].dtype, device=comm.device) for i in slots]
    grouped_broadcast_(send, root_rank, name=name or "tree", timeout_s=timeout_s)
    if is_root:
        return tree
    received = list(layout)
    for i, t in zip(slots, send):
        received[i] = t.cpu() if layout[i].on_cpu else t
    return pytree.tree_unflatten(received, pytree.treespec_loads(spec_text))


def _is_namedtuple(x: Any) -> bool:
    """Namedtuples travel whole, as plain leaves (their types cannot be named in a plain tree spec)."""
    return isinstance(x, tuple) and hasattr(x, "_fields")
