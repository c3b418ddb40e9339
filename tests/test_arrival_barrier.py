"""The formation's arrival barrier at scale: one counter and one key instead of every rank waiting on every rank's
key (elastic_ring.backends.formation), with a real store and, for the forged counter, real processes."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends import arrival, formation
from elastic_ring.core.auth import AuthenticatedStore
from tests.process_ring import TEST_SECRET, ProcessRing

HOST = "127.0.0.1"


class _CountingStore:
    """The store as a Formation sees it, counting what it asks the server for."""

    def __init__(self, store) -> None:
        self.inner, self.waited, self.checked, self.ops = store, [], [], 0

    def __getattr__(self, name):
        self.ops += 1
        return getattr(self.inner, name)

    def wait(self, keys, timeout=None):
        self.ops += 1
        self.waited.append(len(keys))
        return self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

    def check(self, keys):
        self.ops += 1
        self.checked.append(len(keys))
        return self.inner.check(keys)


def _spec(port: int, rank: int, world: int, job: str) -> er.RingSpec:
    return er.RingSpec(round_id=1, rank=rank, world_size=world, node_ids=("n",) * world,
                       store=er.StoreAddress(HOST, port), auth_key=TEST_SECRET, job_id=job, connect_timeout_s=10.0)


def test_the_arrival_barrier_costs_each_rank_a_few_operations_on_one_key():
    world = 256
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(HOST, server.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    store = AuthenticatedStore(client, TEST_SECRET)
    for rank in range(world - 2):  # the others arrived (each: its key, then the counter)
        assert not arrival.announce_arrival(store, _spec(server.port, rank, world, "barrier-cost"))
    waiting = _CountingStore(store)
    form = formation.Formation(_spec(server.port, world - 2, world, "barrier-cost"), waiting)
    other = AuthenticatedStore(server, TEST_SECRET)  # another connection: the waiting one is busy
    threading.Timer(0.2, arrival.announce_arrival, args=(other, _spec(server.port, world - 1, world,
                                                                        "barrier-cost"))).start()
    started = time.monotonic()
    assert form.run(lambda seconds_left: "group", None, "test group") == "group"
    assert waiting.waited == [1], waiting.waited  # one key, not world_size of them
    assert time.monotonic() - started < 0.2 + formation.BLOCKING_WAIT_S, "woken by the last arrival"
    assert waiting.ops == 3, waiting.ops  # its key, the counter, the wait
    last = _CountingStore(store)  # the last to arrive waits for nothing
    form = formation.Formation(_spec(server.port, world - 1, world, "last-arrival"), last)
    for rank in range(world - 1):
        arrival.announce_arrival(store, _spec(server.port, rank, world, "last-arrival"))
    assert form.run(lambda seconds_left: "group", None, "test group") == "group"
    assert last.waited == [] and last.ops == 3, (last.waited, last.ops)  # its key, the counter, all_arrived


@pytest.mark.parametrize("absent, most, named", [
    ((), 17, []),
    ((0,), 17, [0]),
    ((5, 17, 63), 17, [5, 17, 63]),
    (tuple(range(10, 40)), 17, list(range(10, 27))),
])
def test_the_ranks_that_did_not_arrive_are_found_without_one_read_per_rank(absent, most, named):
    world = 64
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    store = AuthenticatedStore(server, TEST_SECRET)
    job = f"absent-{len(absent)}"
    for rank in set(range(world)) - set(absent):
        arrival.announce_arrival(store, _spec(server.port, rank, world, job))
    counting = _CountingStore(server)
    assert arrival.absent_ranks(counting, _spec(server.port, 0, world, job), most) == named
    if len(absent) <= 3:
        assert len(counting.checked) <= 1 + 2 * max(1, len(absent)) * 6, counting.checked  # O(k log n), not n


def test_the_counter_is_named_with_the_job_secret():
    """A stranger cannot write a round's counter before its ranks do: he cannot compute its name."""
    spec = _spec(29500, 0, 2, "named")
    other = er.RingSpec(round_id=1, rank=0, world_size=2, node_ids=("n",) * 2, store=spec.store,
                        auth_key=b"another-secret-of-32-bytes......", job_id="named")
    assert arrival.counter_key(spec).startswith("named/round1/arrivals/")
    assert arrival.counter_key(spec) != arrival.counter_key(other)
    assert arrival.all_arrived_key(spec) != arrival.all_arrived_key(other)


# ---------------------------------------------------------------- a forged counter, with real processes
def _form_over_a_forged_counter(port: int, n: int, m: int) -> dict:
    rank = er.rank()

    def spec(round_id: int) -> er.RingSpec:
        return er.RingSpec(round_id=round_id, rank=rank, world_size=2, node_ids=("n",) * 2,
                           store=er.StoreAddress(HOST, port), auth_key=TEST_SECRET, connect_timeout_s=10.0)

    started = time.monotonic()
    try:
        er.init(spec(n))
        return dict(error="round n formed over a forged counter")
    except er.CommError as exc:
        took, message = time.monotonic() - started, str(exc)
    er.init(spec(m))  # a new store connection: the server dropped the one that added to the forged value
    return dict(took_s=took, message=message, total=er.allreduce(torch.ones(2), op=er.Sum).tolist())


@pytest.fixture
def own_ring():
    """Processes of this test's own: a rank whose store connection the server dropped keeps that history, and
    the session's shared ranks must not inherit it."""
    pool = ProcessRing(2)
    yield pool
    pool.close()


def test_a_forged_counter_fails_the_round_at_once_and_the_next_round_forms(own_ring):
    ring = own_ring
    r0 = ring._round + 1
    n, m = r0 + 1, r0 + 2
    spec_n = er.RingSpec(round_id=n, rank=0, world_size=2, node_ids=("n",) * 2, store=ring.address,
                         auth_key=TEST_SECRET)
    ring.store.set(arrival.counter_key(spec_n), b"\x80\x04forged")  # what a stranger's overwrite leaves
    pending = ring.start(_form_over_a_forged_counter, ring.address.port, n, m, world_size=2)
    while ring._round < m:
        ring.next_round()
    for r in pending.results(timeout_s=30):
        assert "error" not in r, r
        assert r["took_s"] < 2, r
        assert f"round {n}" in r["message"] and "not part of the job" in r["message"], r["message"]
        assert r["total"] == [2.0, 2.0], r
