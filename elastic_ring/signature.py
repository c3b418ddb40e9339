"""Cross-rank agreement on what a collective is about to move.

Every public collective first reduces a 64-bit hash of its signature (the kind
of collective, its root, and each tensor's name, dtype and shape) with MAX over
``[h, -h, v1..v4]``: all ranks agree iff max(h) == min(h); the four value slots
let a caller agree on small flags in the same message. This costs one 48-byte
allreduce and catches, on every rank, what gloo or NCCL would otherwise turn
into a hang or silently wrong numbers (tensors of different shapes or dtypes,
different numbers of tensors, or different collectives called at the same
point). On disagreement, the ranks exchange their descriptions and all raise
:class:`TensorMismatchError` with one message that names the tensor and what
each rank passed.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Sequence

import torch

from .communicator import Communicator
from .errors import TensorMismatchError
from .ops import ReduceOp


#: Every probe has the same length, whatever the call, so that two ranks making
#: different calls still exchange equal-sized messages (gloo aborts the process
#: on a size mismatch): two hash words plus this many value slots.
VALUE_SLOTS = 4


def describe(t: torch.Tensor, ignore_first_dim: bool = False) -> str:
    dims = [str(d) for d in t.shape]
    if ignore_first_dim and dims:
        dims[0] = "*"
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(dims)}]"


def _hash(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=False) >> 2  # fits int64 with room for negation


class PendingCheck:
    """A signature check in flight; :meth:`finish` waits and raises on disagreement.

    ``values`` (small non-negative ints) ride along in the same allreduce and
    come back as their maximum over ranks, so a caller can agree on a flag in
    the very collective that checks alignment.
    """

    def __init__(
        self,
        comm: Communicator,
        kind: str,
        entries: Sequence[tuple[str, str]],
        timeout_s: float | None,
        values: Sequence[int] = (),
    ) -> None:
        self._comm, self._kind, self._entries, self._timeout_s = comm, kind, list(entries), timeout_s
        text = kind + "\n" + "\n".join(f"{n}\t{d}" for n, d in self._entries)
        self._hash = _hash(text)
        self._values = [int(v) for v in values]
        if len(self._values) > VALUE_SLOTS or any(v < 0 for v in self._values):
            raise ValueError(f"a check carries at most {VALUE_SLOTS} non-negative values, got {self._values}")
        padded = self._values + [0] * (VALUE_SLOTS - len(self._values))
        self._probe = torch.tensor([self._hash, -self._hash, *padded], dtype=torch.int64, device=comm.device)
        self._work = comm.allreduce(self._probe, ReduceOp.MAX, timeout_s) if comm.size > 1 else None

    def finish(self) -> list[int]:
        """Wait; return the maximum over ranks of each of ``values``."""
        if self._work is None:
            return self._values
        self._work.wait()
        self._work = None
        hi, neg_lo, *maxima = self._probe.tolist()
        if hi == self._hash and -neg_lo == self._hash:
            return maxima[: len(self._values)]
        from .object_collectives import allgather_bytes  # late: it imports this module

        payload = pickle.dumps((self._kind, self._entries))
        views = [pickle.loads(b) for b in allgather_bytes(self._comm, payload, self._timeout_s)]
        raise TensorMismatchError(_mismatch_message(views))


def start_check(
    comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None, values: Sequence[int] = ()
) -> PendingCheck:
    """Launch the check without waiting; call ``finish()`` before moving any data that depends on it."""
    return PendingCheck(comm, kind, entries, timeout_s, values)


def agree_max(kind: str, values: Sequence[int], timeout_s: float | None = None) -> list[int]:
    """One small collective on the current ring: check that every rank is making the
    same ``kind`` of call, and return the maximum over ranks of each of ``values``
    (small non-negative ints, e.g. flags). Raises :class:`TensorMismatchError` on
    every rank if some rank is making another call."""
    from . import runtime  # late: runtime imports log, which is fine, but keep signature import-light

    return start_check(runtime.current(), kind, [], timeout_s, values).finish()


def verify_same(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None) -> None:
    """Raise :class:`TensorMismatchError` on every rank unless all ranks passed the same ``(name, description)`` list."""
    start_check(comm, kind, entries, timeout_s).finish()


def _mismatch_message(views: list[tuple[str, list[tuple[str, str]]]]) -> str:
    kinds = [k for k, _ in views]
    if len(set(kinds)) > 1:
        calls = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
        return f"ranks called different collectives at the same point ({calls}); every rank must make the same calls in the same order"
    kind = kinds[0]
    counts = [len(e) for _, e in views]
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        return f"{kind}: ranks passed different numbers of tensors ({per_rank})"
    for position in range(counts[0]):
        column = [e[position] for _, e in views]
        if len(set(column)) > 1:
            per_rank = "; ".join(f"rank {r}: {name!r} {desc}" for r, (name, desc) in enumerate(column))
            return (
                f"{kind}: ranks disagree on tensor #{position} ({per_rank}); "
                "every rank must pass tensors of the same name, dtype and shape"
            )
    return f"{kind}: ranks disagree on the collective's signature"
