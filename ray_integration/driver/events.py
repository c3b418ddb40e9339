"""The membership history of a run: what happened, when, in which round, at which world size."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from elastic_ring.core.log import get_logger

_log = get_logger(__name__)


@dataclass(frozen=True)
class Event:
    kind: str                       # ring_formed, worker_lost, worker_joined, recovered, failed, finished, ...
    round_id: int | None
    world_size: int | None
    time: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    def __init__(self, listener: Callable[[Event], None] | None = None) -> None:
        self.events: list[Event] = []
        self._listener = listener

    def add(self, kind: str, round_id: int | None, world_size: int | None, **detail: Any) -> Event:
        event = Event(kind, round_id, world_size, detail=detail)
        self.events.append(event)
        _log.info("[driver round %s world %s] %s %s", round_id, world_size, kind, detail or "")
        if self._listener is not None:
            self._listener(event)  # an exception here ends the run (it is the caller's on_event)
        return event
