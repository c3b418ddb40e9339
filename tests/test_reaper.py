"""The reaper: an old round's group is destroyed off the caller's thread, and nothing hangs on it."""

from __future__ import annotations

import logging
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.backends import reaper
from elastic_ring.core.ops import ReduceOp


class _Slow:
    """An object whose destruction blocks until ``release`` is set, and records the thread it ran on."""

    def __init__(self, release: threading.Event, seen: list[str]) -> None:
        self.release, self.seen = release, seen

    def __del__(self) -> None:
        self.release.wait(10)
        self.seen.append(threading.current_thread().name)


def test_drop_destroys_on_a_reaper_thread_and_drain_has_a_deadline():
    r = reaper.Reaper(name="test-reaper")
    release, seen = threading.Event(), []
    box = [_Slow(release, seen)]
    started = time.monotonic()
    r.drop(box, "slow object", within_s=5)
    assert time.monotonic() - started < 0.5  # the caller does not wait for the destructor
    assert r.drain(0.2) is False and r.pending == ["slow object"]  # still running: drain gives up at its deadline
    release.set()
    assert r.drain(10) is True and r.pending == []
    assert seen == ["test-reaper"] and box == []


def test_a_stuck_teardown_does_not_hold_up_the_next_one():
    r = reaper.Reaper(name="test-reaper-2")
    stuck, seen_stuck = threading.Event(), []
    r.drop([_Slow(stuck, seen_stuck)], "stuck group", within_s=5)
    free, seen = threading.Event(), []
    free.set()
    r.drop([_Slow(free, seen)], "next group", within_s=5)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["test-reaper-2"] and r.pending == ["stuck group"]
    stuck.set()
    assert r.drain(10)


def test_a_failing_teardown_is_logged_kept_and_releases_drain(caplog):
    r = reaper.Reaper(name="test-reaper-3")
    box = ["x"]
    box.clear()  # an empty box: pop() fails on the reaper thread
    with pytest.raises(ValueError, match="exactly one object"):
        r.drop(box, "empty", within_s=1)
    r._pending[99] = ("bad box", time.monotonic() + 1)  # what drop() records, then a thread that fails
    with caplog.at_level(logging.WARNING, logger="elastic_ring.backends.reaper"):
        t = threading.Thread(target=r._run, args=([], 99, "bad box"))
        t.start()
        t.join(5)
    assert r.drain(1) and r.failures and r.failures[0].startswith("bad box: IndexError")
    assert "tearing down bad box failed" in caplog.text


def test_exit_drain_waits_for_the_groups_own_deadline_and_names_what_is_left(caplog):
    r = reaper.Reaper(name="test-reaper-4")
    release, seen = threading.Event(), []
    r.drop([_Slow(release, seen)], "gloo group of rank 0/2 round 3", within_s=0.3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="elastic_ring.backends.reaper"):
        assert r.drain_at_exit(least_s=0.2) is False
    assert 0.4 <= time.monotonic() - started < 3.0  # its own 0.3 s plus the 0.2 s margin
    assert "gloo group of rank 0/2 round 3" in caplog.text
    release.set()
    assert r.drain(10) and r.drain_at_exit(least_s=0.2)


def test_a_forked_child_starts_with_a_fresh_reaper():
    before = reaper._reaper
    try:
        reaper._after_fork_in_child()
        assert reaper._reaper is not before and reaper._reaper.pending == []
    finally:
        reaper._reaper = before


def test_a_gloo_group_is_destroyed_on_a_reaper_thread_when_its_round_ends():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = er.RingSpec(round_id=1, rank=0, world_size=1, node_ids=("a",), job_id="reaper-test",
                       store=er.StoreAddress("127.0.0.1", store.port))
    comm = er.init(spec)
    died_on: list[str] = []
    weakref.finalize(comm._pg, lambda: died_on.append(threading.current_thread().name))
    er.shutdown()
    assert comm.closed and comm._pg is None
    assert reaper.drain(10)
    assert died_on == ["elastic-ring-reaper"]


def _abort_while_peer_waits():
    """Rank 1 aborts its ring while rank 0 is blocked in an allreduce that rank 1 never joins."""
    comm = runtime.current()
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0 is inside its allreduce by now
        comm.abort()
        return None
    started = time.monotonic()
    try:
        comm.allreduce(torch.ones(4), ReduceOp.SUM).wait()
    except er.CommError as exc:
        return time.monotonic() - started, str(exc)
    return time.monotonic() - started, None


def test_a_peer_blocked_on_an_aborting_rank_fails_within_a_second(ring):
    seconds, error = ring.run(_abort_while_peer_waits, world_size=2, collective_timeout_s=20.0)[0]
    assert error is not None, "the allreduce completed although its peer aborted"
    assert seconds < 1.5, (seconds, error)  # the timeout is 20 s: only the closed sockets end it this soon
