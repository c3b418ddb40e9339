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

**Joined ranks.** A rank waiting in ``join()`` (:mod:`elastic_ring.collectives.join`)
answers every check with :func:`joined_probe`: ``JOIN_MARK`` (larger than any
hash) in the first word and less than any ``-h`` in the second. The others then
see the mark instead of their hash; every rank (joined or not) swaps its
description, and a caller's *join plan* (a small JSON value saying what data
path follows: the tensors' dtypes and shapes, the op, the root), in one
exchange, after which all of them know who joined and what runs
(:func:`judge`, the same pure verdict on every rank). The ranks that have not
joined then run their collective and the joined ones mirror it with neutral
tensors; or, when the call cannot be answered (no plan, a root that joined,
ranks that disagree), the ranks that have not joined raise
:class:`TensorMismatchError` and the joined ones wait for the next call. When
every rank of the ring sent the mark, the second word says so, and which rank
joined last.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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

#: A joined rank's first probe word: above every hash (hashes are < 2**62).
JOIN_MARK = 1 << 62
#: A joined rank's second word is ``-(JOIN_MARK + _RANKS) + f``, where ``f`` is its rank + 1 in the first probe
#: of its join() and 0 later: below every ``-h``, and its maximum over an all-joined ring names the last joiner.
_RANKS = 1 << 20


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
        join_plan: Any = None,
    ) -> None:
        self._comm, self._kind, self._entries, self._timeout_s = comm, kind, list(entries), timeout_s
        self._join_plan = join_plan  # what a joined rank mirrors (JSON, or a callable giving it); None: cannot
        self.joined: list[int] = []  # after finish(): the ranks that had joined (they answered with neutral data)
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
        if hi == JOIN_MARK:  # some rank waits in join(): settle who joined and what runs, with every rank
            self._joined_verdict(exchange)
            # the maxima are over the ranks that have not joined (joined ranks send zeros); their steps were
            # compared in the exchange
            return (maxima[2:] if self._step_slots else maxima)[: len(self._values)]
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

    def _joined_verdict(self, exchange: bool) -> None:
        """A rank has joined: swap descriptions and join plans with every rank; raise unless the ranks that have
        not joined agree on a call that the joined ones can answer (then :attr:`joined` names those)."""
        if not exchange:  # buckets went out before this verdict: nothing may be swapped on the ring now
            self.same_call = False
            raise TensorMismatchError(
                f"{self._kind}: a rank has joined (called join()) while this check was read after data was sent, "
                "which a joined rank cannot answer; use DistributedOptimizer(..., strict_checks=True) with join()")
        plan = self._join_plan() if callable(self._join_plan) else self._join_plan
        mine = {"kind": self._kind, "entries": self._entries, "step": self._step, "plan": plan}
        verdict = judge(swap_views(self._comm, mine, self._timeout_s))
        self.joined = verdict.joined
        if verdict.error is not None:
            self.same_call = False
            raise TensorMismatchError(verdict.error)


def exchange_message(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], step: int | None,
                     timeout_s: float | None) -> str:
    """After a disagreement every rank saw: swap descriptions (plain JSON) and say what each rank passed."""
    mine = json.dumps({"kind": kind, "entries": list(entries), "step": step}).encode()
    views = [_decode(data, rank) for rank, data in enumerate(allgather_bytes(comm, mine, timeout_s))]
    active = [(r, v) for r, v in enumerate(views) if not v.get("joined")]
    return (_mismatch_message([v for _, v in active], [r for r, _ in active])
            or f"{kind}: ranks disagree on the collective's signature")


def start_check(
    comm: Communicator,
    kind: str,
    entries: Sequence[tuple[str, str]],
    timeout_s: float | None,
    values: Sequence[int] = (),
    step: int | None = None,
    digest: int | None = None,
    step_slots: bool | None = None,
    join_plan: Any = None,
) -> PendingCheck:
    """Launch the check without waiting; call ``finish()`` before moving any data that depends on it.

    ``step`` (a transaction id) is compared across the ranks that send one; with
    ``step_slots=True`` a rank may send ``step=None`` (not compared) in the same
    probe layout as its peers. ``join_plan``: what a rank waiting in ``join()``
    mirrors (a JSON value, or a callable that gives it when a rank has joined);
    None: the call cannot run while a rank has joined, and raises.
    """
    return PendingCheck(comm, kind, entries, timeout_s, values, step, digest, step_slots, join_plan)


#: The join plan of a call whose data is the check itself (barrier, agree_max): a joined rank does nothing more.
NOTHING_MORE = {"run": "none"}


def verify_same(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None,
                join_plan: Any = None) -> None:
    """Raise :class:`TensorMismatchError` on every rank unless all ranks passed the same ``(name, description)`` list."""
    start_check(comm, kind, entries, timeout_s, join_plan=join_plan).finish()


# ------------------------------------------------------------------ joined ranks
class JoinProbe:
    """A joined rank's answer to the next check in flight; :meth:`finish` says what the ring does."""

    def __init__(self, comm: Communicator, first: bool, timeout_s: float | None) -> None:
        flag = comm.rank + 1 if first else 0
        padded = [JOIN_MARK, -(JOIN_MARK + _RANKS) + flag] + [0] * VALUE_SLOTS
        self._probe = torch.tensor(padded, dtype=torch.int64).to(comm.device)
        self._work = comm.allreduce(self._probe, ReduceOp.MAX, timeout_s)
        #: After finish(): the maxima of the check's value slots over the ranks that have not joined (what their
        #: ``finish()`` returns for a check without a step, e.g. ``agree_max``'s values).
        self.values: list[int] = []

    def finish(self) -> int | None:
        """Wait: the rank that joined last when every rank has joined (the join is over), else None (a rank
        that has not joined runs a collective: swap views with :func:`swap_views`, then :func:`judge`)."""
        self._work.wait()
        words = self._probe.tolist()
        hi, neg_lo = words[:2]
        self.values = words[2:]
        if hi != JOIN_MARK:
            raise TensorMismatchError(f"a joined rank's check met data that is not a check (first word {hi}); a "
                                      "collective without a check ran while a rank waited in join()")
        if neg_lo >= -JOIN_MARK:  # some rank sent -h: it has not joined
            return None
        last = neg_lo + JOIN_MARK + _RANKS - 1
        if not 0 <= last < _RANKS:
            raise TensorMismatchError(f"the ranks' join() ended with no rank named last (got {last})")
        return last


def swap_views(comm: Communicator, mine: dict[str, Any], timeout_s: float | None) -> list[dict[str, Any]]:
    """Every rank's view of the call after a joined probe: ``{"joined": true}`` from a joined rank, else its
    kind, entries, step and join plan (plain JSON, validated)."""
    data = json.dumps(mine).encode()
    return [_decode(raw, rank) for rank, raw in enumerate(allgather_bytes(comm, data, timeout_s))]


@dataclass(frozen=True)
class JoinVerdict:
    """What every rank concludes from the swapped views: the joined ranks, and either the plan the joined ones
    mirror or the error the others raise (then the joined ones do nothing)."""

    joined: list[int]
    plan: Any
    error: str | None


def judge(views: list[dict[str, Any]]) -> JoinVerdict:
    """A pure function of the views, so every rank reaches the same verdict."""
    joined = [r for r, v in enumerate(views) if v.get("joined")]
    active = [(r, v) for r, v in enumerate(views) if not v.get("joined")]
    who = f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))}"
    mismatch = _mismatch_message([v for _, v in active], [r for r, _ in active], check_steps=True)
    if mismatch is not None:
        return JoinVerdict(joined, None, f"{mismatch} ({who} waiting in join())")
    kind = active[0][1]["kind"]
    plans = [v.get("plan") for _, v in active]
    if any(p != plans[0] for p in plans):
        per_rank = "; ".join(f"rank {r}: {json.dumps(p)[:200]}" for (r, _), p in zip(active, plans))
        return JoinVerdict(joined, None, f"{kind}: the ranks that have not joined describe different data ({per_rank})")
    plan = plans[0]
    if not isinstance(plan, dict) or not isinstance(plan.get("run"), str):
        return JoinVerdict(joined, None, (
            f"{kind} cannot run while {who} have joined (called join()): a joined rank answers allreduce (it "
            "contributes the op's neutral element), allgather (no rows), broadcast and broadcast_object from a rank "
            "that has not joined, barrier, and DistributedOptimizer steps with a leading check; call this before "
            "any rank joins"))
    root = plan.get("root")
    if root is not None and root in joined:
        return JoinVerdict(joined, None, (
            f"{kind}: its root, rank {root}, has joined (called join()) and has nothing to send; broadcast from a "
            "rank that has not joined (join() returns the rank that joined last, which has the newest state)"))
    return JoinVerdict(joined, plan, None)


def _decode(data: bytes, rank: int) -> dict[str, Any]:
    """A peer's description, validated field by field (it is plain JSON, never unpickled)."""
    try:
        view = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorMismatchError(f"ranks disagree on a collective, and rank {rank}'s description is unreadable ({exc})") from None
    if isinstance(view, dict) and view.get("joined") is True:
        return {"joined": True}
    entries = view.get("entries") if isinstance(view, dict) else None
    if (
        not isinstance(view, dict)
        or not isinstance(view.get("kind"), str)
        or not isinstance(entries, list)
        or not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in entries)
        or not (view.get("step") is None or isinstance(view.get("step"), int))
    ):
        raise TensorMismatchError(f"ranks disagree on a collective, and rank {rank}'s description is malformed: {view!r:.200}")
    out = {"kind": view["kind"], "entries": [tuple(e) for e in entries], "step": view.get("step")}
    if view.get("plan") is not None:  # a join plan (after a joined rank's probe): what the joined ranks mirror
        out["plan"] = view["plan"]
    return out


def _local_message(kind: str, same_call: bool, steps: tuple[int | None, int | None]) -> str:
    if same_call:
        return (f"{kind}: ranks are at different optimizer steps (between {steps[0]} and {steps[1]}); "
                "every rank must reduce the same step: sync the training state before stepping again")
    return (f"{kind}: ranks disagree on this step's collective (different models, or a collective that only "
            "some ranks called); it was detected after gradient buckets were sent (asynchronous check), "
            "so the ring was aborted. Every rank must pass the same parameters and make the same calls")


def _mismatch_message(views: list[dict[str, Any]], ranks: Sequence[int] | None = None,
                      check_steps: bool = True) -> str | None:
    """What the ranks (``ranks[i]`` sent ``views[i]``; default: in order) disagree on; None if they agree."""
    ranks = list(range(len(views))) if ranks is None else list(ranks)
    kinds = [v["kind"] for v in views]
    if len(set(kinds)) > 1:
        calls = ", ".join(f"rank {r}: {k}" for r, k in zip(ranks, kinds))
        return f"ranks called different collectives at the same point ({calls}); every rank must make the same calls in the same order"
    kind = kinds[0]
    counts = [len(v["entries"]) for v in views]
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
        return f"{kind}: ranks passed different numbers of tensors ({per_rank})"
    for position in range(counts[0]):
        column = [tuple(v["entries"][position]) for v in views]
        if len(set(column)) > 1:
            per_rank = "; ".join(f"rank {r}: {name!r} {desc}" for r, (name, desc) in zip(ranks, column))
            return (
                f"{kind}: ranks disagree on tensor #{position} ({per_rank}); "
                "every rank must pass tensors of the same name, dtype and shape"
            )
    steps = [v["step"] for v in views]
    if check_steps and len({s for s in steps if s is not None}) > 1:
        per_rank = ", ".join(f"rank {r}: {'not compared' if s is None else s}" for r, s in zip(ranks, steps))
        return (
            f"{kind}: ranks are at different optimizer steps ({per_rank}); every rank must reduce the same "
            "step, so the training state must be synced (e.g. state.sync(), or restore the same commit) "
            "before stepping again"
        )
    return None
