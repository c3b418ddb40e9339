"""Lost peers and timeouts: survivors raise CommError fast, then re-form a smaller ring in the same processes."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from tests.process_ring import TEST_SECRET


def _allreduce_until_failure(store_host, store_port, survivor_ranks):
    """Loop allreduces until a peer dies, then form the next round with the survivors."""
    store = dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False)
    first_round = er.round_id()
    next_round = first_round + 1
    x = torch.ones(250_000)
    store.set(f"ready/{er.rank()}", str(os.getpid()))
    steps = 0
    try:
        while True:
            er.allreduce_(x, op=er.Average)
            steps += 1
    except er.CommError as exc:
        detected_at = time.time()
        error = str(exc)
    old_rank = er.rank()
    try:
        er.allreduce(torch.ones(1))
    except er.CommError as exc:
        reuse_error = str(exc)
    new_rank = survivor_ranks.index(old_rank)
    world = len(survivor_ranks)
    spec = er.RingSpec(round_id=next_round, rank=new_rank, world_size=world, node_ids=("n",) * world,
                       store=er.StoreAddress(store_host, store_port), auth_key=TEST_SECRET)
    reformed_started = time.monotonic()
    er.init(spec)
    reform_s = time.monotonic() - reformed_started
    total = er.allreduce(torch.full((4,), float(new_rank + 1)), op=er.Sum)
    gathered = er.allgather_object(os.getpid())
    return dict(detected_at=detected_at, error=error, reuse_error=reuse_error, steps=steps, first_round=first_round,
                reform_s=reform_s, total=total.tolist(), world=er.size(), gathered=gathered)


def test_sigkill_of_one_rank_then_survivors_reform(ring):
    pending = ring.start(_allreduce_until_failure, "127.0.0.1", ring.address.port, [0, 1])
    ring.next_round()  # the survivors' round: never handed out again
    for rank in range(3):
        ring.store.wait([f"ready/{rank}"])
    time.sleep(0.3)
    victim_pid = pending.pids[2]
    killed_at = ring.kill(2)
    results = pending.results(timeout_s=30, raise_errors=False)
    survivors = results[:2]
    for r in survivors:
        assert isinstance(r, dict), r
        delay = r["detected_at"] - killed_at
        assert delay < 5, f"survivor raised CommError {delay:.2f} s after the kill"
        assert "collective failed" in r["error"]
        assert "failed earlier" in r["reuse_error"]
        assert r["steps"] > 0
        assert r["world"] == 2 and r["total"] == [3.0] * 4
        assert r["reform_s"] < 5
    # same processes: the survivors' pids are the ones that ran the first round
    assert sorted(survivors[0]["gathered"]) == sorted(pending.pids[:2])
    assert victim_pid not in survivors[0]["gathered"]
    ring.store.delete_key("ready/0"), ring.store.delete_key("ready/1"), ring.store.delete_key("ready/2")


def _one_rank_is_late(late_s):
    if er.rank() == 1:
        time.sleep(late_s)
    started = time.monotonic()
    try:
        er.allreduce(torch.ones(3), timeout_s=None)
    except er.CommError as exc:
        return "CommError", round(time.monotonic() - started, 2), str(exc)
    return "ok", round(time.monotonic() - started, 2), ""


def test_timeout_raises_comm_error_on_every_rank(ring):
    results = ring.run(_one_rank_is_late, 2.5, world_size=2, collective_timeout_s=1.0, timeout_s=30)
    kinds = [r[0] for r in results]
    assert kinds == ["CommError", "CommError"], results
    assert results[0][1] < 2.4, "rank 0 should give up after its 1 s timeout, not wait for the late rank"


def _timeout_per_call():
    if er.rank() == 0:
        started = time.monotonic()
        try:
            er.barrier(timeout_s=0.5)
        except er.CommError:
            return time.monotonic() - started
        return None
    time.sleep(1.5)
    return "late"


def test_per_call_timeout_overrides_the_ring_default(ring):
    waited, _ = ring.run(_timeout_per_call, world_size=2, timeout_s=30)
    assert waited is not None and waited < 1.4


def _reuse_round_id(store_host, store_port, round_id):
    spec = er.RingSpec(round_id=round_id, rank=0, world_size=1, node_ids=("n",), store=er.StoreAddress(store_host, store_port))
    with pytest.raises(ValueError, match="does not increase"):
        er.init(spec)
    return True


def test_round_ids_must_increase(ring):
    old_round = ring.next_round() - 1
    assert ring.run(_reuse_round_id, "127.0.0.1", ring.address.port, old_round, world_size=1) == [True]


def _missing_peer():
    started = time.monotonic()
    try:
        er.init(er.RingSpec(round_id=1, rank=0, world_size=2, node_ids=("a", "b"), job_id=f"absent-peer-{os.getpid()}", auth_key=TEST_SECRET,
                            store=er.StoreAddress("127.0.0.1", int(os.environ.get("ER_TEST_PORT", "0")) or 1),
                            connect_timeout_s=1.0))
    except er.CommError as exc:
        return round(time.monotonic() - started, 1), str(exc)
    return None


def _form_with_absent_peer(port):
    os.environ["ER_TEST_PORT"] = str(port)
    return _missing_peer()


def test_forming_without_a_peer_times_out_with_comm_error(ring):
    (result,) = ring.run(_form_with_absent_peer, ring.address.port, world_size=1, timeout_s=30)
    assert result is not None
    elapsed, message = result
    assert elapsed < 10 and "connect_timeout_s=1.0" in message
