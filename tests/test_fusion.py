"""Fusion planning and packing, single process (tables of shapes, dtypes and thresholds)."""

import pytest
import torch

from elastic_ring import Compression
from elastic_ring import fusion

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
