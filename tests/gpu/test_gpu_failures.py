"""Failures on a real NCCL ring (two ranks on one GPU): a peer SIGKILLed mid-allreduce, a peer SIGSTOPped
(the watchdog's deadline, and a blocked torch.cuda.synchronize() that returns), a peer that never joins
(creation aborted, the process still forms the next ring), a graceful close (finalize, no abort) and an
abort (empty_cache)."""

import dataclasses
import pathlib
import signal
import time

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.core.ops import ReduceOp
from tests.process_ring import TEST_SECRET, RankFailure

pytestmark = pytest.mark.gpu


def _sum_of_ranks():
    comm = runtime.current()
    x = torch.full((1000,), float(comm.rank + 1), device=comm.device)
    return er.allreduce(x, op=er.Sum)[0].item(), str(comm.device)


def _allreduce_until_error(flag_dir, mib, synchronize, give_up_s=120.0):
    """Allreduce ``mib`` MiB in a loop until a CommError; with ``synchronize``, block in
    torch.cuda.synchronize() before each wait, like a state snapshot does."""
    comm = runtime.current()
    x = torch.ones(mib << 18, device=comm.device)
    flag, done = pathlib.Path(flag_dir, f"looping{comm.rank}"), pathlib.Path(flag_dir, f"done{comm.rank}")
    started, synced_at, i = time.time(), None, 0
    try:
        while time.time() - started < give_up_s:
            try:
                work = comm.allreduce(x, ReduceOp.MAX)
                if synchronize:
                    torch.cuda.synchronize()
                    synced_at = time.time()
                work.wait()
            except er.CommError as exc:
                return {"error": str(exc), "t_error": time.time(), "t_synced": synced_at, "iterations": i,
                        "errored": comm.errored}
            i += 1
            if i == 5:
                flag.touch()
        return {"error": None, "iterations": i}
    finally:
        done.touch()


def _wait_for(paths, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[str(p) for p in paths if not p.exists()]} did not appear within {timeout_s} s")
        time.sleep(0.05)


def test_sigkilled_peer_raises_comm_error_within_seconds_then_the_ring_reforms(gpu_ring, tmp_path):
    pending = gpu_ring.start(_allreduce_until_error, str(tmp_path), 64, False, world_size=2,
                             collective_timeout_s=60.0)
    _wait_for([tmp_path / "looping0", tmp_path / "looping1"], 60)
    killed_at = gpu_ring.signal(1, signal.SIGKILL)
    gpu_ring.reap(1)
    survivor, dead = pending.results(timeout_s=90, raise_errors=False)
    assert isinstance(dead, RankFailure) and dead.type_name == "ProcessDied"
    assert survivor["error"] is not None, survivor
    seconds = survivor["t_error"] - killed_at
    assert seconds < 15.0, f"the survivor needed {seconds:.1f} s (collective_timeout_s=60): {survivor['error']}"
    assert survivor["errored"] and "[rank 0/2 round" in survivor["error"], survivor
    # the survivor forms the next ring in the same process with a fresh rank
    assert gpu_ring.run(_sum_of_ranks, world_size=2) == [(3.0, "cuda:0")] * 2


def test_sigstopped_peer_is_aborted_by_the_watchdog_within_collective_timeout(gpu_ring, tmp_path):
    pending = gpu_ring.start(_allreduce_until_error, str(tmp_path), 16, True, world_size=2,
                             collective_timeout_s=5.0)
    _wait_for([tmp_path / "looping0", tmp_path / "looping1"], 60)
    stopped_at = gpu_ring.signal(1, signal.SIGSTOP)
    try:
        _wait_for([tmp_path / "done0"], 60)  # the survivor gave up; only then kill the stopped peer
    finally:
        gpu_ring.reap(1)
    survivor, _ = pending.results(timeout_s=30, raise_errors=False)
    assert survivor["error"] is not None, survivor
    assert "did not finish within collective_timeout_s=5" in survivor["error"], survivor["error"]
    seconds = survivor["t_error"] - stopped_at
    assert 3.0 <= seconds <= 12.0, seconds
    # torch.cuda.synchronize() was blocked on the hung allreduce and returned once the watchdog aborted it
    assert survivor["t_synced"] is not None and survivor["t_synced"] - stopped_at >= 3.0, survivor
    assert gpu_ring.run(_sum_of_ranks, world_size=2) == [(3.0, "cuda:0")] * 2


def _form_without_peer(host, port, rank, connect_timeout_s):
    spec = er.RingSpec(round_id=1, rank=rank, world_size=2, node_ids=("a", "b"), backend="nccl",
                       store=er.StoreAddress(host, port), job_id=f"gpu-absent-peer-{rank}",
                       connect_timeout_s=connect_timeout_s, cuda_device=0, auth_key=TEST_SECRET)
    started = time.monotonic()
    try:
        er.init(spec)
    except er.CommError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started, "initialized": er.is_initialized()}
    return {"error": None}


@pytest.mark.parametrize("rank, words", [  # the round's arrival barrier names the rank that never came
    (0, "could not form round 1 within connect_timeout_s=3.0"),
    (1, "could not form round 1 within connect_timeout_s=3.0"),
])
def test_a_peer_that_never_joins_fails_the_formation_and_the_process_forms_the_next_ring(gpu_ring, rank, words):
    address = gpu_ring.address
    [result] = gpu_ring.start(_form_without_peer, address.host, address.port, rank, 3.0, world_size=1,
                              form_ring=False).results(timeout_s=60)
    assert words in result["error"] and f"rank(s) {1 - rank} of 2 had not arrived" in result["error"], result
    assert 2.5 <= result["seconds"] <= 10.0 and not result["initialized"], result
    assert gpu_ring.run(_sum_of_ranks, world_size=2) == [(3.0, "cuda:0")] * 2


def _close_then_abort():
    from elastic_ring.backends.nccl import handle as nccl_handle

    calls = []
    real_finalize, real_abort, real_empty = nccl_handle.finalize_and_destroy, nccl_handle.abort, torch.cuda.empty_cache
    nccl_handle.finalize_and_destroy = lambda *a, **k: calls.append("finalize") or real_finalize(*a, **k)
    nccl_handle.abort = lambda *a, **k: calls.append("abort") or real_abort(*a, **k)
    torch.cuda.empty_cache = lambda: calls.append("empty_cache") or real_empty()
    try:
        comm = runtime.current()
        _sum_of_ranks()
        started = time.monotonic()
        er.shutdown()  # a healthy round ends: finalize, then destroy
        closed = (list(calls), time.monotonic() - started, comm.closed, comm.errored, comm._handle.alive)
        calls.clear()
        spec = comm.spec
        nxt = dataclasses.replace(spec, job_id=spec.job_id + "-second")
        comm2 = er.init(nxt)
        _sum_of_ranks()
        comm2.abort()
        aborted = (list(calls), comm2._handle.alive)
        with pytest.raises(er.CommError, match="closed"):
            comm2.allreduce(torch.ones(1, device=comm2.device), ReduceOp.SUM)
        er.shutdown()
        return closed, aborted
    finally:
        nccl_handle.finalize_and_destroy, nccl_handle.abort, torch.cuda.empty_cache = \
            real_finalize, real_abort, real_empty


def test_graceful_close_finalizes_and_abort_empties_the_cache(gpu_ring):
    for closed, aborted in gpu_ring.run(_close_then_abort, world_size=2, timeout_s=120):
        calls, seconds, is_closed, errored, alive = closed
        assert calls == ["finalize"] and is_closed and not errored and not alive, closed
        assert seconds < 10.0, seconds
        assert aborted == (["abort", "empty_cache"], False), aborted
