"""Horovod's semantics where its users rely on them (the causes of the failures of Horovod's own PyTorch test
suite against us): mismatch errors are RuntimeErrors, collectives are differentiable, every dtype moves,
integer averages, a fresh optimizer's state is broadcast, a double synchronize warns. Real gloo rings."""

import warnings

import pytest
import torch

import elastic_ring as er


def _mismatch_is_a_runtime_error():
    try:
        er.allreduce(torch.ones(2 + er.rank()), name="x")
    except RuntimeError as exc:  # what a Horovod script catches
        caught = type(exc).__name__
    else:
        caught = None
    er.barrier()
    return caught


def test_a_mismatch_is_caught_by_except_runtime_error_on_every_rank(ring):
    assert ring.run(_mismatch_is_a_runtime_error, world_size=2, timeout_s=30) == ["TensorMismatchError"] * 2


def _grads_through_collectives():
    rank, size = er.rank(), er.size()
    out = {}
    for op in ("sum", "average"):
        x = torch.full((3, 2), float(rank + 1), requires_grad=True)
        y = er.allreduce(x, op=op)
        y.backward(torch.full((3, 2), float(rank + 1)))  # each rank's own upstream gradient
        out[f"allreduce_{op}"] = (y.detach().tolist(), x.grad.tolist())
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    ya, yb = er.grouped_allreduce([a * 2, b], op="sum")
    (ya.sum() + yb.sum()).backward()
    out["grouped"] = (a.grad.tolist(), b.grad.tolist())
    x = torch.full((rank + 1, 2), float(rank), requires_grad=True)  # uneven first dimensions
    gathered = er.allgather(x)
    gathered.backward(torch.arange(gathered.numel(), dtype=torch.float32).view_as(gathered))
    out["allgather"] = (gathered.shape[0], x.grad.tolist())
    x = torch.full((2,), float(rank + 5), requires_grad=True)
    y = er.broadcast(x, root_rank=1)
    y.backward(torch.ones(2))
    out["broadcast"] = (y.detach().tolist(), x.grad.tolist())
    with torch.no_grad():  # outside autograd nothing changes
        out["no_grad"] = er.allreduce(torch.ones(2, requires_grad=True), op="sum").requires_grad
    return out


def test_collectives_are_differentiable_as_in_horovod_at_three_ranks(ring):
    results = ring.run(_grads_through_collectives, world_size=3, timeout_s=60)
    for rank, out in enumerate(results):
        assert out["allreduce_sum"] == ([[6.0] * 2] * 3, [[6.0] * 2] * 3)    # sum of 1,2,3 / of the upstreams
        assert out["allreduce_average"] == ([[2.0] * 2] * 3, [[2.0] * 2] * 3)
        assert out["grouped"] == ([6.0, 6.0], [3.0, 3.0, 3.0])
        rows, grad = out["allgather"]
        assert rows == 6
        offset = rank * (rank + 1) // 2  # rows of the ranks before this one: 0, 1, 3
        # every rank sent the same upstream (arange): its average is itself; this rank's slice (Horovod's gradient)
        expected = [[float(2 * (offset + i) + j) for j in range(2)] for i in range(rank + 1)]
        assert grad == expected
        assert out["broadcast"] == ([6.0, 6.0], [1.0, 1.0] if rank == 1 else [0.0, 0.0])
        assert out["no_grad"] is False


def _every_dtype_moves():
    rank, size = er.rank(), er.size()
    results = {}
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float16, torch.bfloat16,
                  torch.int8, torch.complex64):
        base = torch.arange(12).view(3, 4) % 2 if dtype == torch.bool else torch.arange(12).view(3, 4) + 10 * rank
        t = base.to(dtype)
        b = er.broadcast(t, root_rank=size - 1)
        strided = t.t().clone().t()  # non-contiguous, moved through a contiguous copy
        er.broadcast_(strided, root_rank=0)
        g = er.allgather(t[: rank + 1])
        results[str(dtype)] = (b.dtype == dtype and torch.equal(b, (torch.arange(12).view(3, 4) % 2 if dtype == torch.bool
                                                                  else torch.arange(12).view(3, 4) + 10 * (size - 1)).to(dtype)),
                               torch.equal(strided, (base if rank == 0 else (torch.arange(12).view(3, 4) % 2
                                                     if dtype == torch.bool else torch.arange(12).view(3, 4))).to(dtype)),
                               g.dtype == dtype and g.shape == (size * (size + 1) // 2, 4))
    for dtype in (torch.int16, torch.uint16, torch.uint32):
        t = torch.tensor([rank + 1, 7 * (rank + 1)], dtype=dtype)
        results[f"sum {dtype}"] = er.allreduce(t, op="sum").tolist()
        results[f"avg {dtype}"] = er.allreduce(t, op="average").tolist()
        results[f"max {dtype}"] = er.allreduce(t, op="max").tolist()
        inplace = t.clone()
        er.allreduce_(inplace, op="sum")
        results[f"inplace {dtype}"] = (inplace.dtype == dtype, inplace.tolist())
    results["int avg"] = er.allreduce(torch.tensor([rank + 1, 2 * rank]), op="average").tolist()
    signed = torch.tensor([[5, 1, -5, -1], [0, 0, 0, 0], [2, 1, -2, -1]][rank])  # sums 7, 2, -7, -2
    for dtype in (torch.int16, torch.int32, torch.int64):  # int16 is reduced in a wider dtype
        results[f"signed avg {dtype}"] = er.allreduce(signed.to(dtype), op="average").tolist()
    try:
        er.allreduce(torch.ones(2, dtype=torch.complex64))
    except ValueError as exc:
        results["complex"] = "cannot allreduce" in str(exc)
    er.barrier()  # a local input error left the ring as it was
    return results


def test_every_dtype_moves_and_integer_averages_truncate_toward_zero_as_in_horovod(ring):
    for results in ring.run(_every_dtype_moves, world_size=3, timeout_s=60):
        for key, value in results.items():
            if isinstance(value, tuple) and len(value) == 3:
                assert value == (True, True, True), key
        for dtype in ("torch.int16", "torch.uint16", "torch.uint32"):
            assert results[f"sum {dtype}"] == [6, 42]
            assert results[f"avg {dtype}"] == [2, 14]
            assert results[f"max {dtype}"] == [3, 21]
            assert results[f"inplace {dtype}"] == (True, [6, 42])
        assert results["int avg"] == [2, 2]   # [1+2+3, 0+2+4] / 3
        for dtype in ("torch.int16", "torch.int32", "torch.int64"):  # truncated toward zero (floor: -3, -1)
            assert results[f"signed avg {dtype}"] == [2, 0, -2, 0], dtype
        assert results["complex"] is True


def _fresh_optimizer_state():
    torch.manual_seed(er.rank())
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    er.broadcast_optimizer_state(opt, root_rank=0)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    buffers = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    wrapped = er.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model.named_parameters())
    er.broadcast_optimizer_state(wrapped, root_rank=0)
    adam = [sorted(wrapped.state[p]) for p in model.parameters()]
    return unchanged, [b is not None and b.shape == p.shape for b, p in zip(buffers, model.parameters())], adam, \
        wrapped.applied_steps, [p.grad for p in model.parameters()]


def test_broadcast_optimizer_state_of_a_fresh_optimizer_gives_it_state_and_changes_no_weight(ring):
    for unchanged, buffers, adam, applied, grads in ring.run(_fresh_optimizer_state, world_size=2, timeout_s=60):
        assert unchanged and buffers == [True, True]
        assert adam == [["exp_avg", "exp_avg_sq", "step"]] * 2
        assert applied == 0 and all(g is not None and not g.any() for g in grads)  # no counted step; zeros (Horovod)


def _double_synchronize():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), op=er.Sum)
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()  # gradient 1 per weight on every rank
    opt.synchronize()
    reduced = model.weight.grad.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    return reduced.tolist(), [str(w.message) for w in caught], len(quiet), opt.applied_steps


def test_step_after_synchronize_warns_as_horovod_and_does_not_reduce_twice(ring):
    for reduced, caught, quiet, applied in ring.run(_double_synchronize, world_size=2, timeout_s=60):
        assert reduced == [[2.0, 2.0]]  # summed once (twice would be 4)
        assert len(caught) == 1 and "skip_synchronize" in caught[0], caught
        assert quiet == 0 and applied == 2


def _scatter_and_alltoall():
    rank, size = er.rank(), er.size()
    out = {}
    t = torch.arange(7, dtype=torch.float32).repeat(2, 1).t().contiguous() * (rank + 1)  # 7 rows x 2
    out["rs_sum"] = er.reducescatter(t, op=er.Sum).tolist()
    out["rs_avg"] = er.reducescatter(t).tolist()
    x = torch.ones(5, 3, requires_grad=True)
    er.reducescatter(x, op=er.Sum).sum().backward()
    out["rs_grad"] = x.grad.tolist()
    # rank r sends j + 1 rows to rank j, each row holding 10 * r + j
    splits = [j + 1 for j in range(size)]
    rows = torch.cat([torch.full((j + 1, 2), float(10 * rank + j)) for j in range(size)])
    received, counts = er.alltoall(rows, splits=splits)
    out["a2a"] = (received[:, 0].tolist(), counts.tolist())
    out["a2a_equal"] = er.alltoall(torch.arange(size * 2).view(size * 2, 1) + 100 * rank).view(-1).tolist()
    y = torch.ones(sum(splits), 2, requires_grad=True)
    got, _ = er.alltoall(y * (rank + 1), splits=splits)
    got.sum().backward()
    out["a2a_grad"] = y.grad[:, 0].tolist()
    handle = er.allreduce_async(torch.tensor([float(rank)]), op=er.Sum)
    out["poll"] = isinstance(er.poll(handle), bool)
    out["async"] = er.synchronize(handle).item()
    # in flight while other collectives run: its buffers are its own, never the ring's pooled ones
    a = [torch.full((1000,), float(rank + 1)), torch.full((10,), 2.0)]
    pending = er.grouped_allreduce_async_(a, op=er.Sum)
    b = [torch.full((1000,), 5.0), torch.full((10,), 7.0)]
    er.grouped_allreduce_(b, op=er.Sum)  # the same sizes, in place: the pooled path
    import time
    deadline = time.monotonic() + 30
    while not er.poll(pending) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["pending_done"] = er.poll(pending)
    result = er.synchronize(pending)
    out["pending"] = (result[0] is a[0], a[0][:2].tolist(), a[1][:2].tolist(), b[0][:1].tolist())
    bad = er.allreduce_async(torch.ones(2 + rank), name="uneven")
    try:
        er.synchronize(bad)
    except er.TensorMismatchError:
        out["async_error"] = True
    try:
        er.synchronize(handle)
    except ValueError as exc:
        out["twice"] = "already synchronized" in str(exc)
    try:
        er.alltoall(torch.ones(size + 1, 1))
    except ValueError as exc:
        out["a2a_bad"] = "pass splits=" in str(exc)
    er.barrier()
    return out


def test_reducescatter_alltoall_and_async_handles_as_in_horovod(ring):
    results = ring.run(_scatter_and_alltoall, world_size=3, timeout_s=60)
    blocks = [(0, 3), (3, 2), (5, 2)]  # 7 rows over 3 ranks: 3, 2, 2 (Horovod's split)
    for rank, out in enumerate(results):
        offset, rows = blocks[rank]
        assert out["rs_sum"] == [[6.0 * i] * 2 for i in range(offset, offset + rows)]
        assert out["rs_avg"] == [[2.0 * i] * 2 for i in range(offset, offset + rows)]
        assert out["rs_grad"] == [[3.0] * 3] * 5   # Horovod's: the allgather of the ones-blocks, times 3 for a sum
        values, counts = out["a2a"]
        assert counts == [rank + 1] * 3 and values == [float(10 * r + rank) for r in range(3) for _ in range(rank + 1)]
        assert out["a2a_equal"] == [2 * rank + 100 * r + k for r in range(3) for k in range(2)]
        # a row sent to rank j comes back weighted by the multiplier of... this rank itself (it sent y * (rank+1))
        assert out["a2a_grad"] == [float(rank + 1)] * 6
        assert out["poll"] is True and out["async"] == 3.0
        assert out["pending_done"] is True and out["pending"] == (True, [6.0, 6.0], [6.0, 6.0], [15.0])
        assert out["async_error"] is True and out["twice"] is True and out["a2a_bad"] is True


def _sync_batch_norm(sizes):
    rank = er.rank()
    g = torch.Generator().manual_seed(7)
    full = torch.randn(sum(sizes), 3, 4, generator=g) * 3 + 1
    start = sum(sizes[:rank])
    x = full[start:start + sizes[rank]].clone().requires_grad_(True)
    torch.manual_seed(0)
    bn = er.SyncBatchNorm(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    upstream = torch.randn(sum(sizes), 3, 4, generator=g)[start:start + sizes[rank]]
    y = bn(x)
    (y * upstream).sum().backward()
    weight_grad = er.allreduce(bn.weight.grad, op=er.Sum)  # the ranks' shares of the whole batch's gradient
    return (y.detach(), x.grad, weight_grad, bn.running_mean.clone(), bn.running_var.clone(), full, upstream)


def test_sync_batch_norm_equals_batch_norm_over_the_whole_rings_batch(ring):
    sizes = [3, 5, 0]  # uneven, one rank empty
    results = ring.run(_sync_batch_norm, sizes, world_size=3, timeout_s=60)
    full = results[0][5]
    x = full.clone().requires_grad_(True)
    bn = torch.nn.BatchNorm1d(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.bias.copy_(torch.tensor([0.0, -1.0, 3.0]))
    upstream = torch.cat([r[6] for r in results])
    y = bn(x)
    (y * upstream).sum().backward()
    starts = [0, 3, 8]
    for rank, (out, xgrad, wgrad, rmean, rvar, _, _) in enumerate(results):
        part = slice(starts[rank], starts[rank] + sizes[rank])
        assert torch.allclose(out, y.detach()[part], atol=1e-5)
        assert torch.allclose(xgrad, x.grad[part], atol=1e-5)
        assert torch.allclose(wgrad, bn.weight.grad, atol=1e-4)
        assert torch.allclose(rmean, bn.running_mean, atol=1e-6) and torch.allclose(rvar, bn.running_var, atol=1e-5)


def test_convert_sync_batchnorm_keeps_parameters_and_outside_a_ring_is_batch_norm():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
    weight = model[1].weight
    converted = er.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], er.SyncBatchNorm) and isinstance(converted[2][0], er.SyncBatchNorm)
    assert converted[1].weight is weight
    x = torch.randn(4, 1, 3, 3)
    assert torch.allclose(converted[1](x.repeat(1, 2, 1, 1)),
                          torch.nn.functional.batch_norm(x.repeat(1, 2, 1, 1), None, None, weight, model[1].bias,
                                                         training=True), atol=1e-6)
