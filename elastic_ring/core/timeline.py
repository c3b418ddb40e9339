"""Timeline: this process's Chrome-trace events (fusion, collectives, commit, sync, membership).

The analogue of Horovod's timeline. Off by default; while off, every hook here
costs one flag check. The worker runtime turns it on for
``ElasticTrainer(timeline_path=...)``, drains the buffer every heartbeat and
sends the events to the driver, which writes one JSON file for all ranks
(open it in https://ui.perfetto.dev or chrome://tracing).

Events are Chrome trace-event dicts without ``pid``/``tid`` (the collector
assigns one process per worker and one thread per category). Times are
wall-clock microseconds, so ranks on one machine line up exactly and ranks on
different machines as well as their clocks agree. Every event's ``args`` carry
the rank, world size, round and step it happened at.

Categories: ``fusion`` (pack, unpack), ``collective`` (allreduce, broadcast,
allgather, barrier: from launch to completion, as async events because
buckets overlap), ``state`` (commit, restore, sync), ``membership``
(re-forming the ring, collective failures, membership changes).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from typing import Any, Iterator

from . import identity as ring_identity, progress

#: Events buffered between two drains; beyond this the oldest are dropped (and counted).
MAX_BUFFERED_EVENTS = 200_000

_enabled = False
_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_BUFFERED_EVENTS)
_dropped = 0
_lock = threading.Lock()
_ids = itertools.count(1)


def enable() -> None:
    global _enabled
    _enabled = True


def disable() -> None:
    """Stop recording and forget what was not drained."""
    global _enabled, _dropped
    _enabled = False
    with _lock:
        _events.clear()
        _dropped = 0


def is_enabled() -> bool:
    return _enabled


def _identity() -> dict[str, Any]:
    ring = ring_identity.current()
    args: dict[str, Any] = {}
    if ring is not None:
        args = {"rank": ring.rank, "world": ring.world, "round": ring.round_id}
    step = progress.current().get("step")
    if step is not None:
        args["step"] = step
    return args


def _now_us() -> float:
    return time.time() * 1e6


def _append(event: dict[str, Any]) -> None:
    global _dropped
    with _lock:
        if len(_events) == MAX_BUFFERED_EVENTS:
            _dropped += 1  # the deque drops the oldest
        _events.append(event)


@contextlib.contextmanager
def span(name: str, category: str, **args: Any) -> Iterator[None]:
    """Record the enclosed code as one complete event (``ph: X``)."""
    if not _enabled:
        yield
        return
    start = _now_us()
    try:
        yield
    finally:
        _append({"name": name, "cat": category, "ph": "X", "ts": start, "dur": _now_us() - start,
                 "args": {**_identity(), **args}})


def instant(name: str, category: str, **args: Any) -> None:
    """Record a point in time (``ph: i``), e.g. a collective failure."""
    if _enabled:
        _append({"name": name, "cat": category, "ph": "i", "s": "t", "ts": _now_us(),
                 "args": {**_identity(), **args}})


def begin_async(name: str, category: str, **args: Any) -> int | None:
    """Start an async event (``ph: b``); returns its id for :func:`end_async` (None while off)."""
    if not _enabled:
        return None
    event_id = next(_ids)
    _append({"name": name, "cat": category, "ph": "b", "id": event_id, "ts": _now_us(),
             "args": {**_identity(), **args}})
    return event_id


def end_async(event_id: int | None, name: str, category: str, **args: Any) -> None:
    if event_id is not None:
        _append({"name": name, "cat": category, "ph": "e", "id": event_id, "ts": _now_us(), "args": args})


def drain() -> tuple[list[dict[str, Any]], int]:
    """Take the buffered events and how many were dropped since the last drain."""
    global _dropped
    with _lock:
        events, dropped = list(_events), _dropped
        _events.clear()
        _dropped = 0
    return events, dropped
