"""``hvd.join()``: Horovod's join tests (test/parallel/test_torch.py: test_horovod_join_allreduce, _allgather,
_broadcast) through the hvd module, on real gloo rings, and where our semantics differ from Horovod's (an
allgather with a joined rank gathers no rows from it instead of failing; a broadcast fails only when its root
joined), that difference; and uneven batches through ``hvd.DistributedOptimizer(strict_checks=True)``."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import ray_integration.horovod as hvd

_INTEGRAL = (torch.int32, torch.int64)


def _div(t: torch.Tensor, s: int) -> torch.Tensor:
    """Horovod's test's division: an integer average truncates toward zero."""
    return t.div(s, rounding_mode="trunc") if t.dtype in _INTEGRAL else t / s


def _join_allreduce():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    bad, returns = [], []
    for dtype, dim, first, caching in itertools.product((torch.int32, torch.int64, torch.float32, torch.float64),
                                                        (1, 2, 3), range(size), (False, True)):
        torch.manual_seed(1234)
        a = torch.FloatTensor(*([5] * dim)).random_(-100, 100).to(dtype)
        b = torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)
        if caching:
            hvd.synchronize(hvd.allreduce_async(a, name="tensor_a", average=True))
            hvd.synchronize(hvd.allreduce_async(b, name="tensor_b", average=True))
        if rank == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name="tensor_a", average=True)
            hb = hvd.allreduce_async(b, name="tensor_b", average=True)
            averaged_a, averaged_b = hvd.synchronize(ha), hvd.synchronize(hb)
            ret = hvd.join()
            if not (torch.allclose(averaged_a, _div(a * (size - 1), size))
                    and torch.allclose(averaged_b, _div(b * (size - 1), size))):
                bad.append((str(dtype), dim, first, caching))
        returns.append((first, ret))
    return bad, returns, hvd.allgather_object(returns)


def test_horovod_join_allreduce(ring):
    for bad, returns, every in ring.run(_join_allreduce, world_size=3, timeout_s=120):
        assert bad == []
        assert all(ret != first for first, ret in returns)  # Horovod's assertNotEqual(ret, first_join_rank)
        assert every == [returns] * 3  # the same value on each rank


def _join_allgather():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = []
    for first in range(size):
        if rank == first:
            ret = hvd.join()
        else:
            gathered = hvd.allgather(torch.full((2, 17), float(rank)))
            out.append(gathered[:, 0].tolist())
            ret = hvd.join()
        out.append(ret)
    return out


def test_horovod_join_allgather_gathers_no_rows_from_a_joined_rank(ring):
    """Horovod fails this allgather ("Allgather is not supported with Join at this time"); here the joined rank
    contributes no rows."""
    results = ring.run(_join_allgather, world_size=2, timeout_s=60)
    assert results == [[1, [0.0, 0.0], 0], [[1.0, 1.0], 1, 0]]


def _join_broadcast():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    caught, returns = [], []
    for first in range(size):
        if rank == first:
            ret = hvd.join(hvd.local_rank())
        else:
            try:
                hvd.broadcast(torch.ones(17, 17, 17), first, name="test_horovod_join_broadcast")
                caught.append(None)
            except RuntimeError as exc:  # Horovod's test catches (torch.FatalError, RuntimeError)
                caught.append("root, rank" in str(exc))
            ret = hvd.join()
        returns.append(ret)
    return caught, returns, hvd.allgather_object(returns)


def test_horovod_join_broadcast_from_a_joined_root_fails(ring):
    results = ring.run(_join_broadcast, world_size=3, timeout_s=60)
    for caught, returns, every in results:
        assert caught == [True, True]
        assert every == [returns] * 3 and all(ret != first for first, ret in enumerate(returns))


def _lean_optimizer_then_join():
    hvd.init()
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    started = time.monotonic()
    try:
        hvd.join()
    except RuntimeError as exc:
        return "hvd.DistributedOptimizer(..., strict_checks=True)" in str(exc), time.monotonic() - started
    return False, time.monotonic() - started


def test_join_after_lean_optimizer_steps_raises_at_once(ring):
    for named, seconds in ring.run(_lean_optimizer_then_join, world_size=2, timeout_s=30):
        assert named and seconds < 1.0


_STEPS = (3, 5, 2)  # batches per rank: rank 1 joins last


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _model_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _uneven_batches_strict_optimizer():
    hvd.init()
    rank = hvd.rank()
    model, sgd = _model_and_sgd()
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), strict_checks=True)
    for k in range(_STEPS[rank]):
        x, y = _batch(rank, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    stepped = [p.detach().clone() for p in model.parameters()]
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return last, stepped, [p.detach().clone() for p in model.parameters()]


def _reference(size: int) -> list[torch.Tensor]:
    """The same steps in one process: at step k, the gradients of the ranks that still have a batch, summed and
    divided by the full size (a joined rank's zeros count, as in Horovod)."""
    model, opt = _model_and_sgd()
    for k in range(max(_STEPS)):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(size):
            if k < _STEPS[rank]:
                model.zero_grad()
                x, y = _batch(rank, k)
                torch.nn.functional.mse_loss(model(x), y).backward()
                for g, p in zip(grads, model.parameters()):
                    g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / size
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_uneven_batches_through_a_strict_hvd_optimizer_and_join_end_equal_on_every_rank(ring):
    results = ring.run(_uneven_batches_strict_optimizer, world_size=3, timeout_s=90)
    want = _reference(3)
    assert [last for last, _, _ in results] == [1, 1, 1]
    stepped_last = results[1][1]  # the rank that stepped every batch, before the broadcast
    for got, expected in zip(stepped_last, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(results[2][1], stepped_last))  # rank 2 stopped early
    for _, _, final in results:
        assert all(torch.equal(a, b) for a, b in zip(final, stepped_last))


def test_strict_checks_must_be_true_or_false():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="strict_checks='yes' must be True or False"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strict_checks="yes")
