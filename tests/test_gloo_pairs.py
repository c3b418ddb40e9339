"""Gloo rings that connect their pairs at first use, and the arrival barrier's cost, with real processes and a real
store (elastic_ring.backends.gloo, elastic_ring.backends.formation).

A lazy ring connects, during its formation, every pair its collectives will use (one dissemination barrier), so
nothing reads the store after the formation: the test deletes the round's gloo keys and then runs every collective
the communicator has, a broadcast from every root included. A ring that connected only its ring neighbours would
wait for a deleted key in its first broadcast from a root two ranks away and time out.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends import gloo
from elastic_ring.core import constants
from tests.process_ring import TEST_SECRET, ProcessRing, use_lazy_gloo_pairs

HOST = "127.0.0.1"
WORLD = 5  # not a power of two: the barrier's and the broadcasts' distances wrap around


@pytest.fixture(scope="module")
def five():
    pool = ProcessRing(WORLD, setup=use_lazy_gloo_pairs)  # lazy whatever ELASTIC_RING_GLOO_LAZY says
    yield pool
    pool.close()


def _every_collective_without_the_store(port: int) -> dict:
    rank, world = er.rank(), er.size()
    er.barrier()
    if rank == 0:  # the round's gloo addresses are gone: a pair connected from now on would wait for them
        client = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False)
        spec = er.ring.runtime.current().spec
        deleted = sum(bool(client.delete_key(gloo.address_key(spec, r, lazy=True))) for r in range(world))
    else:
        deleted = None
    er.barrier()
    roots = []
    for root in range(world):
        t = torch.full((3,), float(rank))
        er.broadcast_(t, root_rank=root)
        roots.append(t.tolist())
    gathered = er.allgather(torch.tensor([float(rank)])).tolist()
    total = er.allreduce(torch.ones(2), op=er.Sum).tolist()
    er.barrier()
    return dict(deleted=deleted, roots=roots, gathered=gathered, total=total)


def test_a_lazy_ring_reads_nothing_from_the_store_after_it_formed(five):
    assert constants.GLOO_LAZY_PAIRS or os.environ.get("ELASTIC_RING_GLOO_LAZY") == "0", \
        "the default is pairs connected at first use (ELASTIC_RING_GLOO_LAZY unset or 1)"
    results = five.run(_every_collective_without_the_store, five.address.port, timeout_s=60,
                       collective_timeout_s=10.0)
    assert results[0]["deleted"] == WORLD
    for r in results:
        assert r["roots"] == [[float(root)] * 3 for root in range(WORLD)], r
        assert r["gathered"] == [float(x) for x in range(WORLD)], r
        assert r["total"] == [float(WORLD)] * 2, r


# ---------------------------------------------------------------- a member dies before the first collective
CONNECT_S = 2.0


def _form_while_rank_2_dies(port: int, n: int, m: int) -> dict | str:
    rank = er.rank()

    def spec(round_id: int, rank: int, world: int, **extra) -> er.RingSpec:
        return er.RingSpec(round_id=round_id, rank=rank, world_size=world, node_ids=("n",) * world,
                           store=er.StoreAddress(HOST, port), auth_key=TEST_SECRET, **extra)

    if rank == 2:  # it arrives and publishes its gloo address, then dies before connecting any pair
        gloo._connect_pairs = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        er.init(spec(n, 2, 3, connect_timeout_s=CONNECT_S))
        return "formed"
    started = time.monotonic()
    try:
        er.init(spec(n, rank, 3, connect_timeout_s=CONNECT_S))
        return "round n formed without rank 2"
    except er.CommError as exc:
        took, message = time.monotonic() - started, str(exc)
    again = time.monotonic()
    er.init(spec(m, rank, 2))
    total = er.allreduce(torch.ones(2), op=er.Sum).tolist()
    return dict(took_s=took, message=message, reform_s=time.monotonic() - again, total=total)


def test_without_an_abort_a_member_lost_before_the_first_collective_fails_the_formation_at_its_deadline(five):
    """No driver aborts the round: the survivors' formation still ends, at once where a survivor connects to the
    dead rank (connection refused), else at connect_timeout_s (plus the second the caller gives a helper) where it
    waits for the dead rank to connect; not five pair timeouts later. The next round forms right after."""
    r0 = five._round + 1
    n, m = r0 + 1, r0 + 2
    pending = five.start(_form_while_rank_2_dies, five.address.port, n, m, world_size=3)
    while five._round < m:
        five.next_round()
    results = pending.results(timeout_s=30, raise_errors=False)
    for rank, r in enumerate(results[:2]):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        print(f"\nrank {rank}: the formation failed after {r['took_s']:.3f} s: {r['message'][:200]}")
        assert r["took_s"] < CONNECT_S + 1.0 + 1.5, r  # the deadline, plus load
        assert f"round {n}" in r["message"] and "connect_timeout_s=2.0" in r["message"], r["message"]
        assert r["reform_s"] < CONNECT_S + 3 and r["total"] == [2.0, 2.0], r  # (waits for the other survivor)
    assert getattr(results[2], "type_name", None) == "ProcessDied", results[2]


def test_a_group_whose_pairs_did_not_connect_dies_on_the_reaper_not_where_the_error_is_collected():
    """A lazy group whose connecting barrier failed goes to the reaper, and nothing else keeps it: not a local of
    the frame that raised (the traceback keeps those frames as long as the error lives). Else the group was
    destroyed wherever the error was collected: on the training thread, in a garbage collection, blocked joining
    gloo's thread that waits for a pair to a dead peer (the hang the full suite found with lazy pairs)."""
    import gc
    import weakref

    from elastic_ring.backends import reaper

    class Group:  # what _connect_pairs uses of a ProcessGroupGloo
        aborted = False
        barrier = staticmethod(int)  # fails in C as gloo's would (no Python frame of its own to hold the group)

        def abort(self):
            self.aborted = True

    class Formation:
        def remaining_s(self):
            return 5.0

    box = [Group()]
    alive = weakref.ref(box[0])
    spec = er.RingSpec(rank=0, world_size=2, round_id=1, store=er.StoreAddress("127.0.0.1", 1))
    with pytest.raises(TypeError, match="BarrierOptions") as caught:
        gloo._connect_pairs(box, Formation(), spec, "a lazy group")
    assert box == [] and reaper.drain(5.0)
    gc.disable()  # only references count here, not a collection
    try:
        assert caught.value.__traceback__ is not None  # the error, its traceback and frames still live...
        assert alive() is None, [type(r) for r in gc.get_referrers(alive())]  # ...but the group died on the reaper's thread
    finally:
        gc.enable()
