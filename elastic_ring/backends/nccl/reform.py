"""Re-forming an NCCL ring from the previous round's communicator: shrink on a loss, grow on a join.

A full NCCL init of every round costs 0.4-0.5 s on one GPU and, by public
reports, tens of seconds on 8 GPUs of a node and minutes at a thousand. NCCL
can instead derive the next communicator from the live one: ``ncclCommShrink``
(2.27) and ``ncclCommGrow`` with ``ncclCommGetUniqueId`` (2.29).

Only a *healthy* communicator is shrunk: a graceful leave (a drained or stopped
worker) or a member left out of a round. A communicator that failed is aborted
as before and the next round is a full init: on NCCL 2.28.9 (H200, 2026-11-26)
``ncclCommShrink`` of a communicator with an asynchronous error was refused
even with ``NCCL_SHRINK_ABORT`` (it returned the error, ``ncclRemoteError``),
and ``ncclCommRevoke`` of it never became quiescent (its state stayed
``ncclInProgress`` for 5 s, and a shrink of it was refused).

NCCL's child communicator is made by an asynchronous job that may write the
new handle after the call returned, so the out-pointer and the buffers given
to the call are owned by an :class:`~elastic_ring.backends.nccl.lib.OutComm` that lives
until the child settles (or for the life of the process when abandoned).

With ``RingSpec.nccl_reform="shrink_grow"`` and the previous round named in the
spec (``parent_round`` and ``parent_ranks``: for each new rank, its rank in
that round, ``-1`` for a newcomer), a round is formed

* by **shrink** when its members are the parent's minus some ranks, in the
  parent's order (NCCL numbers the survivors in that order);
* by **grow** when its members are the parent's, in their ranks, followed by
  newcomers (NCCL gives newcomers the ranks after the members');
* by a **full init** otherwise: a mix of leaves and joins, a reorder, or any
  rank that cannot take part (its previous communicator failed and was
  aborted, or the loaded libnccl lacks the function).

Every rank must take the same path, and whether a rank *can* take part is local
knowledge (an older libnccl, a communicator aborted by the watchdog). So each
rank publishes its token (``shrink``, ``grow`` or ``init``) before the round's
arrival barrier; after it, every rank reads all tokens (one authenticated
``multi_get``) and the path is the common kind when every token names it, else
a full init (:func:`agreed`). A forged token can only turn a shrink into a
full init or fail the round, which anyone who can write the store can do anyway.

A shrink or grow that fails or outlives ``connect_timeout_s`` fails the round
like a failed init (CommError, the new handle aborted); the parent is aborted
after the attempt either way, so the driver's next round is a full init.

The decisions here are pure and tested with tables (``tests/test_nccl_reform.py``);
the handle operations take a library object, so they run against a fake library on CPU.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ...core.errors import CommError
from .handle import CommHandle, settle_or_abort
from .lib import IN_PROGRESS, RESULT_NAMES, SUCCESS, NcclError

SHRINK, GROW, INIT = "shrink", "grow", "init"
MODES = ("init", "shrink_grow")
TOKEN_KEY = "nccl/reform/"
GROW_ID_KEY = "nccl/grow_id"

_NEEDS = {SHRINK: "ncclCommShrink", GROW: "ncclCommGrow"}


@dataclass(frozen=True)
class Plan:
    """What the spec asks of this rank: ``kind`` (shrink or grow), and for a grow whether this rank is new."""

    kind: str
    parent_round: int
    members: int  # ranks of the new round that were in the parent
    exclude: tuple[int, ...] = ()  # shrink: the parent's ranks that are left out (needs the parent's size)

    @property
    def needs(self) -> str:
        return _NEEDS[self.kind]


def classify(parent_ranks: tuple[int, ...] | None) -> str:
    """The kind of transition ``parent_ranks`` describes: SHRINK (every rank was a member, in the parent's
    order), GROW (the parent's ranks 0..k-1 in place, then newcomers), INIT otherwise (or without a parent)."""
    if not parent_ranks:
        return INIT
    old = [r for r in parent_ranks if r >= 0]
    if len(old) == len(parent_ranks):
        return SHRINK if all(a < b for a, b in zip(old, old[1:])) else INIT
    k = len(old)
    if k >= 1 and tuple(parent_ranks[:k]) == tuple(range(k)) and all(r == -1 for r in parent_ranks[k:]):
        return GROW
    return INIT


def plan_for(parent_round: int | None, parent_ranks: tuple[int, ...] | None, parent_size: int | None) -> Plan | None:
    """This rank's plan, given the parent communicator's size as this rank knows it (None: it holds none).

    None when the transition is a full init, or when the parent's size contradicts the spec (a member of
    the parent that sees another size must not shrink or grow: its token will say init)."""
    kind = classify(parent_ranks)
    if kind == INIT or parent_round is None:
        return None
    members = sum(1 for r in parent_ranks if r >= 0)  # type: ignore[union-attr]
    if kind == SHRINK:
        if parent_size is None:
            return Plan(SHRINK, parent_round, members)
        if max(parent_ranks) >= parent_size or members >= parent_size:  # type: ignore[arg-type]
            return None  # not a shrink of this parent (nothing left out, or ranks it does not have)
        exclude = tuple(sorted(set(range(parent_size)) - set(parent_ranks)))  # type: ignore[arg-type]
        return Plan(SHRINK, parent_round, members, exclude)
    if parent_size is not None and parent_size != members:
        return None  # members of the parent were lost too: a mix, not a grow
    return Plan(GROW, parent_round, members)


def token(plan: Plan | None, my_parent_rank: int, parent_alive: bool, has: Callable[[str], bool]) -> bytes:
    """What this rank publishes: the plan's kind when it can take part, else ``init``."""
    if plan is None or not has(plan.needs):
        return INIT.encode()
    if my_parent_rank >= 0 and not parent_alive:
        return INIT.encode()  # a member whose previous communicator is gone cannot shrink or grow it
    if plan.kind == SHRINK and not plan.exclude:
        return INIT.encode()  # a member always knows the parent's size; without it there is nothing to shrink
    return plan.kind.encode()


#: Environment variables that make a child share its parent's resources (then aborting the parent, as
#: :meth:`release` does, would end the child too): a rank that sees one set publishes init.
SHARE_VARIABLES = ("NCCL_COMM_SHRINK_SHARE_RESOURCES", "NCCL_COMM_SPLIT_SHARE_RESOURCES")


def shares_resources(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name, "0").strip() not in ("", "0") for name in SHARE_VARIABLES)


def token_key(spec, rank: int) -> str:
    return f"{spec.store_prefix}{TOKEN_KEY}{rank}"


def publish_token(store, spec, parent_size: int | None, parent_rank: int | None, usable: bool,
                  has: Callable[[str], bool]) -> Plan | None:
    """Before the round's arrival barrier: this rank's plan, and its token in the store. ``parent_size`` and
    ``parent_rank`` describe the communicator this process holds for ``spec.parent_round`` (None: none);
    ``usable``: it is alive, healthy and idle."""
    plan = plan_for(spec.parent_round, spec.parent_ranks, parent_size)
    mine = spec.parent_ranks[spec.rank]
    # the spec says this process had another rank in the parent: the communicator it holds is not that one
    usable = usable and (mine < 0 or parent_rank == mine)
    store.set(token_key(spec, spec.rank), token(plan, mine, usable, has))
    return plan


def agree(store, spec, plan: Plan | None, grow_id: Callable[[], bytes],
          seconds_left: float) -> tuple[str, bytes | None]:
    """After the barrier: the path every rank takes (every token read) and, for a grow, the id this rank
    passes (the root makes it with ``grow_id()`` and publishes it; other members pass none; a newcomer
    waits for it). For INIT the caller exchanges a full init's unique id as usual."""
    path = agreed(store.multi_get([token_key(spec, r) for r in range(spec.world_size)]), plan)
    if path != GROW:
        return path, None
    key = spec.store_prefix + GROW_ID_KEY
    if spec.rank == 0:  # a grow's rank 0 is the parent's rank 0: the root
        unique_id = grow_id()
        store.set(key, unique_id)
        return path, unique_id
    if spec.parent_ranks[spec.rank] >= 0:
        return path, None
    store.wait([key], datetime.timedelta(seconds=max(seconds_left, 0.001)))
    return path, store.get(key)


def agreed(tokens: list[bytes], plan: Plan | None) -> str:
    """The path every rank takes: the plan's kind when every token names it, else INIT."""
    if plan is None:
        return INIT
    want = plan.kind.encode()
    return plan.kind if tokens and all(bytes(t) == want for t in tokens) else INIT


# ---------------------------------------------------------------- handle operations (CUDA-free)
def _await_child(lib, out, status: int, parent: CommHandle | None, what: str, deadline: float, identity: str,
                 timeout_s: float, clock: Callable[[], float], sleep: Callable[[float], None]) -> CommHandle:
    """The child communicator NCCL writes into ``out`` (maybe after the call returned: its job is asynchronous),
    settled. CommError when the call or the parent failed, or past ``deadline`` (``out`` is then abandoned,
    since NCCL may still write into it: a handle that comes later is aborted by its reaper)."""
    if status not in (SUCCESS, IN_PROGRESS):
        out.abandon(lib)
        detail = lib.last_error(None) or lib.error_string(status)
        raise CommError(f"[{identity}] NCCL {what} failed ({RESULT_NAMES.get(status, status)}: {detail})")
    delay = 50e-6
    while out.value is None:
        state = parent.state() if parent is not None else None
        if parent is not None and state is None:
            out.abandon(lib)
            raise CommError(f"[{identity}] NCCL {what} failed: the parent communicator was aborted meanwhile")
        if state is not None and state not in (SUCCESS, IN_PROGRESS):
            out.abandon(lib)
            raise CommError(f"[{identity}] NCCL {what} failed: the parent communicator reports {parent.describe(state)}")
        if clock() > deadline:
            out.abandon(lib)
            raise CommError(f"[{identity}] NCCL {what} gave no communicator within connect_timeout_s={timeout_s}; "
                            "a peer did not take part")
        sleep(delay)
        delay = min(delay * 2, 2e-3)
    handle = CommHandle(lib, out.value)
    handle.keep = out  # NCCL's job may still read the buffers it was given until the child settles
    return settle_or_abort(handle, what, deadline, identity,
                           f"NCCL {what} did not finish within connect_timeout_s={timeout_s}; "
                           "a peer did not take part (the new communicator was aborted)",
                           lambda exc: f"NCCL {what} failed: {exc}", clock, sleep)


def shrink(parent: CommHandle, exclude: tuple[int, ...], deadline: float, identity: str,
           timeout_s: float, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> CommHandle:
    """The (healthy, idle) parent without ``exclude``, as a new handle (``NCCL_SHRINK_DEFAULT``)."""
    lib = parent.lib
    try:
        out, status = parent.derive("ncclCommShrink", lambda p: lib.shrink_nonblocking(p, list(exclude), False))
    except NcclError as exc:
        raise CommError(f"[{identity}] NCCL ncclCommShrink failed: {exc}") from exc
    return _await_child(lib, out, status, parent, "ncclCommShrink", deadline, identity, timeout_s, clock, sleep)


def split(parent: CommHandle, key: int, blocking: bool, deadline: float, identity: str, timeout_s: float,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> CommHandle:
    """A child of every rank of ``parent`` (one color; ``key`` orders the ranks), blocking or not. Not used by the
    runtime: the blocking child for bucket allreduces is the launch design not taken yet (docs/gpu.md), measured by
    ``benchmarks.nccl_launch``. With ``blocking`` the call itself waits for every rank of ``parent``."""
    lib = parent.lib
    try:
        out, status = parent.derive("ncclCommSplit", lambda p: lib.split(p, 0, key, blocking))
    except NcclError as exc:
        raise CommError(f"[{identity}] NCCL ncclCommSplit failed: {exc}") from exc
    return _await_child(lib, out, status, parent, "ncclCommSplit", deadline, identity, timeout_s, clock, sleep)


def grow_id(parent: CommHandle, identity: str) -> bytes:
    """The root's single-use id for growing ``parent`` (``ncclCommGetUniqueId``)."""
    try:
        return parent.derive("ncclCommGetUniqueId", parent.lib.comm_unique_id)
    except NcclError as exc:
        raise CommError(f"[{identity}] NCCL ncclCommGetUniqueId failed: {exc}") from exc


def grow(lib, parent: CommHandle | None, world_size: int, unique_id: bytes | None, rank: int, deadline: float,
         identity: str, timeout_s: float, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> CommHandle:
    """A member passes its ``parent`` (and the id only on the root); a newcomer ``parent=None``, the id and its rank."""
    try:
        if parent is not None:
            out, status = parent.derive("ncclCommGrow", lambda p: lib.grow_nonblocking(p, world_size, unique_id, -1))
        else:
            out, status = lib.grow_nonblocking(None, world_size, unique_id, rank)
    except NcclError as exc:
        raise CommError(f"[{identity}] NCCL ncclCommGrow failed: {exc}") from exc
    return _await_child(lib, out, status, parent, "ncclCommGrow", deadline, identity, timeout_s, clock, sleep)
