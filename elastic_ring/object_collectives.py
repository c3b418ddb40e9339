"""Collectives of Python objects and of trees that hold tensors.

* ``broadcast_object`` / ``allgather_object``: pickled objects as byte tensors.
* ``broadcast_tree``: a nested structure (dicts, lists, tuples) whose leaves
  are tensors or plain values, sent as a small pickled skeleton plus the
  tensors through fused broadcasts. The receivers need no tensors of their
  own, so it serves state sync to a fresh worker and optimizer state
  broadcast alike.
"""

from __future__ import annotations

import collections
import ctypes
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from . import runtime
from .communicator import Communicator
from .signature import verify_same


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy (torch does not depend on it)."""
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _to_bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(0, dtype=torch.uint8, device=device)


def allgather_bytes(comm: Communicator, data: bytes, timeout_s: float | None) -> list[bytes]:
    """Every rank's ``data`` (no signature check: callers have agreed beforehand)."""
    length = torch.tensor([len(data)], dtype=torch.int64, device=comm.device)
    lengths = torch.empty((comm.size, 1), dtype=torch.int64, device=comm.device)
    comm.allgather(lengths, length, timeout_s).wait()
    sizes = [int(n) for n in lengths.view(-1).tolist()]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=comm.device)
    padded[: len(data)] = _to_bytes_tensor(data, comm.device)
    gathered = torch.empty((comm.size, longest), dtype=torch.uint8, device=comm.device)
    comm.allgather(gathered, padded, timeout_s).wait()
    rows = gathered.cpu()
    return [_tensor_bytes(rows[r, : sizes[r]]) for r in range(comm.size)]


def broadcast_bytes(comm: Communicator, data: bytes | None, root_rank: int, timeout_s: float | None) -> bytes:
    """Root's ``data`` on every rank (no signature check)."""
    is_root = comm.rank == root_rank
    length = torch.tensor([len(data) if is_root else 0], dtype=torch.int64, device=comm.device)
    comm.broadcast(length, root_rank, timeout_s).wait()
    n = int(length.item())
    payload = _to_bytes_tensor(data, comm.device) if is_root else torch.empty(n, dtype=torch.uint8, device=comm.device)
    if n:
        comm.broadcast(payload, root_rank, timeout_s).wait()
    return _tensor_bytes(payload)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> Any:
    """Return root's ``obj`` on every rank (pickled; ``obj`` is ignored elsewhere)."""
    comm = runtime.current()
    verify_same(comm, f"broadcast_object(root={root_rank})", [(name or "object", "pickle")], timeout_s)
    if comm.size == 1:
        return obj
    data = pickle.dumps(obj) if comm.rank == root_rank else None
    return pickle.loads(broadcast_bytes(comm, data, root_rank, timeout_s))


def allgather_object(obj: Any, name: str | None = None, timeout_s: float | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank."""
    comm = runtime.current()
    verify_same(comm, "allgather_object", [(name or "object", "pickle")], timeout_s)
    if comm.size == 1:
        return [obj]
    return [pickle.loads(b) for b in allgather_bytes(comm, pickle.dumps(obj), timeout_s)]


#: Containers that broadcast_tree walks into; anything else is a pickled leaf.
_MAPPINGS = (dict, collections.OrderedDict)


@dataclass(frozen=True)
class _TensorSlot:
    """Placeholder of a tensor leaf in a broadcast skeleton."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _TensorSlot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if type(tree) in _MAPPINGS:
        return type(tree)((k, _split(v, tensors)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_split(v, tensors) for v in tree)
    return tree


def _join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if type(skeleton) in _MAPPINGS:
        return type(skeleton)((k, _join(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        return type(skeleton)(_join(v, tensors) for v in skeleton)
    return skeleton


def broadcast_tree(tree: Any = None, root_rank: int = 0, name: str | None = None, timeout_s: float | None = None) -> Any:
    """Return root's ``tree`` on every rank; tensor leaves travel as fused tensor broadcasts.

    Receivers get new tensors on the ring's device (CPU for gloo); ``tree`` is
    ignored on them. Plain leaves must be picklable.
    """
    from .collectives import grouped_broadcast_  # late: collectives imports this module

    comm = runtime.current()
    tensors: list[torch.Tensor] = []
    skeleton = _split(tree, tensors) if comm.rank == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name=name or "tree", timeout_s=timeout_s)
    if comm.rank == root_rank:
        if comm.size == 1:
            return tree
        send = [t.detach().to(comm.device).contiguous() for t in tensors]
    else:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        send = [torch.empty(s.shape, dtype=s.dtype, device=comm.device) for s in sorted(slots, key=lambda s: s.index)]
    grouped_broadcast_(send, root_rank, name=name or "tree", timeout_s=timeout_s)
    if comm.rank == root_rank:
        return tree
    return _join(skeleton, send)


def _collect_slots(skeleton: Any, out: list[_TensorSlot]) -> None:
    if isinstance(skeleton, _TensorSlot):
        out.append(skeleton)
    elif type(skeleton) in _MAPPINGS:
        for v in skeleton.values():
            _collect_slots(v, out)
    elif type(skeleton) in (list, tuple):
        for v in skeleton:
            _collect_slots(v, out)
