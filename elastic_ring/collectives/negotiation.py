"""Named ``_async`` operations paired by name, as Horovod's coordinator pairs them (used by ``hvd``).

Horovod matches an ``_async`` operation that has a ``name`` with the other ranks' operations of the same name,
whatever order the ranks submitted them in; an operation stays pending until every rank submitted its name,
and other collectives overtake it meanwhile (``hvd.barrier()`` completes while a named operation waits for a
rank that submits it after the barrier). Here a named operation is *parked* when it is called: nothing is sent,
:func:`~elastic_ring.collectives.handles.poll` says False. A rank that synchronizes a parked handle negotiates
with the other ranks, which must be synchronizing too (any parked handle of theirs on the same communicator):

1. one checked allgather of every rank's names in flight (as 64-bit hashes, in the order it submitted them; a
   rank waiting in ``join()`` sends none and mirrors it, as for any allgather);
2. the names every rank (that has not joined) submitted are ready; every rank runs its ready operations, in
   the order the lowest-ranked participant submitted them, each as the collective it is (its own signature
   check: the same name with another dtype or shape raises ``TensorMismatchError`` from its ``synchronize``);
3. until the handle being synchronized ran, again after a short sleep (1 ms, doubling to 50 ms), for at most
   the communicator's ``collective_timeout_s``; then every rank gives up in the same round and the
   synchronize raises ``TensorMismatchError``, naming the ranks that never submitted the name (a program
   error, not a failed ring: nothing re-forms).

Unnamed operations never park: they run on the communicator's ordered queue in call order
(:mod:`.ordered`). Parked operations of a torn-down round fail with ``CommError`` at their ``synchronize``;
:func:`cancel_all` fails every parked operation of this process (``hvd.init()`` / ``hvd.shutdown()``).

The cost (measured in docs/migration.md): nothing while parked, one allgather of the names per negotiation
round at ``synchronize``. A named operation therefore does not overlap the work between its call and its
``synchronize`` (an unnamed one does); a rank that synchronizes a named operation while a peer makes a
different collective gets ``TensorMismatchError`` on both, where Horovod's background thread would have
paired the name in between.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..backends.base import Communicator
from ..core.errors import TensorMismatchError
from ..ring import process_sets
from ..reduction.signature import describe
from .agreement import agree
from .handles import Handle
from .tensors import gather_rows

#: The kind of the negotiation's allgather (what a peer's mismatch message shows).
NEGOTIATE = "hvd.synchronize(named _async operations)"
#: Row markers: "this rank takes part" and "this rank gives up (its deadline passed)"; hashes are >= 0.
_HERE, _GIVE_UP = -1, -2
#: Sleeps between negotiation rounds that ran nothing (doubling), so that waiting ranks do not spin.
FIRST_SLEEP_S, MAX_SLEEP_S = 0.001, 0.05

_lock = threading.Lock()
_tables: "weakref.WeakKeyDictionary[Communicator, _Table]" = weakref.WeakKeyDictionary()


def name_hash(key: str) -> int:
    """The 62-bit hash of a named operation's key (``"allreduce.weights"``) that the ranks compare."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 2


class _Table:
    """The parked operations of one communicator, in the order this process submitted them."""

    def __init__(self) -> None:
        #: hash -> (key, handle, start, the caller's contextvars)
        self.parked: dict[int, tuple[str, Handle, Callable[[], Any], contextvars.Context]] = {}


def park(comm: Communicator, key: str, start: Callable[[], Any]) -> Handle:
    """A handle for the named operation ``key`` on ``comm``; ``start`` runs when every rank submitted ``key``
    and this rank synchronizes it (or any parked handle of ``comm``). A ring of one runs it on the queue."""
    if comm.size == 1:
        return Handle.queued(comm, start)
    digest = name_hash(key)
    with _lock:
        table = _tables.get(comm)
        if table is None:
            table = _tables[comm] = _Table()
        if digest in table.parked:
            raise ValueError(f"the named operation {key!r} is already in flight on this ring; synchronize it first")
        handle = Handle.parked(lambda h: _resolve(comm, h))
        table.parked[digest] = (key, handle, start, contextvars.copy_context())
    return handle


def cancel_all(reason: str) -> None:
    """Fail every parked operation of this process with ``ValueError(reason)`` (they will never be paired)."""
    with _lock:
        tables = list(_tables.values())
        for table in tables:
            entries = list(table.parked.values())
            table.parked.clear()
            for entry in entries:
                entry[1].fail(ValueError(reason))


def in_flight(comm: Communicator) -> list[str]:
    """The keys of ``comm``'s parked operations, in submission order."""
    with _lock:
        table = _tables.get(comm)
        return [] if table is None else [entry[0] for entry in table.parked.values()]


def _take(comm: Communicator, digest: int) -> tuple[str, Handle, Callable[[], Any], contextvars.Context] | None:
    with _lock:
        table = _tables.get(comm)
        return None if table is None else table.parked.pop(digest, None)


def _resolve(comm: Communicator, handle: Handle) -> None:
    """Negotiate on ``comm`` until ``handle`` ran (or fail it)."""
    try:
        _negotiate(comm, handle)
    except Exception as exc:  # noqa: BLE001 - the synchronize of `handle` raises it
        with _lock:
            table = _tables.get(comm)
            if table is not None:
                for digest, entry in list(table.parked.items()):
                    if entry[1] is handle:
                        del table.parked[digest]
        handle.fail(exc)


def _negotiate(comm: Communicator, handle: Handle) -> None:
    deadline = time.monotonic() + float(comm.spec.collective_timeout_s)
    sleep_s = FIRST_SLEEP_S
    while not handle.started:
        ran = _round(comm, handle, give_up=time.monotonic() > deadline)
        if handle.started:
            return
        if not ran:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, MAX_SLEEP_S)


def _round(comm: Communicator, handle: Handle, give_up: bool) -> int:
    """One negotiation round; returns how many operations ran."""
    with _lock:
        table = _tables.get(comm)
        mine = [] if table is None else list(table.parked)
        target = next((d for d, entry in (table.parked.items() if table else ()) if entry[1] is handle), None)
    rows = [[comm.rank, _HERE]] + [[comm.rank, d] for d in mine] + ([[comm.rank, _GIVE_UP]] if give_up else [])
    table_rows = torch.tensor(rows, dtype=torch.int64)
    try:  # an allgather (a rank waiting in join() mirrors it with no rows), checked under its own kind
        agree(comm, NEGOTIATE, [("names", describe(table_rows, ignore_first_dim=True))], None, None,
              join_plan={"run": "allgather", "dtype": "int64", "rest": [2]})
        gathered = (gather_rows(comm, table_rows, None, None) if comm.size > 1 else table_rows).tolist()
    except TensorMismatchError as exc:
        raise TensorMismatchError(
            f"synchronize() of a named _async operation pairs it by name with the other ranks' named operations, "
            f"so the other ranks must be in synchronize() too (of any named handle), not in another collective: "
            f"{exc}") from None
    lists: dict[int, list[int]] = {}
    quitters = set()
    for rank, digest in gathered:
        if digest == _HERE:
            lists.setdefault(rank, [])
        elif digest == _GIVE_UP:
            quitters.add(rank)
        else:
            lists.setdefault(rank, []).append(digest)
    everyone = [set(v) for v in lists.values()]
    first = lists[min(lists)]
    ready = [d for d in first if all(d in s for s in everyone)]
    ran = 0
    for digest in ready:
        entry = _take(comm, digest)
        if entry is None:  # cannot happen: this rank sent it
            raise RuntimeError(f"[{comm.spec.identity}] the negotiation of named operations lost track of one")
        _, parked, start, context = entry
        with process_sets.scope_of(comm):
            context.run(parked.run, start)
        ran += 1
    if quitters and target is not None and not handle.started:
        key = _key_of(comm, target) or "?"
        missing = sorted(r for r, s in lists.items() if target not in s)
        raise TensorMismatchError(
            f"[{comm.spec.identity}] the named operation {key!r} was not submitted by rank(s) {missing} within "
            f"collective_timeout_s={comm.spec.collective_timeout_s:g} (every rank must call an _async operation of "
            "that name and synchronize it); it did not run")
    if quitters:
        raise TensorMismatchError(f"[{comm.spec.identity}] rank(s) {sorted(quitters)} gave up pairing named "
                                  "operations (a name was never submitted by some rank); this synchronize stops "
                                  "with them")
    return ran


def _key_of(comm: Communicator, digest: int) -> str | None:
    with _lock:
        table = _tables.get(comm)
        entry = None if table is None else table.parked.get(digest)
        return None if entry is None else entry[0]


__all__ = ["FIRST_SLEEP_S", "MAX_SLEEP_S", "NEGOTIATE", "cancel_all", "in_flight", "name_hash", "park"]
