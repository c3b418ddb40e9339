"""Byte strings over a communicator: the transport under the object collectives and the
signature check's mismatch report. Nothing here authenticates or deserializes: callers that
unpickle what they receive must authenticate it first (see :mod:`elastic_ring.collectives.objects`).
"""

from __future__ import annotations

import ctypes

import torch

from .base import Communicator


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy (torch does not depend on it)."""
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _to_bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(0, dtype=torch.uint8, device=device)


def allgather_bytes(comm: Communicator, data: bytes, timeout_s: float | None) -> list[bytes]:
    """Every rank's ``data``, unauthenticated (no signature check: callers have agreed beforehand).
    Callers that deserialize the result must authenticate it (see :func:`allgather_object`)."""
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
    """Root's ``data`` on every rank, unauthenticated (no signature check)."""
    is_root = comm.rank == root_rank
    length = torch.tensor([len(data) if is_root else 0], dtype=torch.int64, device=comm.device)
    comm.broadcast(length, root_rank, timeout_s).wait()
    n = int(length.item())
    payload = _to_bytes_tensor(data, comm.device) if is_root else torch.empty(n, dtype=torch.uint8, device=comm.device)
    if n:
        comm.broadcast(payload, root_rank, timeout_s).wait()
    return _tensor_bytes(payload)
