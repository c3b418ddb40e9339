"""runtime.abort_round and the interruptible formation, with real processes and sockets.

The test process plays the driver: it hosts the store, decides when a round is
lost, and publishes "abort round N" under a store key. In each worker a thread
waits for that key and calls ``runtime.abort_round`` from outside the thread
that forms or runs collectives, as the worker's mailbox thread does with the
driver's ``abort`` (``ray_integration/worker/mailbox.py``). Latencies are measured inside each worker, from the
``abort_round`` call to the ``CommError`` in the blocked thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends import arrival, formation
from elastic_ring.core.auth import AuthenticatedStore
from elastic_ring.ring import runtime
from tests.process_ring import TEST_SECRET, ProcessRing, use_full_mesh_gloo_pairs, use_lazy_gloo_pairs

HOST = "127.0.0.1"
#: What the tests allow between abort_round and the CommError in the blocked thread (the brief: about 1 s).
ABORT_LATENCY_S = 1.0


def _spec(port: int, round_id: int, rank: int, world: int, **overrides) -> er.RingSpec:
    return er.RingSpec(round_id=round_id, rank=rank, world_size=world, node_ids=("n",) * world,
                       store=er.StoreAddress(HOST, port), auth_key=TEST_SECRET, **overrides)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=20))


def _listen_for_abort(port: int, key: str) -> tuple[dict, threading.Thread]:
    """The worker mailbox's ``abort`` stand-in: a thread that waits (on its own store connection,
    at most 20 s) for the driver's "round:reason" under ``key`` and calls runtime.abort_round."""
    box: dict = {}

    def run() -> None:
        try:
            client = _client(port)
            client.wait([key])
            round_id, reason = client.get(key).decode().split(":", 1)
            box["called_at"] = time.monotonic()
            runtime.abort_round(int(round_id), reason)
        except Exception as exc:  # noqa: BLE001 - surfaced in the worker's result
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="test-abort-listener", daemon=True)
    thread.start()
    return box, thread


def _allreduce_sum_of_ranks() -> list[float]:
    return er.allreduce(torch.full((4,), float(er.rank() + 1)), op=er.Sum).tolist()


def _publish_abort(store: dist.TCPStore, round_id: int, reason: str) -> None:
    store.set(f"test-abort/{round_id}", f"{round_id}:{reason}")


def _wait_keys(store: dist.TCPStore, keys: list[str], timeout_s: float = 10.0) -> None:
    store.wait(keys, datetime.timedelta(seconds=timeout_s))


def _report(what: str, results: list) -> None:
    """Print the measured latencies (shown with ``pytest -s``)."""
    latencies = [f"{r['latency_s'] * 1000:.0f} ms" for r in results if isinstance(r, dict) and "latency_s" in r]
    print(f"\nabort_round -> CommError, {what}: {', '.join(latencies)}")


def _start(ring, fn, *args, world_size: int, own_rounds: int):
    """``ring.start`` forms round r0 on the ranks; the task then forms ``own_rounds`` rounds of its own,
    r0 + 1, ...: they are passed to ``fn`` after ``args`` and reserved so the harness never reuses them."""
    r0 = ring._round + 1
    own = list(range(r0 + 1, r0 + 1 + own_rounds))
    pending = ring.start(fn, *args, *own, world_size=world_size)
    while ring._round < own[-1]:
        ring.next_round()
    return pending, r0, own


# ---------------------------------------------------------------- a member is lost while the ring forms
def _form_without_rank_2(port: int, victim: str, n: int, m: int) -> dict | str:
    rank = er.rank()
    if rank == 2:
        if victim == "dies_after_arrival":  # arrives, then dies before gloo's address exchange
            store = AuthenticatedStore(_client(port), TEST_SECRET)
            arrival.announce_arrival(store, _spec(port, n, 2, 3))
            os.kill(os.getpid(), signal.SIGKILL)
        if victim == "dies_before_its_first_collective":  # arrives, publishes its gloo address, then dies
            from elastic_ring.backends import gloo

            gloo._connect_pairs = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
            er.init(_spec(port, n, 2, 3, connect_timeout_s=30.0))
        return "never arrived"
    box, listener = _listen_for_abort(port, f"test-abort/{n}")
    started = time.monotonic()
    try:
        er.init(_spec(port, n, rank, 3, connect_timeout_s=30.0))
        return "round n formed without rank 2"
    except er.CommError as exc:
        raised_at, message = time.monotonic(), str(exc)
    listener.join(5)
    if "called_at" not in box:
        return f"no abort_round call: {box}"
    reform_started = time.monotonic()
    er.init(_spec(port, m, rank, 2))
    total = _allreduce_sum_of_ranks()
    return dict(latency_s=raised_at - box["called_at"], forming_s=raised_at - started, message=message,
                reform_s=time.monotonic() - reform_started, total=total, world=er.size(), round=er.round_id())


@pytest.fixture(scope="module")
def mesh_ring():
    """Ranks whose gloo rings connect every pair at construction (ELASTIC_RING_GLOO_LAZY=0)."""
    pool = ProcessRing(3, setup=use_full_mesh_gloo_pairs)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def lazy_ring():
    """Ranks whose gloo rings connect their pairs at first use (ELASTIC_RING_GLOO_LAZY=1, the default) whatever the
    environment says."""
    pool = ProcessRing(3, setup=use_lazy_gloo_pairs)
    yield pool
    pool.close()


@pytest.mark.parametrize("victim", ["never_arrives", "dies_after_arrival"])
def test_abort_round_interrupts_a_full_mesh_formation_missing_a_member(mesh_ring, victim):
    _interrupts_a_formation_missing_a_member(mesh_ring, victim)


@pytest.mark.parametrize("victim", ["never_arrives", "dies_after_arrival", "dies_before_its_first_collective"])
def test_abort_round_interrupts_a_lazy_formation_missing_a_member(lazy_ring, victim):
    _interrupts_a_formation_missing_a_member(lazy_ring, victim)


def _interrupts_a_formation_missing_a_member(ring, victim: str) -> None:
    pending, _, (n, m) = _start(ring, _form_without_rank_2, ring.address.port, victim, world_size=3, own_rounds=2)
    arrived = [f"elastic_ring/round{n}/arrived/{r}" for r in range(2 if victim == "never_arrives" else 3)]
    _wait_keys(ring.store, arrived)
    time.sleep(0.5)  # the survivors are blocked forming round n (the barrier, gloo's address exchange or pairs)
    _publish_abort(ring.store, n, "worker w2 died")
    results = pending.results(timeout_s=15, raise_errors=False)
    _report(f"formation ({victim})", results[:2])
    for rank, r in enumerate(results[:2]):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["latency_s"] < ABORT_LATENCY_S, r
        assert r["forming_s"] < 5, r
        if victim == "dies_before_its_first_collective" and "worker w2 died" not in r["message"]:
            # it connected to the dead rank itself (connection refused or reset) and failed before the abort
            assert f"could not form the gloo ring of round {n}" in r["message"], r["message"]
        else:
            assert f"round {n}" in r["message"] and "worker w2 died" in r["message"], r["message"]
            if victim == "never_arrives":
                assert "rank(s) 2 of 3 had not arrived" in r["message"], r["message"]
            else:  # (dies_before_its_first_collective: its address was published, the pairs were next)
                assert "every rank had arrived" in r["message"], r["message"]
        assert r["world"] == 2 and r["round"] == m and r["total"] == [3.0] * 4, r
        assert r["reform_s"] < 5, r  # a fresh store connection: the abandoned helper may still hold the old one
    if victim == "never_arrives":
        assert results[2] == "never arrived"
    else:
        assert getattr(results[2], "type_name", None) == "ProcessDied", results[2]


# ---------------------------------------------------------------- a member freezes in a collective
def _allreduce_until_aborted(port: int, m: int) -> dict:
    n, rank = er.round_id(), er.rank()
    client = _client(port)
    box, listener = _listen_for_abort(port, f"test-abort/{n}") if rank < 2 else ({}, None)
    x = torch.ones(1000)
    client.set(f"test-ready/{n}/{rank}", str(os.getpid()))
    last_done = time.monotonic()
    steps = 0
    try:
        while True:
            er.allreduce_(x, op=er.Average)
            last_done = time.monotonic()
            steps += 1
    except er.CommError as exc:
        raised_at, message = time.monotonic(), str(exc)
    if listener is not None:
        listener.join(5)
    if "called_at" not in box:
        return dict(error=f"no abort_round call: {box}", message=message)
    er.init(_spec(port, m, rank, 2))
    total = _allreduce_sum_of_ranks()
    client.set(f"test-done/{n}/{rank}", "1")
    return dict(latency_s=raised_at - box["called_at"], blocked_s=box["called_at"] - last_done, steps=steps,
                message=message, total=total, world=er.size(), round=er.round_id())


def test_abort_round_ends_a_collective_held_by_a_frozen_peer(ring):
    pending, n, (m,) = _start(ring, _allreduce_until_aborted, ring.address.port, world_size=3, own_rounds=1)
    _wait_keys(ring.store, [f"test-ready/{n}/{r}" for r in range(3)])
    time.sleep(0.3)
    frozen = pending.pids[2]
    os.kill(frozen, signal.SIGSTOP)
    try:
        time.sleep(0.7)  # the survivors block in the allreduce that the frozen rank never joins
        _publish_abort(ring.store, n, "worker w2 stopped heartbeating")
        _wait_keys(ring.store, [f"test-done/{n}/{r}" for r in range(2)])
    finally:
        os.kill(frozen, signal.SIGKILL)  # what we started: a stopped process dies on SIGKILL too
    results = pending.results(timeout_s=15, raise_errors=False)
    _report("collective (frozen peer)", results[:2])
    for rank, r in enumerate(results[:2]):
        assert isinstance(r, dict) and "error" not in r, f"rank {rank}: {r}"
        assert r["steps"] > 0 and r["blocked_s"] > 0.5, r  # it really was blocked in the collective
        assert r["latency_s"] < ABORT_LATENCY_S, r
        assert f"round {n} was aborted" in r["message"] and "stopped heartbeating" in r["message"], r["message"]
        assert r["world"] == 2 and r["round"] == m and r["total"] == [3.0] * 4, r
    assert getattr(results[2], "type_name", None) == "ProcessDied", results[2]


# ---------------------------------------------------------------- the abort comes before the round forms
def _abort_before_init(port: int, n: int, m: int) -> dict:
    rank = er.rank()
    runtime.abort_round(n, "worker w3 died before round n formed")
    started = time.monotonic()
    try:
        er.init(_spec(port, n, rank, 2))
        return dict(error="round n formed after its abort")
    except er.CommError as exc:
        took, message = time.monotonic() - started, str(exc)
    er.init(_spec(port, m, rank, 2))
    return dict(took_s=took, message=message, total=_allreduce_sum_of_ranks(), round=er.round_id())


def test_init_of_an_aborted_round_raises_at_once(ring):
    pending, _, (n, m) = _start(ring, _abort_before_init, ring.address.port, world_size=2, own_rounds=2)
    results = pending.results(timeout_s=15)
    for r in results:
        assert "error" not in r, r
        assert r["took_s"] < 0.25, r  # at once: only leaving the previous ring
        assert f"round {n} was aborted before it formed" in r["message"] and "w3 died" in r["message"], r
        assert r["round"] == m and r["total"] == [3.0] * 4, r


# ---------------------------------------------------------------- later rounds are never affected
def _later_rounds_unaffected(port: int, old: int, late_s: float, nxt: int) -> dict:
    rank = er.rank()
    runtime.abort_round(old, "an older round lost a member")
    still = _allreduce_sum_of_ranks()  # the current round (> old) still works
    if rank == 0:  # an abort of the old round arrives while this rank forms the next one
        timer = threading.Timer(0.2, runtime.abort_round, args=(old, "the older round again"))
        timer.start()
    else:
        time.sleep(late_s)
    er.init(_spec(port, nxt, rank, 2))
    return dict(still=still, total=_allreduce_sum_of_ranks(), round=er.round_id(), nxt=nxt)


def test_an_abort_never_affects_a_later_round(ring):
    old = ring.next_round()
    pending, current, _ = _start(ring, _later_rounds_unaffected, ring.address.port, old, 0.6, world_size=2,
                                 own_rounds=1)
    assert current > old
    results = pending.results(timeout_s=15)
    for r in results:
        assert r["still"] == [3.0] * 4 and r["total"] == [3.0] * 4 and r["round"] == r["nxt"], r


# ---------------------------------------------------------------- in one process
def test_abort_round_checks_its_round_id():
    with pytest.raises(ValueError, match="round_id"):
        runtime.abort_round(-1, "x")
    with pytest.raises(ValueError, match="round_id"):
        runtime.abort_round("3", "x")  # type: ignore[arg-type]


def test_an_abandoned_formation_lets_go_of_the_store_soon():
    """A cancelled formation raises at once; its helper leaves the barrier's wait within about
    BLOCKING_WAIT_S + POLL_S, so it does not hold the store connection until the connect deadline."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    spec = _spec(server.port, 1, 0, 2, job_id="abandoned-formation", connect_timeout_s=30.0)
    form = formation.Formation(spec, AuthenticatedStore(_client(server.port), TEST_SECRET))
    threading.Timer(0.2, form.cancel, args=("the driver said so",)).start()
    started = time.monotonic()
    with pytest.raises(er.CommError, match=r"forming round 1 was aborted: the driver said so; rank\(s\) 1 of 2"):
        form.run(lambda seconds_left: "group", None, "test group")
    assert time.monotonic() - started < 0.2 + 0.6
    assert form.store_held
    deadline = time.monotonic() + formation.BLOCKING_WAIT_S + formation.POLL_S + 2.0
    while form.store_held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not form.store_held


def test_a_late_result_of_an_abandoned_formation_is_discarded():
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    spec = _spec(server.port, 1, 0, 1, job_id="late-result", connect_timeout_s=30.0)
    form = formation.Formation(spec, AuthenticatedStore(_client(server.port), TEST_SECRET))
    release, discarded = threading.Event(), []

    def build(seconds_left: float) -> str:
        release.wait(10)
        return "late group"

    threading.Timer(0.1, form.cancel, args=("lost",)).start()
    with pytest.raises(er.CommError, match="every rank had arrived; the test group was abandoned"):
        form.run(build, lambda box: discarded.append(box.pop()), "test group")
    release.set()
    deadline = time.monotonic() + 5
    while not discarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert discarded == ["late group"]


def test_nccl_ranks_waiting_for_the_unique_id_stop_when_the_round_is_aborted():
    """The CPU-checkable part of the NCCL formation (no GPU here): rank 1 passed the barrier and waits
    for rank 0's unique id, which never comes (rank 0 died after arriving); an abort ends the wait."""
    from elastic_ring.backends.base import Communicator
    from elastic_ring.backends.nccl.communicator import NcclCommunicator

    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    spec = _spec(server.port, 1, 1, 2, job_id="nccl-unique-id", backend="nccl", connect_timeout_s=30.0)
    store = AuthenticatedStore(_client(server.port), TEST_SECRET)
    arrival.announce_arrival(store, dataclasses.replace(spec, rank=0))  # rank 0 arrived, then died
    form = formation.Formation(spec, store)
    comm = object.__new__(NcclCommunicator)  # only its unique-id exchange runs: it needs no CUDA
    Communicator.__init__(comm, spec)
    reads = form.interruptible_store()
    threading.Timer(0.3, form.cancel, args=("rank 0 died",)).start()
    started = time.monotonic()
    with pytest.raises(er.CommError, match="forming round 1 was aborted: rank 0 died; every rank had arrived; "
                                           "the NCCL unique id exchange was abandoned"):
        form.run(lambda seconds_left: comm._exchange_unique_id(reads, seconds_left), None, "NCCL unique id exchange")
    assert time.monotonic() - started < 0.3 + 0.5
    deadline = time.monotonic() + formation.BLOCKING_WAIT_S + formation.POLL_S + 2.0
    while form.store_held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not form.store_held
