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

Listeners (:func:`add_listener`) see every event as it is recorded, besides the
buffer; ``hvd.start_timeline`` records through one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from typing import Any, Callable, Iterator

from . import identity as ring_identity, progress
from .log import get_logger

_log = get_logger(__name__)

#: Events buffered between two drains; beyond this the oldest are dropped (and counted).
MAX_BUFFERED_EVENTS = 200_000

_enabled = False
_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_BUFFERED_EVENTS)
_dropped = 0
_lock = threading.Lock()
_ids = itertools.count(1)
#: Called with every event recorded (a tuple: replaced, never mutated, so _append reads it without the lock).
_listeners: tuple[Callable[[dict[str, Any]], None], ...] = ()
#: How many times each listener raised (its first failure is logged).
_listener_failures: dict[Callable[[dict[str, Any]], None], int] = {}


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


def add_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Call ``fn(event)`` with every event recorded from now on (while the timeline is enabled), on the thread
    that recorded it, outside the timeline's lock. An exception ``fn`` raises never reaches the code that
    recorded the event: its first one is logged (with traceback), later ones only counted
    (:func:`listener_failures`). Adding a listener does not enable the timeline."""
    global _listeners
    if not callable(fn):
        raise TypeError(f"timeline listener {fn!r} is not callable")
    with _lock:
        if fn in _listeners:
            raise ValueError(f"timeline listener {fn!r} is already added")
        _listeners = _listeners + (fn,)
        _listener_failures[fn] = 0


def remove_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Stop calling ``fn`` (an event being handed out on another thread right now may still reach it)."""
    global _listeners
    with _lock:
        if fn not in _listeners:
            raise ValueError(f"timeline listener {fn!r} was not added (or was removed already)")
        _listeners = tuple(f for f in _listeners if f != fn)
        _listener_failures.pop(fn, None)


def listener_failures(fn: Callable[[dict[str, Any]], None]) -> int:
    """How many times the added listener ``fn`` raised."""
    with _lock:
        if fn not in _listener_failures:
            raise ValueError(f"timeline listener {fn!r} was not added")
        return _listener_failures[fn]


def _notify(listeners: tuple[Callable[[dict[str, Any]], None], ...], event: dict[str, Any]) -> None:
    for fn in listeners:
        try:
            fn(event)
        except Exception:  # noqa: BLE001 - a listener must not break the collective that recorded the event
            with _lock:
                failures = _listener_failures.get(fn)
                if failures is not None:
                    _listener_failures[fn] = failures + 1
            if failures == 0:
                _log.exception("timeline listener %r raised on event %r; its later failures are counted, not "
                               "logged (timeline.listener_failures)", fn, event.get("name"))


def _append(event: dict[str, Any]) -> None:
    global _dropped
    with _lock:
        if len(_events) == MAX_BUFFERED_EVENTS:
            _dropped += 1  # the deque drops the oldest
        _events.append(event)
        listeners = _listeners
    if listeners:
        _notify(listeners, event)


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
