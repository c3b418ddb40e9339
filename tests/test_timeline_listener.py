"""``elastic_ring.core.timeline`` listeners: every recorded event reaches them (and the buffer), in order; a
listener that raises never breaks the code that recorded the event, is logged once and counted; bad input is
refused."""

from __future__ import annotations

import logging
import threading

import pytest

from elastic_ring.core import timeline


@pytest.fixture
def enabled_timeline():
    assert not timeline.is_enabled(), "another test left the timeline on"
    timeline.enable()
    try:
        yield
    finally:
        timeline.disable()


def test_a_listener_sees_every_event_in_order_and_the_buffer_keeps_them(enabled_timeline):
    seen = []
    timeline.add_listener(seen.append)
    try:
        with timeline.span("pack", "fusion", bytes=8):
            timeline.instant("failure", "membership")
        event_id = timeline.begin_async("allreduce", "collective")
        timeline.end_async(event_id, "allreduce", "collective")
    finally:
        timeline.remove_listener(seen.append)  # an equal bound method removes it
    timeline.instant("after", "membership")  # removed: not seen
    assert [(e["name"], e["ph"]) for e in seen] == [("failure", "i"), ("pack", "X"), ("allreduce", "b"),
                                                    ("allreduce", "e")]
    assert seen[1]["args"]["bytes"] == 8
    drained, dropped = timeline.drain()
    assert drained == seen + [drained[-1]] and drained[-1]["name"] == "after" and dropped == 0


def test_no_event_reaches_a_listener_while_the_timeline_is_off():
    seen = []
    timeline.add_listener(seen.append)
    try:
        timeline.instant("off", "membership")
        with timeline.span("off", "fusion"):
            pass
    finally:
        timeline.remove_listener(seen.append)
    assert seen == []


def test_a_raising_listener_is_logged_once_counted_and_breaks_nothing(enabled_timeline, caplog):
    seen = []

    def broken(event):
        raise RuntimeError(f"listener bug on {event['name']}")

    timeline.add_listener(broken)
    timeline.add_listener(seen.append)
    try:
        with caplog.at_level(logging.ERROR, logger="elastic_ring.core.timeline"):
            for i in range(3):
                with timeline.span(f"step{i}", "state"):  # the caller's code runs on
                    pass
        assert timeline.listener_failures(broken) == 3
        assert timeline.listener_failures(seen.append) == 0
    finally:
        timeline.remove_listener(broken)
        timeline.remove_listener(seen.append)
    assert [e["name"] for e in seen] == ["step0", "step1", "step2"]  # the next listener still gets each event
    logged = [r for r in caplog.records if "timeline listener" in r.getMessage()]
    assert len(logged) == 1 and "step0" in logged[0].getMessage() and logged[0].exc_info is not None
    assert len(timeline.drain()[0]) == 3


def test_a_listener_may_record_events_itself_and_threads_deliver_concurrently(enabled_timeline):
    seen, lock = [], threading.Lock()

    def listener(event):
        with lock:
            seen.append(event["name"])
        if event["name"] == "outer":
            timeline.instant("inner", "membership")  # called outside the timeline's lock: no deadlock

    timeline.add_listener(listener)
    try:
        timeline.instant("outer", "membership")
        threads = [threading.Thread(target=lambda i=i: [timeline.instant(f"t{i}", "fusion") for _ in range(200)])
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    finally:
        timeline.remove_listener(listener)
    assert seen[:2] == ["outer", "inner"]
    assert sorted(seen[2:]) == sorted(f"t{i}" for i in range(4) for _ in range(200))


def test_bad_listeners_are_refused():
    with pytest.raises(TypeError, match="not callable"):
        timeline.add_listener("print")

    def fn(event):
        pass

    timeline.add_listener(fn)
    try:
        with pytest.raises(ValueError, match="already added"):
            timeline.add_listener(fn)
    finally:
        timeline.remove_listener(fn)
    with pytest.raises(ValueError, match="was not added"):
        timeline.remove_listener(fn)
    with pytest.raises(ValueError, match="was not added"):
        timeline.listener_failures(fn)
