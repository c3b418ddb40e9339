"""``hvd.join()``: Horovod's join tests (test/parallel/test_torch.py: test_horovod_join_allreduce, _allgather,
_broadcast) through the hvd module, on real gloo rings: as in Horovod, every hvd allgather and broadcast raises
on its callers while a rank has joined (elastic_ring's own ``er.allgather`` / ``er.broadcast``, which answer a
joined rank, are checked on the same rings); and uneven batches through
``hvd.DistributedOptimizer`` (which leads every step with its check by default, ``strict_checks=True``)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import elastic_ring as er
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


def _refused(call) -> str | None:
    """What ``call()`` raised (Horovod's test catches RuntimeError), or None when it ran."""
    try:
        call()
    except RuntimeError as exc:
        return "cannot run while a rank has joined" in str(exc) and type(exc).__name__
    return None


def _join_allgather():
    """Horovod's test_horovod_join_allgather, with the other forms of the call and elastic_ring's own after."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.FloatTensor(*([17] * 3))
    caught, returns = [], []
    for first in range(size):
        if rank == first:
            ret = hvd.join()
        else:
            caught.append([
                _refused(lambda: hvd.allgather(tensor)),
                _refused(lambda: hvd.synchronize(hvd.allgather_async(tensor, name="joined.async"))),
                _refused(lambda: hvd.grouped_allgather([tensor, tensor])),
                _refused(lambda: hvd.allgather_object({"rank": rank})),
            ])
            ret = hvd.join()
        returns.append((first, ret))
    # elastic_ring's own allgather, on the same ring: no rows from a joined rank (the hvd scope did not leak)
    if rank == 0:
        er_rows = hvd.join()
    else:
        er_rows = er.allgather(torch.full((2, 1), float(rank)), name="er.rows").view(-1).tolist()
        hvd.join()
    return caught, returns, hvd.allgather_object(returns), er_rows


def test_horovod_join_allgather_raises_on_the_callers_while_the_joined_rank_waits(ring):
    """Horovod's test: with a rank joined, hvd.allgather (and its forms) raise RuntimeError on the ranks that call
    it; they then join, and join() returns the same rank everywhere, never the first joiner."""
    results = ring.run(_join_allgather, world_size=3, timeout_s=90)
    for rank, (caught, returns, every, er_rows) in enumerate(results):
        assert caught == [["TensorMismatchError"] * 4] * 2
        assert every == [returns] * 3 and all(ret != first for first, ret in returns)
        if rank:
            assert er_rows == [1.0, 1.0, 2.0, 2.0]


def _join_broadcast():
    """Horovod's test_horovod_join_broadcast on three ranks, where the callers must agree on a root (Horovod's
    own case, each caller broadcasting from itself, is the two-rank test below): from the joined rank, from a
    rank that has not joined, the other forms, and elastic_ring's own broadcast after."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.FloatTensor(*([17] * 3)).fill_(float(rank))
    caught, returns = [], []
    for first in range(size):
        if rank == first:
            ret = hvd.join(hvd.local_rank())
        else:
            root = (first + 1) % size  # has not joined
            caught.append([
                _refused(lambda: hvd.broadcast(tensor, first, name="test_horovod_join_broadcast")),
                _refused(lambda: hvd.broadcast(tensor, root)),
                _refused(lambda: hvd.broadcast_(tensor.clone(), root)),
                _refused(lambda: hvd.synchronize(hvd.broadcast_async(tensor, root, name="joined.async"))),
                _refused(lambda: hvd.broadcast_object({"rank": rank}, root)),
                _refused(lambda: hvd.broadcast_parameters({"w": tensor.clone()}, root)),
            ])
            ret = hvd.join()
        returns.append(ret)
    # elastic_ring's own broadcast from a root that has not joined still runs with rank 0 joined
    if rank == 0:
        er_value = hvd.join()
    else:
        er_value = float(er.broadcast(torch.tensor([float(rank)]), 1, name="er.broadcast"))
        hvd.join()
    return caught, returns, hvd.allgather_object(returns), er_value


def test_horovod_join_broadcast_raises_on_the_callers_while_the_joined_rank_waits(ring):
    results = ring.run(_join_broadcast, world_size=3, timeout_s=90)
    for rank, (caught, returns, every, er_value) in enumerate(results):
        assert caught == [["TensorMismatchError"] * 6] * 2
        assert every == [returns] * 3 and all(ret != first for first, ret in enumerate(returns))
        if rank:
            assert er_value == 1.0


def _horovod_join_broadcast_two_ranks():
    """Horovod's case exactly, on two ranks: the only caller broadcasts from itself (it has not joined)."""
    hvd.init()
    rank = hvd.rank()
    out = []
    for first in range(2):
        if rank == first:
            ret = hvd.join()
        else:
            out.append(_refused(lambda: hvd.broadcast(torch.ones(17, 17, 17), rank, name="join_broadcast")))
            ret = hvd.join()
        out.append(ret)
    return out


def test_horovod_join_broadcast_from_the_only_caller_itself_raises(ring):
    assert ring.run(_horovod_join_broadcast_two_ranks, world_size=2, timeout_s=60) == [
        [1, "TensorMismatchError", 0], ["TensorMismatchError", 1, 0]]


def _lean_optimizer_then_join():
    hvd.init()
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), strict_checks=False)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    started = time.monotonic()
    try:
        hvd.join()
    except RuntimeError as exc:
        return "without strict_checks=False" in str(exc), time.monotonic() - started
    return False, time.monotonic() - started


def test_join_after_an_opted_out_lean_optimizer_steps_raises_at_once(ring):
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


def _uneven_batches_strict_optimizer(strict: bool | None):
    hvd.init()
    rank = hvd.rank()
    model, sgd = _model_and_sgd()
    options = {} if strict is None else {"strict_checks": strict}  # None: Horovod's script, unchanged
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **options)
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


@pytest.mark.parametrize("strict", [None, True], ids=["default", "strict_checks=True"])
def test_uneven_batches_through_the_hvd_optimizer_and_join_end_equal_on_every_rank(ring, strict):
    """Horovod's usual pattern (uneven data, the default DistributedOptimizer, hvd.join()) runs unchanged."""
    results = ring.run(_uneven_batches_strict_optimizer, strict, world_size=3, timeout_s=90)
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


def _join_with_a_timeout():
    hvd.init()
    try:
        hvd.join(timeout_s=-1)
    except ValueError as exc:
        refused = "timeout_s=-1" in str(exc)
    else:
        refused = False
    if hvd.rank() == 0:
        return refused, hvd.join(timeout_s=30)
    time.sleep(2.5)  # longer than collective_timeout_s: the joined rank waits on its own deadline
    return refused, hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), hvd.join()


def test_hvd_join_takes_its_own_timeout(ring):
    assert ring.run(_join_with_a_timeout, world_size=2, timeout_s=60, collective_timeout_s=1.5) == [
        (True, 1), (True, 1.0, 1)]
