"""Cross-rank agreement on what a collective is about to move.

Every public collective first reduces a 64-bit hash of its signature (the kind
of collective, its root, and each tensor's name, dtype and shape) with MAX over
``[h, -h, v1..v4]``: all ranks agree iff max(h) == min(h); the four value slots
let a caller agree on small numbers in the same message. A caller may also
pass a ``step`` (a transaction id, e.g. the optimizer step about to be
reduced): it takes two of the slots, ``s`` and ``BIG - s``, whose maxima give
the largest and the smallest step over the ranks, so disagreement is caught in
the same round trip (a rank that sends zeros there is left out). This costs one 48-byte allreduce and catches, on every
rank, what gloo or NCCL would otherwise turn into a hang or silently wrong
numbers (tensors of different shapes or dtypes, different numbers of tensors,
different collectives called at the same point, ranks at different steps). On
disagreement, the ranks exchange their descriptions (as JSON: nothing is
unpickled) and all raise :class:`TensorMismatchError` with one message that
names the tensor and what each rank passed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import torch

from ..backends.base import Communicator
from ..backends.byte_collectives import allgather_bytes
from ..core.errors import TensorMismatchError
from ..core.ops import ReduceOp


#: Every probe has the same length, whatever the call, so that two ranks making
#: different calls still exchange equal-sized messages (gloo aborts the process
#: on a size mismatch): two hash words plus this many value slots.
VALUE_SLOTS = 4

#: Steps (transaction ids) must be below this; ``BIG - step`` rides in a MAX slot.
BIG = 1 << 62


def describe(t: torch.Tensor, ignore_first_dim: bool = False) -> str:
    dims = [str(d) for d in t.shape]
    if ignore_first_dim and dims:
        dims[0] = "*"
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(dims)}]"


def signature_hash(kind: str, entries: Sequence[tuple[str, str]]) -> int:
    """The 62-bit hash that ranks compare (callers that check often may compute it once)."""
    text = kind + "\n" + "\n".join(f"{n}\t{d}" for n, d in entries)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=False) >> 2  # fits int64 with room for negation


class PendingCheck:
    """A signature check in flight; :meth:`finish` waits and raises on disagreement.

    ``values`` (small non-negative ints) ride along in the same allreduce and
    come back as their maximum over ranks, so a caller can agree on a flag in
    the very collective that checks alignment. On CUDA the probe goes to the
    device from pinned memory without blocking the host; only :meth:`finish`
    waits.
    """

    def __init__(
        self,
        comm: Communicator,
        kind: str,
        entries: Sequence[tuple[str, str]],
        timeout_s: float | None,
        values: Sequence[int] = (),
        step: int | None = None,
        digest: int | None = None,
        step_slots: bool | None = None,
    ) -> None:
        self._comm, self._kind, self._entries, self._timeout_s = comm, kind, list(entries), timeout_s
        self._hash = signature_hash(kind, self._entries) if digest is None else digest
        self._values = [int(v) for v in values]
        self._step = step
        self._step_slots = step is not None if step_slots is None else step_slots
        self.same_call = True  # after finish(): whether the ranks made the same call (only steps may differ)
        slots = list(self._values)
        if self._step_slots:  # a rank without a step sends zeros: neutral for both maxima
            if step is not None and (not isinstance(step, int) or not 0 <= step < BIG):
                raise ValueError(f"step={step!r} must be an int in [0, 2**62)")
            slots = ([0, 0] if step is None else [step, BIG - step]) + slots
        if len(slots) > VALUE_SLOTS or any(v < 0 for v in self._values):
            raise ValueError(f"a check carries at most {VALUE_SLOTS} non-negative values (a step takes two), got {slots}")
        padded = [self._hash, -self._hash] + slots + [0] * (VALUE_SLOTS - len(slots))
        for ref in list(getattr(comm, "before_check", ())):  # gradient buckets gated on a helper launch first
            settle = ref()
            if settle is not None:
                settle()
        host = torch.tensor(padded, dtype=torch.int64)
        if comm.device.type == "cuda":
            self._probe = host.pin_memory().to(comm.device, non_blocking=True)
        else:
            self._probe = host.to(comm.device)
        self._work = comm.allreduce(self._probe, ReduceOp.MAX, timeout_s) if comm.size > 1 else None

    def finish(self, exchange: bool = True) -> list[int]:
        """Wait; return the maximum over ranks of each of ``values``.

        On disagreement every rank raises :class:`TensorMismatchError`; with
        ``exchange`` (the default) the ranks first swap their descriptions so
        the message says what each rank passed. Callers that may already have
        sent data of a size the check did not vouch for pass ``exchange=False``
        (the swap could pair with that data).
        """
        if self._work is None:
            return self._values
        self._work.wait()
        self._work = None
        hi, neg_lo, *maxima = self._probe.tolist()
        self.same_call = hi == self._hash and -neg_lo == self._hash
        steps: tuple[int | None, int | None] = (None, None)
        if self._step_slots:
            if maxima[1] > 0:  # some rank sent a step: compare the smallest and the largest
                steps = (BIG - maxima[1], maxima[0])
            maxima = maxima[2:]
        if self.same_call and steps[0] == steps[1]:
            return maxima[: len(self._values)]
        if exchange:
            raise TensorMismatchError(self.exchange_message())
        raise TensorMismatchError(_local_message(self._kind, self.same_call, steps))

    def exchange_message(self) -> str:
        """After a disagreement (on every rank): swap descriptions and say what each rank passed."""
        return exchange_message(self._comm, self._kind, self._entries, self._step, self._timeout_s)


def exchange_message(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], step: int | None,
                     timeout_s: float | None) -> str:
    """After a disagreement every rank saw: swap descriptions (plain JSON) and say what each rank passed."""
    mine = json.dumps({"kind": kind, "entries": list(entries), "step": step}).encode()
    views = [_decode(data, rank) for rank, data in enumerate(allgather_bytes(comm, mine, timeout_s))]
    return _mismatch_message(views)


def start_check(
    comm: Communicator,
    kind: str,
    entries: Sequence[tuple[str, str]],
    timeout_s: float | None,
    values: Sequence[int] = (),
    step: int | None = None,
    digest: int | None = None,
    step_slots: bool | None = None,
) -> PendingCheck:
    """Launch the check without waiting; call ``finish()`` before moving any data that depends on it.

    ``step`` (a transaction id) is compared across the ranks that send one; with
    ``step_slots=True`` a rank may send ``step=None`` (not compared) in the same
    probe layout as its peers.
    """
    return PendingCheck(comm, kind, entries, timeout_s, values, step, digest, step_slots)


def verify_same(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None) -> None:
    """Raise :class:`TensorMismatchError` on every rank unless all ranks passed the same ``(name, description)`` list."""
    start_check(comm, kind, entries, timeout_s).finish()


def _decode(data: bytes, rank: int) -> dict[str, Any]:
    """A peer's description, validated field by field (it is plain JSON, never unpickled)."""
    try:
        view = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorMismatchError(f"ranks disagree on a collective, and rank {rank}'s description is unreadable ({exc})") from None
    entries = view.get("entries") if isinstance(view, dict) else None
    if (
        not isinstance(view, dict)
        or not isinstance(view.get("kind"), str)
        or not isinstance(entries, list)
        or not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in entries)
        or not (view.get("step") is None or isinstance(view.get("step"), int))
    ):
        raise TensorMismatchError(f"ranks disagree on a collective, and rank {rank}'s description is malformed: {view!r:.200}")
    return {"kind": view["kind"], "entries": [tuple(e) for e in entries], "step": view.get("step")}


def _local_message(kind: str, same_call: bool, steps: tuple[int | None, int | None]) -> str:
    if same_call:
        return (f"{kind}: ranks are at different optimizer steps (between {steps[0]} and {steps[1]}); "
                "every rank must reduce the same step: sync the training state before stepping again")
    return (f"{kind}: ranks disagree on this step's collective (different models, or a collective that only "
            "some ranks called); it was detected after gradient buckets were sent (asynchronous check), "
            "so the ring was aborted. Every rank must pass the same parameters and make the same calls")


def _mismatch_message(views: list[dict[str, Any]]) -> str:
    kinds = [v["kind"] for v in views]
    if len(set(kinds)) > 1:
        calls = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
        return f"ranks called different collectives at the same point ({calls}); every rank must make the same calls in the same order"
    kind = kinds[0]
    counts = [len(v["entries"]) for v in views]
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        return f"{kind}: ranks passed different numbers of tensors ({per_rank})"
    for position in range(counts[0]):
        column = [v["entries"][position] for v in views]
        if len(set(column)) > 1:
            per_rank = "; ".join(f"rank {r}: {name!r} {desc}" for r, (name, desc) in enumerate(column))
            return (
                f"{kind}: ranks disagree on tensor #{position} ({per_rank}); "
                "every rank must pass tensors of the same name, dtype and shape"
            )
    steps = [v["step"] for v in views]
    if len({s for s in steps if s is not None}) > 1:
        per_rank = ", ".join(f"rank {r}: {'not compared' if s is None else s}" for r, s in enumerate(steps))
        return (
            f"{kind}: ranks are at different optimizer steps ({per_rank}); every rank must reduce the same "
            "step, so the training state must be synced (e.g. state.sync(), or restore the same commit) "
            "before stepping again"
        )
    return f"{kind}: ranks disagree on the collective's signature"
