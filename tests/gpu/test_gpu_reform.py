"""NCCL re-form by shrink and grow on a real GPU (RingSpec.nccl_reform="shrink_grow"; elastic_ring.backends.nccl.reform).

Three rank processes share GPU 0 (tests/gpu/gpu_ring.py). A rank leaves gracefully: the others shrink the healthy
communicator. A peer is SIGKILLed mid-allreduce: the survivors' communicator failed and is aborted, so their next
round is a full init; the replacement then joins by ncclCommGrow. Where the loaded libnccl lacks a function (shrink
2.27, grow 2.29), the round must form by a full init instead and still be right. Each test prints what it measured."""

from __future__ import annotations

import pathlib
import signal
import time

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.backends.nccl import lib as nccl_lib
from elastic_ring.core.ops import ReduceOp
from tests.gpu.test_gpu_failures import _allreduce_until_error, _wait_for
from tests.process_ring import Pending

pytestmark = pytest.mark.gpu

REFORM = {"nccl_reform": "shrink_grow"}


def _has(name: str) -> bool:
    return nccl_lib.load().has(name)


def _form_and_check(spec: er.RingSpec, warm: bool = True):
    """Form ``spec``'s round (timed), then check a sum over it; returns how it formed and what it cost."""
    if warm:  # a newcomer's CUDA context and libnccl are made before the clock starts, as a worker's are
        torch.zeros(1, device=f"cuda:{spec.cuda_device}")
        nccl_lib.load()
    started = time.perf_counter()
    comm = er.init(spec)
    seconds = time.perf_counter() - started
    x = torch.full((4096,), float(spec.rank + 1), device=comm.device)
    comm.allreduce(x, ReduceOp.SUM).wait()
    total = x[0].item()
    return {"formed_by": getattr(comm, "formed_by", None), "seconds": seconds, "sum": total,
            "rank": spec.rank, "world": spec.world_size, "nccl": nccl_lib.load().version()}


def _start_on(ring, slots: list[int], world: int, fn, make_args) -> Pending:
    """Run ``fn(*make_args(rank))`` on the processes in ``slots`` (rank = position), forming no ring first."""
    for rank, slot in enumerate(slots):
        if not ring._procs[slot].is_alive():
            ring._spawn(slot)
        ring._conns[slot].send((fn, make_args(rank), None))
    return Pending(ring, slots)


def _spec(ring, round_id: int, rank: int, world: int, **fields) -> er.RingSpec:
    return ring.spec(rank, world, round_id, collective_timeout_s=60.0, connect_timeout_s=30.0, **fields)


@pytest.fixture
def fresh_ring():
    """Three new rank processes per test: a failed shrink must not leave its state to the next test."""
    from tests.gpu.gpu_ring import GpuRing

    ring = GpuRing(3)
    yield ring
    ring.close()


def test_a_lost_peer_means_a_full_init_and_its_replacement_joins_by_grow_where_nccl_has_it(fresh_ring, tmp_path):
    gpu_ring = fresh_ring
    # round A: three ranks, every one may be shrunk or grown later
    pending = gpu_ring.start(_allreduce_until_error, str(tmp_path), 16, False, world_size=3,
                             collective_timeout_s=60.0, **REFORM)
    round_a = gpu_ring._round
    _wait_for([tmp_path / f"looping{r}" for r in range(3)], 60)
    killed_at = gpu_ring.signal(1, signal.SIGKILL)
    gpu_ring.reap(1)
    first, dead, third = pending.results(timeout_s=90, raise_errors=False)
    for survivor in (first, third):
        assert survivor["error"] is not None and survivor["t_error"] - killed_at < 15.0, survivor
    print(f"\nthe survivors raised CommError {max(s['t_error'] for s in (first, third)) - killed_at:.3f} s after "
          f"the SIGKILL: {first['error'][:160]}")

    # round B: the survivors (slots 0 and 2) would shrink round A's communicator, but it failed and was
    # aborted (NCCL 2.28.9 refuses to shrink a failed communicator): every token says init
    round_b = gpu_ring.next_round()
    shrunk = _start_on(gpu_ring, [0, 2], 2, _form_and_check, lambda rank: (_spec(
        gpu_ring, round_b, rank, 2, parent_round=round_a, parent_ranks=(0, 2), **REFORM),)).results(timeout_s=90)
    print(f"\nNCCL {shrunk[0]['nccl']}: re-form 3 -> 2 after a SIGKILL: "
          f"{[r['formed_by'] for r in shrunk]} in {max(r['seconds'] for r in shrunk):.3f} s")
    assert [r["sum"] for r in shrunk] == [3.0, 3.0], shrunk
    assert {r["formed_by"] for r in shrunk} == {"init"}, shrunk

    # round C: a replacement (slot 1, a fresh process) joins after them
    round_c = gpu_ring.next_round()
    grown = _start_on(gpu_ring, [0, 2, 1], 3, _form_and_check, lambda rank: (_spec(
        gpu_ring, round_c, rank, 3, parent_round=round_b, parent_ranks=(0, 1, -1), **REFORM),)).results(timeout_s=90)
    print(f"NCCL {grown[0]['nccl']}: join 2 -> 3: {[r['formed_by'] for r in grown]} in "
          f"{max(r['seconds'] for r in grown):.3f} s")
    assert [r["sum"] for r in grown] == [6.0] * 3, grown
    assert {r["formed_by"] for r in grown} == {"grow" if _has("ncclCommGrow") else "init"}, grown

    # the same processes go on with ordinary rounds
    assert [r["sum"] for r in gpu_ring.run(_sum_after_init, world_size=3)] == [6.0] * 3


def _leave():
    runtime.current().abort()  # leaves without a finalize, after its peers moved on (a stopped worker finalizes)
    er.shutdown()
    return True


def _sum_after_init():
    comm = runtime.current()
    x = torch.full((8,), float(comm.rank + 1), device=comm.device)
    return {"sum": er.allreduce(x, op=er.Sum)[0].item()}


def test_a_graceful_leave_shrinks_a_healthy_communicator_and_a_mixed_change_is_a_full_init(fresh_ring):
    gpu_ring = fresh_ring
    base = gpu_ring.run(_sum_after_init, world_size=3, **REFORM)
    assert [r["sum"] for r in base] == [6.0] * 3
    round_a = gpu_ring._round
    # rank 2 leaves (its process just does not take part); the others shrink the healthy communicator
    round_b = gpu_ring.next_round()
    left = _start_on(gpu_ring, [0, 1], 2, _form_and_check, lambda rank: (_spec(
        gpu_ring, round_b, rank, 2, parent_round=round_a, parent_ranks=(0, 1), **REFORM),)).results(timeout_s=90)
    assert [r["sum"] for r in left] == [3.0, 3.0], left
    assert {r["formed_by"] for r in left} == {"shrink" if _has("ncclCommShrink") else "init"}, left
    print(f"\nNCCL {left[0]['nccl']}: graceful leave 3 -> 2: {[r['formed_by'] for r in left]} in "
          f"{max(r['seconds'] for r in left):.3f} s")
    # slot 2 left round A after the others shrank it; a round mixing it in (a reorder) is a full init
    _start_on(gpu_ring, [2], 1, _leave, lambda rank: ()).results(timeout_s=60)
    round_c = gpu_ring.next_round()
    mixed = _start_on(gpu_ring, [1, 0, 2], 3, _form_and_check, lambda rank: (_spec(
        gpu_ring, round_c, rank, 3, parent_round=round_b, parent_ranks=(1, 0, -1), **REFORM),)).results(timeout_s=90)
    assert [r["sum"] for r in mixed] == [6.0] * 3 and {r["formed_by"] for r in mixed} == {"init"}, mixed
