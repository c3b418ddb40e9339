"""Who this process is in the current ring, for log lines and trace events.

:mod:`elastic_ring.ring.runtime` records each round's identity here when the round's
communicator is formed and clears it when the round ends; :mod:`elastic_ring.core.log`
and :mod:`elastic_ring.core.timeline` only read it. They therefore do not depend on the
runtime (which logs and traces), and the modules form no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import RingSpec


@dataclass(frozen=True)
class RingIdentity:
    rank: int
    world: int
    round_id: int
    text: str  # ``rank 2/4 round 7``

    @classmethod
    def of(cls, spec: RingSpec) -> "RingIdentity":
        return cls(spec.rank, spec.world_size, spec.round_id, spec.identity)


_current: RingIdentity | None = None


def set_current(identity: RingIdentity | None) -> None:
    """Called by the runtime only: the ring this process is now in (None: none)."""
    global _current
    _current = identity


def current() -> RingIdentity | None:
    return _current
