"""The formation's arrival barrier: what each rank writes to announce itself, and what the barrier waits for.

Each rank sets its own key ``{job}/round{n}/arrived/{rank}`` (what an error names when a rank never came) and
adds one to the round's arrival counter; the rank whose addition makes the counter reach ``world_size`` sets the
round's ``all_arrived`` key, the one key every other rank waits for (:class:`~.formation.Formation`). Per round the
store serves two or three operations and one single-key wait per rank; before, every rank waited on all
``world_size`` keys (about 1 ms of the store's one thread per rank at 1,024 ranks, so about 1 s per round).

Keys and counter are existence hints, never data: a forged one can only end the barrier early. The counter's and
``all_arrived``'s names carry a tag only the job's members can compute (a MAC of the round's prefix under the
job's secret), so a stranger cannot write them before the round's ranks do.
"""

from __future__ import annotations

from typing import Any

from ..core.auth import mac
from ..core.errors import CommError
from ..core.spec import RingSpec

ARRIVED = "arrived/"
#: The round's arrival counter (``store.add``) and the key set once it reached world_size (both named with a tag
#: that only the job's members can compute, :func:`counter_key`).
ARRIVALS = "arrivals"
ALL_ARRIVED = "all_arrived"


def arrival_key(spec: RingSpec, rank: int) -> str:
    return f"{spec.store_prefix}{ARRIVED}{rank}"


def _tag(spec: RingSpec) -> str:
    """A name only the job's members can compute (a MAC of the round's prefix under the job's secret): a stranger
    cannot write the round's counter before its ranks do."""
    if spec.auth_key is None:
        return "open"
    return mac(spec.auth_key, "arrivals", spec.store_prefix, b"")[:8].hex()


def counter_key(spec: RingSpec) -> str:
    return f"{spec.store_prefix}{ARRIVALS}/{_tag(spec)}"


def all_arrived_key(spec: RingSpec) -> str:
    return f"{spec.store_prefix}{ALL_ARRIVED}/{_tag(spec)}"


def announce_arrival(store: Any, spec: RingSpec) -> bool:
    """Announce ``spec.rank``'s arrival in ``spec``'s round: its own key (what the errors name), then the
    counter; the addition that makes the counter reach ``world_size`` releases every rank of the barrier.
    Returns True when this call released it (every rank had arrived).

    The store's server cannot add to a value that is not a number (one that a stranger wrote there): it closes
    the connection. That raises :class:`CommError` naming the counter, and the connection must not be used
    again (:attr:`Formation.store_broken`)."""
    counter = counter_key(spec)
    try:
        store.set(arrival_key(spec, spec.rank), b"1")
        count = int(store.add(counter, 1))
    except (RuntimeError, OSError) as exc:  # DistNetworkError: the server dropped the connection
        raise CommError(f"[{spec.identity}] could not announce this rank's arrival in round {spec.round_id} "
                        f"({type(exc).__name__}: {_first_line(exc)}): the rendezvous store is gone, or {counter!r} "
                        "holds something else than a count, written by something that is not part of the job "
                        "(docs/security.md)") from exc
    if count >= spec.world_size:
        store.set(all_arrived_key(spec), b"1")
        return True
    return False


def absent_ranks(store: Any, spec: RingSpec, most: int) -> list[int]:
    """Up to ``most`` ranks of ``spec``'s round, lowest first, whose arrival key is missing: one ``check`` of
    all keys, then halves of the groups that miss some (O(missing · log world_size) round trips, not one
    per rank)."""
    missing: list[int] = []
    groups = [range(spec.world_size)]
    while groups and len(missing) < most:
        group = groups.pop()
        if store.check([arrival_key(spec, r) for r in group]):
            continue
        if len(group) == 1:
            missing.append(group[0])
            continue
        half = len(group) // 2
        groups += [group[half:], group[:half]]  # the lower half is looked at first
    return missing


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
