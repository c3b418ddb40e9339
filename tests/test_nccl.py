"""The NCCL backend (cupy) on one GPU: collectives, fusion, the optimizer, abort and re-forming.

Skipped cleanly where CUDA or cupy's NCCL is missing (CI has no GPU); run on a
GPU machine with ``pip install -e .[gpu,test] && pytest tests/test_nccl.py``.
The test that NCCL is refused with a clear message runs everywhere.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er

needs_nccl = pytest.mark.skipif(not er.nccl_available(), reason="needs CUDA and cupy with NCCL (pip install -e .[gpu])")


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield er.StoreAddress("127.0.0.1", master.port)
    er.shutdown()


def nccl_spec(store, round_id, **kw):
    return er.RingSpec(round_id=round_id, rank=0, world_size=1, node_ids=("gpu-node",), store=store,
                       backend="nccl", job_id="nccl-test", **kw)


def test_nccl_without_cuda_is_refused_with_a_clear_message(store):
    if er.nccl_available():
        pytest.skip("this machine has NCCL; the refusal path applies to machines without it")
    with pytest.raises(RuntimeError, match=r"backend='nccl' needs CUDA and cupy"):
        er.init(nccl_spec(store, 1))


@needs_nccl
@pytest.mark.gpu
def test_nccl_collectives_abort_and_reform(store):
    comm = er.init(nccl_spec(store, 1))
    device = comm.device
    assert device.type == "cuda"
    x = torch.arange(6, dtype=torch.float32, device=device)
    for op in (er.Sum, er.Average, er.Min, er.Max):
        torch.testing.assert_close(er.allreduce(x, op=op), x)
    half = torch.full((4,), 40000.0, dtype=torch.float16, device=device)
    assert torch.isfinite(er.allreduce(half)).all()
    tensors = [torch.randn(s, device=device) for s in ((3, 3), (100,), (7,))]
    outs = er.grouped_allreduce(tensors, fusion_threshold_bytes=64, compression=er.Compression.fp16)
    for o, t in zip(outs, tensors):
        torch.testing.assert_close(o, t, rtol=2e-3, atol=2e-3)
    assert er.broadcast(x, root_rank=0).device == device
    assert er.allgather(x.view(3, 2)).shape == (3, 2)
    assert er.broadcast_object({"a": 1}) == {"a": 1}
    er.barrier()

    # the communicator itself (world size 1 short-circuits the public API, so drive it directly)
    y = torch.ones(8, device=device)
    comm.allreduce(y, er.Sum).wait()
    comm.broadcast(y, 0).wait()
    out = torch.empty((1, 8), device=device)
    comm.allgather(out, y).wait()
    torch.cuda.synchronize()
    assert out.sum().item() == 8

    model = torch.nn.Linear(4, 2).to(device)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(torch.randn(3, 4, device=device)).sum().backward()
    opt.step()

    comm.abort()
    assert not comm.errored
    with pytest.raises(er.CommError):
        comm.allreduce(y, er.Sum)

    comm2 = er.init(nccl_spec(store, 2))  # same process, next round
    z = torch.full((5,), 2.0, device=device)
    comm2.allreduce(z, er.Sum).wait()
    torch.cuda.synchronize()
    assert z.tolist() == [2.0] * 5


@needs_nccl
@pytest.mark.gpu
def test_nccl_missing_peer_times_out_with_comm_error(store):
    # A second rank never joins: creation must give up after connect_timeout_s.
    # Run in a subprocess: the NCCL init thread stays blocked until its process exits.
    code = textwrap.dedent(f"""
        import time, elastic_ring as er
        spec = er.RingSpec(round_id=1, rank=0, world_size=2, node_ids=("a", "b"), backend="nccl",
                           store=er.StoreAddress("{store.host}", {store.port}), job_id="nccl-absent",
                           connect_timeout_s=3.0)
        t = time.monotonic()
        try:
            er.init(spec)
        except er.CommError as exc:
            print("COMMERROR", round(time.monotonic() - t, 1), exc)
        import os; os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "COMMERROR" in out.stdout, out.stdout + out.stderr
    assert "connect_timeout_s=3.0" in out.stdout
