"""Fusion planning and packing, single process (tables of shapes, dtypes and thresholds)."""

import pytest
import torch

from elastic_ring import Compression
from elastic_ring.reduction import fusion

CPU = torch.device("cpu")


def metas(*specs):
    return [(n, dt, CPU) for n, dt in specs]


F32, F16, I64 = torch.float32, torch.float16, torch.int64


@pytest.mark.parametrize(
    "specs, threshold, expected",
    [
        # everything fits in one buffer
        ([(10, F32), (20, F32), (30, F32)], 1000, [(0, 1, 2)]),
        # exactly at the threshold stays in one buffer; one byte less splits
        ([(10, F32), (15, F32)], 100, [(0, 1)]),
        ([(10, F32), (15, F32)], 99, [(0,), (1,)]),
        # a tensor larger than the threshold gets a bucket of its own
        ([(5, F32), (1000, F32), (5, F32)], 100, [(0,), (1,), (2,)]),
        # dtypes never share a buffer; order of first tensor decides launch order
        ([(4, F32), (4, I64), (4, F32), (4, I64)], 1000, [(0, 2), (1, 3)]),
        ([(4, F16), (4, F32), (4, F16)], 1000, [(0, 2), (1,)]),
        # filling per dtype: closed buckets sorted by their first tensor
        ([(20, F32), (20, F32), (1, I64), (20, F32)], 160, [(0, 1), (2,), (3,)]),
    ],
)
def test_plan_buckets(specs, threshold, expected):
    buckets = fusion.plan_buckets(metas(*specs), threshold, Compression.none)
    assert [b.indices for b in buckets] == expected
    covered = sorted(i for b in buckets for i in b.indices)
    assert covered == list(range(len(specs)))
    for b in buckets:
        assert len(b.indices) == 1 or b.nbytes <= threshold


def test_fp16_compression_changes_wire_dtype_and_bucket_size():
    buckets = fusion.plan_buckets(metas((10, F32), (10, torch.float64), (10, I64)), 10_000, Compression.fp16)
    assert [(b.indices, b.wire_dtype) for b in buckets] == [((0, 1), F16), ((2,), I64)]
    assert buckets[0].nbytes == 40


def test_invalid_threshold():
    with pytest.raises(ValueError, match="fusion_threshold_bytes=0"):
        fusion.plan_buckets(metas((1, F32)), 0, Compression.none)


def test_pack_unpack_roundtrip_with_casts_and_noncontiguous():
    a = torch.randn(3, 4)
    b = torch.randn(4, 3).t()  # non-contiguous
    c = torch.randn(5, dtype=torch.float64)
    tensors = [a, b, c]
    bucket = fusion.plan_buckets(fusion.metas_of(tensors), 1 << 20, Compression.fp16)[0]
    assert bucket.indices == (0, 1, 2)
    buf = fusion.pack(bucket, tensors, fusion.allocate(bucket))
    assert buf.dtype == F16 and buf.numel() == 29
    outs = fusion.unpack_views(bucket, buf, tensors)
    for t, o in zip(tensors, outs):
        assert o.shape == t.shape and o.dtype == t.dtype
        torch.testing.assert_close(o, t, rtol=1e-3, atol=1e-3)
    targets = [torch.zeros_like(a), torch.zeros(4, 3).t(), torch.zeros_like(c)]
    fusion.unpack_(bucket, buf, targets)
    for t, o in zip(tensors, targets):
        torch.testing.assert_close(o, t, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "specs, threshold, first, expected",
    [
        # the first bucket closes as soon as it holds >= first bytes (DDP's early first bucket) ...
        ([(10, F32), (300, F32), (20, F32), (20, F32)], 10_000, 1000, [(0, 1), (2, 3)]),
        # ... and not before
        ([(10, F32), (100, F32), (300, F32), (20, F32)], 10_000, 1000, [(0, 1, 2), (3,)]),
        # it never grows past the threshold
        ([(100, F32), (100, F32), (100, F32)], 800, 1000, [(0, 1), (2,)]),
        # 0 turns it off
        ([(10, F32), (300, F32), (20, F32)], 10_000, 0, [(0, 1, 2)]),
        # one per dtype group
        ([(300, F32), (300, I64), (5, F32), (5, I64)], 10_000, 1000, [(0,), (1,), (2,), (3,)]),
    ],
)
def test_early_first_bucket(specs, threshold, first, expected):
    buckets = fusion.plan_buckets(metas(*specs), threshold, Compression.none, first_bucket_bytes=first)
    assert [b.indices for b in buckets] == expected


def test_split_source_dtypes_keeps_dtypes_apart_for_views():
    specs = metas((10, F32), (10, torch.float64), (10, F32))
    mixed = fusion.plan_buckets(specs, 10_000, Compression.fp16)
    split = fusion.plan_buckets(specs, 10_000, Compression.fp16, split_source_dtypes=True)
    assert [b.indices for b in mixed] == [(0, 1, 2)] and mixed[0].source_dtype is None
    assert [(b.indices, b.wire_dtype, b.source_dtype) for b in split] == [((0, 2), F16, F32), ((1,), F16, torch.float64)]


def test_pack_divides_while_casting_so_fp16_average_does_not_overflow():
    big = torch.tensor([1e5, -9e4, 3.0])
    bucket = fusion.plan_buckets(fusion.metas_of([big]), 1 << 20, Compression.fp16)[0]
    naive = big.to(F16)
    assert torch.isinf(naive[:2]).all()  # what casting first would do
    packed = fusion.pack(bucket, [big], fusion.allocate(bucket), divisor=2)
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed.float(), big / 2, rtol=1e-3, atol=1e-3)
    same_dtype = fusion.pack(bucket, [big.to(F16).nan_to_num(65504.0)], fusion.allocate(bucket), divisor=4)
    assert torch.isfinite(same_dtype).all()


def test_buffer_pool_is_bounded_owned_by_one_ring_and_clearable():
    import gc

    class Ring:  # stands in for a communicator: any object that can be weakly referenced
        pass

    bucket = fusion.plan_buckets(metas((256, F32)), 1 << 20, Compression.none)[0]  # 1 KiB
    pool = fusion.BufferPool(max_bytes=1536)
    ring = Ring()
    a = pool.acquire(bucket, 0, owner=ring)
    assert pool.acquire(bucket, 0, owner=ring).data_ptr() == a.data_ptr() and pool.nbytes == 1024
    over = pool.acquire(bucket, 1, owner=ring)  # a second KiB would exceed the bound: handed out unpooled
    assert over.numel() == 256 and pool.nbytes == 1024
    other = Ring()
    b = pool.acquire(bucket, 0, owner=other)  # another ring: the old ring's buffers go
    assert pool.nbytes == 1024 and b.data_ptr() != a.data_ptr()
    del other
    gc.collect()
    assert pool.nbytes == 0, "the pool empties when its ring is garbage-collected"
    pool.acquire(bucket, 0, owner=ring)
    pool.clear()
    assert pool.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes=-1"):
        fusion.BufferPool(-1)
