"""Every collective over 2 and 3 real processes (gloo), against a single-process reference.

Each rank builds its inputs from a seed and its rank, so each can compute the
reference result of the whole ring locally and compare.
"""

import pytest
import torch

import elastic_ring as er
from elastic_ring.reduction import fusion


def inputs_of(rank, shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randn(s, generator=g) * 10).to(dtype) for s in shapes]


REDUCERS = {
    "sum": lambda xs: torch.stack(xs).sum(0),
    "average": lambda xs: torch.stack(xs).sum(0) / len(xs),
    "min": lambda xs: torch.stack(xs).min(0).values,
    "max": lambda xs: torch.stack(xs).max(0).values,
}


def _allreduce_every_op():
    n, r = er.size(), er.rank()
    shapes = [(3, 4), (7,), (2, 2, 2)]
    mine = inputs_of(r, shapes)
    everyone = [inputs_of(q, shapes) for q in range(n)]
    for op in ("sum", "average", "min", "max"):
        for i, t in enumerate(mine):
            expected = REDUCERS[op]([e[i] for e in everyone])
            got = er.allreduce(t, op=op, name=f"t{i}")
            torch.testing.assert_close(got, expected)
            assert got.data_ptr() != t.data_ptr()
            inplace = t.clone()
            assert er.allreduce_(inplace, op=op) is inplace
            torch.testing.assert_close(inplace, expected)
    ints = torch.arange(6, dtype=torch.int64) * (r + 1)
    torch.testing.assert_close(er.allreduce(ints, op=er.Sum), torch.arange(6) * sum(range(1, n + 1)))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_every_op_matches_reference(ring, world):
    assert ring.run(_allreduce_every_op, world_size=world) == [True] * world


def _grouped_mixed(threshold):
    n, r = er.size(), er.rank()
    # mixed dtypes and sizes around the threshold: some tensors exactly fill it, one exceeds it
    shapes = [(16,), (8,), (3, 3), (40,), (17,), (1,), (64,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float32, torch.float64, torch.float32, torch.float32]
    mine = [inputs_of(r, [s], dt, seed=i)[0] for i, (s, dt) in enumerate(zip(shapes, dtypes))]
    everyone = [[inputs_of(q, [s], dt, seed=i)[0] for i, (s, dt) in enumerate(zip(shapes, dtypes))] for q in range(n)]
    buckets = fusion.plan_buckets(fusion.metas_of(mine), threshold, er.Compression.none)
    assert len(buckets) > 2, "the threshold should split the group into several buffers"
    for op in ("sum", "average", "max"):
        expected = [REDUCERS[op]([e[i] for e in everyone]) for i in range(len(mine))]
        got = er.grouped_allreduce(mine, op=op, fusion_threshold_bytes=threshold)
        for g, e, t in zip(got, expected, mine):
            assert g.dtype == t.dtype and g.shape == t.shape
            torch.testing.assert_close(g, e)
        copies = [t.clone() for t in mine]
        er.grouped_allreduce_(copies, op=op, fusion_threshold_bytes=threshold)
        for c, e in zip(copies, expected):
            torch.testing.assert_close(c, e)
    return len(buckets)


@pytest.mark.parametrize("threshold", [64, 100, 136])
def test_grouped_allreduce_fusion_mixed_dtypes_around_threshold(ring, threshold):
    # 64 B = the 16-float tensor exactly; 136 B = 16 + 8 + 9... floats straddle the limit
    results = ring.run(_grouped_mixed, threshold)
    assert len(set(results)) == 1


def _grouped_one_buffer():
    r = er.rank()
    tensors = [torch.full((5,), float(r + i)) for i in range(4)]
    out = er.grouped_allreduce(tensors, op=er.Sum, fusion_threshold_bytes=1 << 20)
    n = er.size()
    return [o.tolist() == [float(sum(q + i for q in range(n)))] * 5 for i, o in enumerate(out)]


def test_grouped_allreduce_single_buffer(ring):
    assert ring.run(_grouped_one_buffer) == [[True] * 4] * 3


def _fp16_compression():
    n, r = er.size(), er.rank()
    t = inputs_of(r, [(100,)])[0]
    expected = sum(inputs_of(q, [(100,)])[0] for q in range(n)) / n
    got = er.allreduce(t, compression=er.Compression.fp16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-2)
    grouped = er.grouped_allreduce([t, t.double()], compression=er.Compression.fp16)
    assert [g.dtype for g in grouped] == [torch.float32, torch.float64]
    torch.testing.assert_close(grouped[1], expected.double(), rtol=2e-3, atol=2e-2)
    # averaging 40000 over ranks in fp16: a plain sum would overflow to inf (max 65504)
    big = torch.full((8,), 40000.0, dtype=torch.float16)
    avg = er.allreduce(big, op=er.Average)
    assert torch.isfinite(avg).all() and avg.tolist() == [40000.0] * 8
    avg32 = er.allreduce(torch.full((8,), 40000.0), compression=er.Compression.fp16)
    assert avg32.tolist() == [40000.0] * 8
    bf = er.allreduce(torch.full((4,), float(r + 1), dtype=torch.bfloat16), op=er.Sum)
    assert bf.tolist() == [float(n * (n + 1) // 2)] * 4
    return True


def test_fp16_compression_and_overflow_free_average(ring):
    assert ring.run(_fp16_compression) == [True] * 3


def _broadcasts(root):
    r = er.rank()
    t = torch.full((3, 2), float(r))
    assert er.broadcast(t, root_rank=root).tolist() == [[float(root)] * 2] * 3
    assert t.tolist() == [[float(r)] * 2] * 3, "broadcast must not modify its input"
    er.broadcast_(t, root_rank=root)
    assert t.tolist() == [[float(root)] * 2] * 3
    mixed = [torch.full((4,), r, dtype=torch.int64), torch.full((2, 2), float(r)), torch.tensor([r % 2 == 0])]
    er.grouped_broadcast_(mixed, root_rank=root)
    assert mixed[0].tolist() == [root] * 4 and mixed[1].tolist() == [[float(root)] * 2] * 2
    assert mixed[2].tolist() == [root % 2 == 0]
    obj = er.broadcast_object({"from": r, "payload": list(range(r + 1))} if r == root else None, root_rank=root)
    assert obj == {"from": root, "payload": list(range(root + 1))}
    tree = {"w": torch.full((2,), float(r)), "meta": ("x", r), "nested": [torch.arange(r + 1), 5]} if r == root else None
    got = er.broadcast_tree(tree, root_rank=root)
    assert got["w"].tolist() == [float(root)] * 2 and got["meta"] == ("x", root)
    assert got["nested"][0].tolist() == list(range(root + 1)) and got["nested"][1] == 5
    return True


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_family(ring, root):
    assert ring.run(_broadcasts, root) == [True] * 3


def _gathers():
    n, r = er.size(), er.rank()
    t = torch.arange((r + 1) * 3, dtype=torch.float32).view(r + 1, 3) + 100 * r
    out = er.allgather(t)
    expected = torch.cat([torch.arange((q + 1) * 3, dtype=torch.float32).view(q + 1, 3) + 100 * q for q in range(n)])
    torch.testing.assert_close(out, expected)
    same = er.allgather(torch.full((2,), r, dtype=torch.int64))
    assert same.tolist() == [q for q in range(n) for _ in range(2)]
    empty_on_zero = er.allgather(torch.ones(0 if r == 0 else 1, 2))
    assert empty_on_zero.shape == (n - 1, 2)
    objs = er.allgather_object({"rank": r, "blob": "x" * (10 * r)})
    assert objs == [{"rank": q, "blob": "x" * (10 * q)} for q in range(n)]
    er.barrier()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_family(ring, world):
    assert ring.run(_gathers, world_size=world) == [True] * world


def _identity():
    return er.rank(), er.size(), er.local_rank(), er.local_size(), er.round_id()


def test_rank_size_local_rank_from_the_spec(ring):
    results = ring.run(_identity, node_ids=("n0", "n1", "n0"))
    assert [r[:4] for r in results] == [(0, 3, 0, 2), (1, 3, 0, 1), (2, 3, 1, 2)]
    assert len({r[4] for r in results}) == 1


def _bad_arguments():
    errors = []
    for call in (
        lambda: er.allreduce(torch.ones(3, dtype=torch.complex64), op=er.Average),  # a dtype no backend reduces
        lambda: er.allreduce(torch.ones(2), op="median"),
        lambda: er.allreduce(torch.ones(2), compression="fp16"),
        lambda: er.broadcast(torch.ones(2), root_rank=7),
        lambda: er.allgather(torch.tensor(1.0)),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc).split(";")[0])
    er.barrier()  # the ring is still usable after argument errors
    return errors


def test_bad_arguments_raise_on_every_rank_and_leave_the_ring_usable(ring):
    results = ring.run(_bad_arguments)
    assert len(results[0]) == 5
    assert all(r == results[0] for r in results)
    assert "cannot allreduce tensor 'allreduce' of dtype torch.complex64" in results[0][0]
    assert "root_rank=7" in results[0][3]


def _fp16_prescale_before_cast():
    """Values near 1e5 do not fit float16 (max 65504), but their average over the ring does."""
    n, r = er.size(), er.rank()
    x = torch.where(torch.arange(6) % n == r, torch.tensor(1e5), torch.tensor(100.0))
    expected = torch.full((6,), (1e5 + 100.0 * (n - 1)) / n)
    outs = [er.allreduce(x, compression=er.Compression.fp16)]
    inplace = x.clone()
    outs.append(er.allreduce_(inplace, compression=er.Compression.fp16))
    outs += er.grouped_allreduce([x, x.double()], compression=er.Compression.fp16)
    for out in outs:
        assert torch.isfinite(out).all(), out
        torch.testing.assert_close(out, expected.to(out.dtype), rtol=2e-3, atol=0)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_average_of_values_above_the_fp16_range(ring, world):
    assert ring.run(_fp16_prescale_before_cast, world_size=world) == [True] * world


def _pool_use():
    from elastic_ring.collectives import tensors as collectives

    at_start = collectives._POOL.nbytes  # what the previous ring left: nothing once it is gone
    big = torch.ones(1 << 18)  # 1 MiB, contiguous float32: reduced in place, no buffer
    er.allreduce_(big, op=er.Sum)
    direct = collectives._POOL.nbytes
    er.grouped_allreduce_([torch.ones(100), torch.ones(50)], op=er.Sum)
    fused = collectives._POOL.nbytes
    released = collectives.release_buffers() or collectives._POOL.nbytes
    er.grouped_allreduce_([torch.ones(100), torch.ones(50)], op=er.Sum)
    return at_start, direct, fused, released, collectives._POOL.nbytes, big[0].item()


def test_pool_direct_path_new_ring_and_release(ring):
    first = ring.run(_pool_use, world_size=2)
    second = ring.run(_pool_use, world_size=2)  # a new ring: the previous ring's buffers are gone
    for at_start, direct, fused, released, kept, value in first + second:
        assert direct == 0, "allreduce_ of one contiguous tensor of the wire dtype must not take a pooled buffer"
        assert fused == 600 and released == 0 and kept == 600 and value == 2.0
    assert [s[0] for s in second] == [0, 0]


def _one_rank_bad_inputs():
    """A local input error on one rank only: every rank raises at once, and the ring stays usable."""
    import threading
    import time

    r = er.rank()
    unpicklable = threading.Lock()
    cases = {
        "alltoall splits length": (1, lambda bad: er.alltoall(torch.ones(3, 2), splits=[1, 1, 1, 0] if bad else [1, 1, 1])),
        "alltoall splits sum": (1, lambda bad: er.alltoall(torch.ones(3, 2), splits=[2, 2, 2] if bad else [1, 1, 1])),
        "alltoall negative split": (2, lambda bad: er.alltoall(torch.ones(3, 2), splits=[-1, 2, 2] if bad else [1, 1, 1])),
        "alltoall no splits": (1, lambda bad: er.alltoall(torch.ones(4 if bad else 3, 2))),
        "reducescatter 0-dim": (0, lambda bad: er.reducescatter(torch.tensor(1.0) if bad else torch.ones(3))),
        "reducescatter op": (2, lambda bad: er.reducescatter(torch.ones(3), op=er.Max if bad else er.Sum)),
        "allgather not a tensor": (1, lambda bad: er.allgather([1, 2] if bad else torch.ones(2))),
        "allgather 0-dim": (1, lambda bad: er.allgather(torch.tensor(1.0) if bad else torch.ones(1))),
        "allreduce op": (1, lambda bad: er.allreduce(torch.ones(2), op="median" if bad else "sum")),
        "grouped_allreduce not a tensor": (2, lambda bad: er.grouped_allreduce([torch.ones(2), 3 if bad else torch.ones(1)])),
        "broadcast names": (0, lambda bad: er.grouped_broadcast_([torch.ones(2)], 0, name=["a", "b"] if bad else ["a"])),
        "broadcast_object unpicklable root": (0, lambda bad: er.broadcast_object(unpicklable if bad else 1, root_rank=0)),
        "allgather_object unpicklable": (2, lambda bad: er.allgather_object(unpicklable if bad else r)),
        "broadcast_tree unpicklable leaf": (1, lambda bad: er.broadcast_tree({"lock": unpicklable} if bad else None, root_rank=1)),
    }
    out = {}
    for label, (bad_rank, call) in cases.items():
        started = time.monotonic()
        try:
            call(r == bad_rank)
            outcome = "no error"
        except (TypeError, ValueError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out[label] = (outcome, time.monotonic() - started)
        er.barrier()  # still paired: nothing of the failed call is left on the ring
    started = time.monotonic()
    try:
        er.alltoall(torch.ones(3, 1), splits=[3, 0])  # the same bad splits on every rank: the check agrees
    except ValueError as exc:
        out["every rank bad"] = (f"ValueError: {exc}", time.monotonic() - started)
    out["after"] = er.allreduce(torch.ones(2), op=er.Sum).tolist()
    return out


def test_a_bad_input_on_one_rank_only_makes_every_rank_raise_and_leaves_the_ring_usable(ring):
    # a collective timeout far above what the test allows: a rank left waiting would show
    results = ring.run(_one_rank_bad_inputs, world_size=3, timeout_s=60, collective_timeout_s=30)
    bad_ranks = {"alltoall splits length": 1, "alltoall splits sum": 1, "alltoall negative split": 2,
                 "alltoall no splits": 1, "reducescatter 0-dim": 0, "reducescatter op": 2, "allgather not a tensor": 1,
                 "allgather 0-dim": 1, "allreduce op": 1, "grouped_allreduce not a tensor": 2, "broadcast names": 0,
                 "broadcast_object unpicklable root": 0, "allgather_object unpicklable": 2,
                 "broadcast_tree unpicklable leaf": 1}
    for rank, out in enumerate(results):
        assert out.pop("after") == [3.0, 3.0]
        every = out.pop("every rank bad")
        assert every[0].startswith("ValueError: alltoall splits=[3, 0] must give 3") and every[1] < 5
        assert set(out) == set(bad_ranks)
        for label, (outcome, elapsed) in out.items():
            assert elapsed < 5, (label, elapsed)
            if rank == bad_ranks[label]:  # its own error, saying what is wrong with its arguments
                assert not outcome.startswith(("no error", "TensorMismatchError")), (label, outcome)
            else:  # the peers: a mismatch naming that rank and its problem
                assert outcome.startswith("TensorMismatchError"), (label, outcome)
                assert f"rank {bad_ranks[label]}: " in outcome and "with invalid arguments" in outcome, (label, outcome)
