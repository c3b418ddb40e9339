"""``hvd.allreduce(t, op=hvd.Adasum)`` on real gloo rings: Horovod's own Adasum tests (test_adasum_pytorch.py:
orthogonal vectors sum, parallel ones average, tiny and widely scaled magnitudes stay stable), the pairwise tree
against an independent reference, the same bits on every rank, and Horovod's refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import elastic_ring as er
import ray_integration.horovod as hvd
from tests.process_ring import ProcessRing


@pytest.fixture(scope="module")
def ring4():
    pool = ProcessRing(4)
    yield pool
    pool.close()


# ------------------------------------------------------------------ Horovod's test_adasum_pytorch.py, on CPU
def _diff_ratio(true_vec: np.ndarray, comp_vec: np.ndarray) -> float:
    return float(np.linalg.norm(true_vec - comp_vec) / np.linalg.norm(true_vec) / 100.0)


def _horovod_cases():
    """Horovod's four cases for float32 and float16 (its data types): each returns the ratio its test bounds by
    the dtype's eps. Horovod runs them on GPUs with MPI; the expectations are its CPU (pure Adasum) ones."""
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    out = {}
    for data_type in (np.float32, np.float16):
        np.random.seed(2)
        # orthogonal: the columns of Q are orthogonal, so Adasum is their sum
        all_ns = [size * 20 - 17, size * 2 + 1, size + 2, 2 ** 19]
        tensors, qs = [], []
        for n in all_ns:
            q, _ = np.linalg.qr(np.random.normal(0, 1, (n, size)).astype(np.float64))
            q = q.astype(data_type)
            qs.append(q.astype(np.float64))
            tensors.append(torch.from_numpy(np.ascontiguousarray(q[:, rank])))
        handles = [hvd.allreduce_async(t, op=hvd.Adasum) for t in tensors]
        reduced = [hvd.synchronize(h) for h in handles]
        out[("orthogonal", data_type.__name__)] = max(
            _diff_ratio(q.sum(axis=1), r.double().numpy()) for q, r in zip(qs, reduced))
        # parallel: every rank's vector is a multiple of one vector, so Adasum is their average
        all_ns = [size * 20 - 13, size * 2 + 1, size + 2, 2 ** 19]
        tensors, qs = [], []
        for n in all_ns:
            a = np.random.normal(0, 1, (n, 1)).astype(np.float64)
            r = np.random.normal(0, 1, (size, 1)).astype(np.float64)
            q = np.dot(a, r.T).astype(data_type)
            qs.append(q.astype(np.float64))
            tensors.append(torch.from_numpy(np.ascontiguousarray(q[:, rank])))
        reduced = [hvd.synchronize(hvd.allreduce_async(t, op=hvd.Adasum)) for t in tensors]
        out[("parallel", data_type.__name__)] = max(
            _diff_ratio(q.sum(axis=1) / size, r.double().numpy()) for q, r in zip(qs, reduced))
        # stability: magnitudes at the dtype's smallest normal number
        a = np.random.normal(0, np.finfo(data_type).tiny, (1024, 1)).astype(np.float64)
        r = np.random.normal(0, 1, (size, 1)).astype(np.float64)
        q = np.dot(a, r.T).astype(data_type).astype(np.float64)
        tensor = torch.from_numpy(q[:, rank].astype(data_type))
        hvd.allreduce_(tensor, op=hvd.Adasum)
        out[("stability", data_type.__name__)] = _diff_ratio(q.sum(axis=1) / size, tensor.double().numpy())
        # stability 2: the ranks' scales spread from the smallest normal number to the square root of the largest
        a = np.random.normal(0, 1, (1024, 1)).astype(np.float64)
        dt_min = np.finfo(data_type).tiny.astype(np.float64)
        dt_max = math.sqrt(np.finfo(data_type).max.astype(np.float64))
        r = np.array([dt_max ** (float(i + 1) / size) * dt_min ** (float(size - i - 1) / size)
                      for i in range(size)]).reshape(size, 1)
        np.random.shuffle(r)
        q = np.dot(a, r.T).astype(data_type).astype(np.float64)
        tensor = torch.from_numpy(q[:, rank].astype(data_type))
        hvd.allreduce_(tensor, op=hvd.Adasum)
        out[("stability_2", data_type.__name__)] = _diff_ratio(q.sum(axis=1) / size, tensor.double().numpy())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_horovods_adasum_tests_pass(ring4, world):
    results = ring4.run(_horovod_cases, world_size=world, timeout_s=90)
    for (case, dtype), ratio in results[0].items():
        assert ratio < np.finfo(dtype).eps, f"{case} {dtype} at {world} ranks: off by {ratio}"
    assert all(r == results[0] for r in results[1:])


# ------------------------------------------------------------------ the tree, exactly
def _reference(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The pairwise tree over the ranks' whole vectors (rank order, lower ranks first), float64 math and the
    tensor's dtype between levels: written from the formula, independent of the slicing implementation."""
    level = list(vectors)
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            a64, b64 = a.double(), b.double()
            dot, aa, bb = float((a64 * b64).sum()), float((a64 * a64).sum()), float((b64 * b64).sum())
            ca = 1.0 - dot / aa * 0.5 if aa >= math.sqrt(2.2250738585072014e-308) else 1.0
            cb = 1.0 - dot / bb * 0.5 if bb >= math.sqrt(2.2250738585072014e-308) else 1.0
            nxt.append((ca * a64 + cb * b64).to(a.dtype))
        level = nxt
    return level[0]


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(5, 7, generator=g) + rank,  # not orthogonal, not parallel
            torch.randn(3, generator=g, dtype=torch.float64),  # fewer elements than ranks
            torch.zeros(4) if rank == 0 else torch.randn(4, generator=g),  # a zero vector: Horovod's guard
            torch.randn(2, 3, generator=g).half()]


def _tree_forms():
    rank = hvd.rank()
    ts = _inputs(rank)
    out = {"inputs": [t.clone() for t in ts]}
    out["grouped"] = hvd.grouped_allreduce(ts, op=hvd.Adasum)
    out["single"] = [hvd.allreduce(t, op=hvd.Adasum, name=f"t{i}") for i, t in enumerate(ts)]
    out["async"] = hvd.synchronize(hvd.grouped_allreduce_async([t.clone() for t in ts], op=hvd.Adasum))
    inplace = [t.clone() for t in ts]
    hvd.grouped_allreduce_(inplace, op=hvd.Adasum)
    out["inplace"] = inplace
    scaled = hvd.allreduce(ts[0], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    out["scaled"] = scaled
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_adasum_is_horovods_pairwise_tree_with_the_same_bits_on_every_rank(ring4, world):
    results = ring4.run(_tree_forms, world_size=world, timeout_s=60)
    inputs = [r["inputs"] for r in results]
    for k in range(len(inputs[0])):
        expected = _reference([inputs[r][k] for r in range(world)])
        tol = {torch.float16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-12}[expected.dtype]
        for form in ("grouped", "single", "async", "inplace"):
            got = results[0][form][k]
            assert got.dtype == expected.dtype and got.shape == expected.shape, form
            assert torch.allclose(got, expected, rtol=tol, atol=tol), (form, k, got, expected)
            for r in range(1, world):
                assert torch.equal(results[r][form][k], got), f"rank {r} differs from rank 0 ({form}, tensor {k})"
    assert torch.allclose(results[0]["scaled"], results[0]["grouped"][0], rtol=1e-6)  # 0.5 * adasum(2x) = adasum(x)
    if world == 2:  # one pair: the formula itself; a zero vector leaves the other unchanged
        assert torch.equal(results[0]["grouped"][2], inputs[1][2])


# ------------------------------------------------------------------ refusals, and process sets
def _refusals():
    rank = hvd.rank()
    out = {}

    def attempt(label, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
            out[label] = (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))
        else:
            out[label] = None

    attempt("3 ranks", lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum))
    evens = hvd.add_process_set([0, 2])
    if rank in (0, 2):  # a set of two ranks is a power of two: Adasum runs on its sub-ring
        out["set"] = hvd.allreduce(torch.tensor([1.0, 0.0]) if rank == 0 else torch.tensor([0.0, 1.0]),
                                   op=hvd.Adasum, process_set=evens).tolist()
    attempt("integers", lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.Adasum,
                                              process_set=evens) if rank in (0, 2) else None)
    attempt("reducescatter", lambda: hvd.reducescatter(torch.ones(6), op=hvd.Adasum))
    attempt("sparse", lambda: hvd.allreduce(torch.ones(3).to_sparse(), op=hvd.Adasum))
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # the ring is still usable
    hvd.remove_process_set(evens)
    return out


def test_adasum_refuses_what_horovod_refuses_on_every_rank_and_runs_on_a_two_rank_set(ring):
    results = ring.run(_refusals, world_size=3, timeout_s=60)
    for rank, out in enumerate(results):
        name, is_runtime, text = out["3 ranks"]
        assert name == "NotImplementedError" and is_runtime and "power of 2" in text, out
        if rank in (0, 2):
            assert out["set"] == [1.0, 1.0]  # orthogonal: the sum
            assert out["integers"][0] == "ValueError" and "torch.int32" in out["integers"][2]
        assert out["reducescatter"][1] and "Adasum" in out["reducescatter"][2]  # Horovod's test: a RuntimeError
        assert out["sparse"] is not None and "Adasum" in out["sparse"][2]
        assert out["after"] == 3.0


def test_adasum_is_a_public_op_and_er_ops_are_unchanged():
    assert "Adasum" in hvd.__all__ and hvd.Adasum == "adasum"
    assert er.ReduceOp.parse("sum") is er.ReduceOp.SUM
