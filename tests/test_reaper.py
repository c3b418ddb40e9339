"""The reaper: an old round's group is destroyed off the caller's thread, and nothing hangs on it."""

from __future__ import annotations

import threading
import time
import weakref

import torch.distributed as dist

import elastic_ring as er
from elastic_ring import reaper


class _Slow:
    """An object whose destruction blocks until ``release`` is set, and records the thread it ran on."""

    def __init__(self, release: threading.Event, seen: list[str]) -> None:
        self.release, self.seen = release, seen

    def __del__(self) -> None:
        self.release.wait(10)
        self.seen.append(threading.current_thread().name)


class _Raises:
    def __del__(self) -> None:
        raise RuntimeError("destructor failed")


def test_drop_destroys_on_the_reaper_thread_and_drain_has_a_deadline():
    r = reaper.Reaper(name="test-reaper")
    release, seen = threading.Event(), []
    obj = _Slow(release, seen)
    started = time.monotonic()
    r.drop(obj, "slow object")
    del obj
    assert time.monotonic() - started < 0.5  # the caller does not wait for the destructor
    assert r.drain(0.2) is False and r.pending == 1  # still running: drain gives up at its deadline
    release.set()
    assert r.drain(10) is True and r.pending == 0
    assert seen == ["test-reaper"]


def test_a_destructor_that_raises_does_not_end_the_thread(recwarn):
    r = reaper.Reaper(name="test-reaper-2")
    obj = _Raises()
    r.drop(obj, "raising object")
    del obj
    assert r.drain(10)
    release, seen = threading.Event(), []
    release.set()
    obj = _Slow(release, seen)
    r.drop(obj, "next object")
    del obj
    assert r.drain(10) and seen == ["test-reaper-2"]


def test_a_gloo_group_is_destroyed_on_the_reaper_thread_when_its_round_ends():
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
