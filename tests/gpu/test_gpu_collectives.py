"""Every collective and dtype over a real NCCL ring of 2 and 3 ranks on one GPU, against references that
each rank computes from every rank's (deterministic) inputs; fp16 compression; empty tensors; the
communicator's own collectives at world size > 1 (where the public API does not short-circuit)."""

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.core.ops import ReduceOp

pytestmark = pytest.mark.gpu

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]
AVERAGE_TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def _values(rank, dtype, shape, seed):
    """Small integers, exact in every dtype (uint8: non-negative), so Sum/Min/Max are exact."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    low = 0 if dtype == torch.uint8 else -8
    return torch.randint(low, 9, shape, generator=g).to(dtype)


def _device():
    return runtime.current().device


def _reductions(seed):
    n, r, dev = er.size(), er.rank(), _device()
    checks = 0
    for dtype in FLOATS + INTS:
        everyone = [_values(k, dtype, (5, 7), seed) for k in range(n)]
        stacked = torch.stack([t.double() for t in everyone])
        expected = {er.Sum: stacked.sum(0), er.Min: stacked.min(0).values, er.Max: stacked.max(0).values}
        if dtype in FLOATS:
            expected[er.Average] = stacked.mean(0)
        for op, want in expected.items():
            mine = everyone[r].to(dev)
            got = er.allreduce(mine, op=op, name=f"t.{dtype}")
            assert got.device == dev and got.dtype == dtype
            tol = AVERAGE_TOL[dtype] if op is er.Average else 0.0
            torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tol, msg=f"{dtype} {op}")
            assert torch.equal(mine.cpu(), everyone[r]), "allreduce (not in place) changed its input"
            inplace = everyone[r].to(dev, copy=True)
            assert er.allreduce_(inplace, op=op) is inplace
            torch.testing.assert_close(inplace.double().cpu(), want, rtol=0, atol=tol)
            checks += 2
    # a non-contiguous tensor goes through the fusion buffer
    base = _values(r, torch.float32, (6, 4), seed).to(dev)
    got = er.allreduce(base.t(), op=er.Sum)
    want = sum(_values(k, torch.float32, (6, 4), seed) for k in range(n)).t()
    torch.testing.assert_close(got.cpu(), want)
    # grouped, fused into several buckets of mixed dtypes
    shapes = [(3, 3), (100,), (7,), (2, 5, 2), (1,)]
    dtypes = [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float32]
    mine = [_values(r, d, s, seed + i).to(dev) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = er.grouped_allreduce(mine, op=er.Sum, fusion_threshold_bytes=64)
    for i, (o, s, d) in enumerate(zip(outs, shapes, dtypes)):
        want = sum(_values(k, d, s, seed + i).double() for k in range(n))
        assert o.dtype == d and o.device == dev
        torch.testing.assert_close(o.double().cpu(), want, rtol=0, atol=0)
        checks += 1
    # empty tensors move nothing and still agree
    empty = er.allreduce(torch.empty(0, device=dev), op=er.Sum)
    assert empty.shape == (0,) and empty.device == dev
    return checks


def _fp16_compression(seed):
    n, r, dev = er.size(), er.rank(), _device()
    shapes = [(64, 33), (1000,), (5,)]
    # exact case: integers are exact in fp16, so the fp16 wire changes nothing
    mine = [_values(r, torch.float32, s, seed + i).to(dev) for i, s in enumerate(shapes)]
    outs = er.grouped_allreduce(mine, op=er.Sum, compression=er.Compression.fp16, fusion_threshold_bytes=4096)
    for i, (o, s) in enumerate(zip(outs, shapes)):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o.cpu(), sum(_values(k, torch.float32, s, seed + i) for k in range(n)))
    # random values: within fp16's precision of the float32 average
    g = torch.Generator().manual_seed(seed)
    everyone = [torch.randn(4096, generator=g) for _ in range(n)]
    got = er.allreduce(everyone[r].to(dev), op=er.Average, compression=er.Compression.fp16)
    torch.testing.assert_close(got.cpu(), torch.stack(everyone).mean(0), rtol=2e-3, atol=2e-3)
    return True


def _broadcasts(seed):
    n, r, dev = er.size(), er.rank(), _device()
    dtypes = FLOATS + INTS + [torch.bool, torch.complex64]
    if dev.type == "cuda":  # NCCL moves bytes: dtypes that gloo cannot move too
        dtypes += [torch.int16, torch.float8_e4m3fn]
    checks = 0
    for root in range(n):
        for dtype in dtypes:
            def make(k):
                v = _values(k, torch.float32, (4, 3), seed)
                if dtype == torch.bool:
                    return v > 0
                if dtype == torch.complex64:
                    return torch.complex(v, -v)
                return v.abs().to(dtype) if dtype == torch.uint8 else v.to(dtype)

            t = make(r).to(dev)
            got = er.broadcast(t, root_rank=root, name=f"b.{dtype}")
            assert got.device == dev and got.dtype == dtype
            assert torch.equal(got.cpu().view(torch.uint8), make(root).view(torch.uint8)), (root, dtype)
            checks += 1
        # grouped, fused by dtype
        group = [_values(r, d, (3, 2), seed + i).to(dev) for i, d in enumerate(FLOATS + INTS)]
        er.grouped_broadcast_(group, root_rank=root, fusion_threshold_bytes=32)
        for i, (t, d) in enumerate(zip(group, FLOATS + INTS)):
            assert torch.equal(t.cpu(), _values(root, d, (3, 2), seed + i))
    return checks


def _allgathers(seed):
    n, r, dev = er.size(), er.rank(), _device()
    for dtype in [torch.float32, torch.int64, torch.bool, torch.complex64, torch.float16]:
        def make(k):
            v = _values(k, torch.float32, (k + 1, 3), seed)  # rank k has k+1 rows
            if dtype == torch.bool:
                return v > 0
            return torch.complex(v, v) if dtype == torch.complex64 else v.to(dtype)

        got = er.allgather(make(r).to(dev))
        assert got.device == dev and got.dtype == dtype
        assert torch.equal(got.cpu(), torch.cat([make(k) for k in range(n)]))
    rows = 0 if r == 0 else 2  # a rank with no rows
    got = er.allgather(torch.full((rows, 2), float(r), device=dev))
    assert got.shape == (2 * (n - 1), 2)
    return True


def _objects_and_barrier():
    n, r = er.size(), er.rank()
    assert er.broadcast_object({"from": r} if r == 1 else None, root_rank=1) == {"from": 1}
    assert er.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    er.barrier()
    return True


def _communicator_direct():
    """The communicator's own collectives, which the public API skips at world size 1."""
    comm = runtime.current()
    n, r, dev = comm.size, comm.rank, comm.device
    y = torch.full((8,), float(r + 1), device=dev)
    comm.allreduce(y, ReduceOp.SUM).wait()
    assert y.cpu().tolist() == [n * (n + 1) / 2] * 8
    z = torch.full((5,), float(r), device=dev)
    comm.broadcast(z, n - 1).wait()
    assert z.cpu().tolist() == [float(n - 1)] * 5
    out = torch.empty((n, 3), dtype=torch.int64, device=dev)
    comm.allgather(out, torch.full((3,), r, dtype=torch.int64, device=dev)).wait()
    assert out.cpu().tolist() == [[k] * 3 for k in range(n)]
    comm.barrier()
    if dev.type == "cuda":
        with pytest.raises(ValueError, match="moves tensors on cuda"):
            comm.allreduce(torch.ones(2), ReduceOp.SUM)
    return str(dev)


@pytest.mark.parametrize("world", [2, 3])
def test_reductions_every_dtype_and_op(gpu_ring, world):
    checks = gpu_ring.run(_reductions, 1, world_size=world, timeout_s=150)
    assert checks == [4 * 4 * 2 + 4 * 3 * 2 + 5] * world


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_compression(gpu_ring, world):
    assert gpu_ring.run(_fp16_compression, 2, world_size=world) == [True] * world


@pytest.mark.parametrize("world", [2, 3])
def test_broadcasts_every_dtype_from_every_root(gpu_ring, world):
    checks = gpu_ring.run(_broadcasts, 3, world_size=world, timeout_s=150)
    assert checks == [world * 12] * world  # 12 dtypes from every root


@pytest.mark.parametrize("world", [2, 3])
def test_allgathers_of_uneven_sizes(gpu_ring, world):
    assert gpu_ring.run(_allgathers, 4, world_size=world) == [True] * world


def test_objects_and_barrier(gpu_ring):
    assert gpu_ring.run(_objects_and_barrier, world_size=3) == [True] * 3


def test_the_communicator_itself_at_world_size_3(gpu_ring):
    assert gpu_ring.run(_communicator_direct, world_size=3) == ["cuda:0"] * 3
