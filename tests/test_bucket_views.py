"""Gradients as views into the fusion buckets, over real processes: exact results with both
zero_grad modes, parameters without gradients, fp16, re-formed rings, and failures."""

import dataclasses
import os
import signal

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from tests import process_ring

IN, HIDDEN, OUT, PER_RANK = 12, 32, 4, 6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def batch(step, rank, n=PER_RANK):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def reference(world, steps, skip=lambda step, rank: False):
    """One process: the average over ranks of each rank's gradient (a rank that skips a step contributes zeros)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            if not skip(step, r):
                x, y = batch(step, r)
                (torch.nn.functional.mse_loss(model(x), y) / world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def in_a_bucket(opt, p):
    """Whether ``p.grad`` is a view into one of the optimizer's bucket buffers."""
    layout = opt._er_reducer._layout
    if layout is None or p.grad is None:
        return False
    return any(buf.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr() for buf in layout.buffers)


def _train_with_views(set_to_none, bucket_bytes, batch_below_bytes):
    from elastic_ring.core import constants

    saved, constants.GRAD_BATCH_BELOW_BYTES = constants.GRAD_BATCH_BELOW_BYTES, batch_below_bytes
    try:
        return _train_views(set_to_none, bucket_bytes)
    finally:
        constants.GRAD_BATCH_BELOW_BYTES = saved


def _train_views(set_to_none, bucket_bytes):
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(),
                                  fusion_threshold_bytes=bucket_bytes, first_bucket_bytes=256)
    views, storages = [], set()
    for step in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        x, y = batch(step, er.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        views.append(all(in_a_bucket(opt, p) for p in model.parameters()))
        storages.add(tuple(b.data_ptr() for b in opt._er_reducer._layout.buffers))
    params = [p.detach().clone() for p in model.parameters()]
    return views, len(storages), len(opt.fusion_buckets), params, opt.applied_steps


@pytest.mark.parametrize("batch_below_bytes", [0, 1 << 20], ids=["each-in-its-hook", "batched-per-bucket"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_bucket_views_and_results_are_exact(ring, set_to_none, batch_below_bytes):
    results = ring.run(_train_with_views, set_to_none, 2048, batch_below_bytes, world_size=3)
    expected = reference(3, 4)
    for views, storages, buckets, params, applied in results:
        assert views == [True] * 4, "after every step each .grad is a view into a bucket"
        assert storages == 1, "the same bucket buffers serve every step of a ring"
        assert buckets > 2 and applied == 4
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][3]))


def _skip_some_steps():
    """Rank 1 computes no gradient at all on step 1; every rank skips the last layer's bias
    (it does not reach the loss)."""
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(),
                                  fusion_threshold_bytes=1024)
    for step in range(3):
        opt.zero_grad(set_to_none=step % 2 == 0)
        if not (step == 1 and er.rank() == 1):
            x, y = batch(step, er.rank())
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], [in_a_bucket(opt, p) for p in model.parameters()]


def test_parameters_without_gradients_contribute_zeros(ring):
    results = ring.run(_skip_some_steps, world_size=2)
    expected = reference(2, 3, skip=lambda step, rank: step == 1 and rank == 1)
    for params, views in results:
        assert all(views)
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


def _fp16_views_and_overflow():
    """Gradients near 1e5 on one rank, small on the others: their average is representable in
    float16 although a value is not; mixed float32 / float64 parameters keep their dtypes."""
    n, r = er.size(), er.rank()
    w32 = torch.nn.Parameter(torch.zeros(8))
    w64 = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = er.DistributedOptimizer(torch.optim.SGD([w32, w64], lr=1.0), [("w32", w32), ("w64", w64)],
                                  compression=er.Compression.fp16, fusion_threshold_bytes=1 << 20)
    coef = torch.where(torch.arange(8) % n == r, torch.tensor(1e5), torch.tensor(100.0))
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        ((w32 * coef).sum() + (w64 * (r + 1)).sum()).backward()
        opt.synchronize()
        grads = w32.grad.clone(), w64.grad.clone()
        with opt.skip_synchronize():
            opt.step()
    return grads, [b.source_dtype for b in opt.fusion_buckets], in_a_bucket(opt, w32) and in_a_bucket(opt, w64)


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_compression_with_views_averages_large_values_without_overflow(ring, world):
    for (g32, g64), dtypes, views in ring.run(_fp16_views_and_overflow, world_size=world):
        expected = torch.full((8,), (1e5 + 100.0 * (world - 1)) / world)
        assert torch.isfinite(g32).all() and g32.dtype == torch.float32
        torch.testing.assert_close(g32, expected, rtol=2e-3, atol=0)
        assert g64.dtype == torch.float64
        torch.testing.assert_close(g64, torch.full((3,), (world + 1) / 2, dtype=torch.float64), rtol=2e-3, atol=0)
        assert sorted(map(str, dtypes)) == ["torch.float32", "torch.float64"] and views


_KEPT: dict = {}  # survives from one task to the next in the same worker process


def _first_ring_then_keep():
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  fusion_threshold_bytes=2048)
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        x, y = batch(step, er.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    _KEPT.update(model=model, opt=opt, buffers=list(opt._er_reducer._layout.buffers))
    return opt.applied_steps


def _continue_on_the_next_ring():
    model, opt, old = _KEPT["model"], _KEPT["opt"], _KEPT.pop("buffers")
    for step in range(2, 4):
        opt.zero_grad(set_to_none=False)  # the grads are still views of the old ring's buckets here
        x, y = batch(step, er.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    new = opt._er_reducer._layout.buffers
    rebuilt = all(n is not o and n.data_ptr() != o.data_ptr() for n, o in zip(new, old))
    views = all(in_a_bucket(opt, p) for p in model.parameters())
    params = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return rebuilt, views, opt.applied_steps, er.allgather_object(params)


def test_a_new_ring_rebuilds_the_buckets(ring):
    assert ring.run(_first_ring_then_keep, world_size=3) == [2, 2, 2]
    for rebuilt, views, applied, everyone in ring.run(_continue_on_the_next_ring, world_size=2):
        assert rebuilt and views and applied == 4
        assert torch.equal(everyone[0], everyone[1])


def _auth() -> dict:
    """The test rings' secret, where RingSpec has an auth_key (it is the same on every rank)."""
    if "auth_key" in {f.name for f in dataclasses.fields(er.RingSpec)}:
        return {"auth_key": process_ring.TEST_SECRET}
    return {}


def _fail_in_the_middle_of_a_reduction(store_host, store_port, victim):
    """The victim dies after its forward pass of step 2; the survivors fail inside the reduction."""
    store = dist.TCPStore(store_host, store_port, is_master=False, wait_for_workers=False)
    next_round = er.round_id() + 1
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  fusion_threshold_bytes=1024)
    caught = None
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        x, y = batch(step, er.rank())
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 2:
            snapshot = [p.detach().clone() for p in model.parameters()]
            store.add("at_step_2", 1)
            if er.rank() == victim:
                store.wait(["survivors_ready"])
                os.kill(os.getpid(), signal.SIGKILL)
            store.set("survivors_ready", "1")
        try:
            loss.backward()
            opt.step()
        except er.CommError as exc:
            caught = exc
            break
    assert caught is not None, "the survivors must see the failure"
    tagged = getattr(caught, "live_state_consistent", False)
    grads_none = all(p.grad is None for p in model.parameters())
    unchanged = all(torch.equal(p, s) for p, s in zip(model.parameters(), snapshot))
    applied = opt.applied_steps
    # retry on the survivors' ring: the buckets are re-established and the results agree
    old_rank = er.rank()
    er.init(er.RingSpec(round_id=next_round, rank=old_rank, world_size=2, node_ids=("n", "n"),
                        store=er.StoreAddress(store_host, store_port), **_auth()))
    for step in range(2, 4):
        opt.zero_grad(set_to_none=False)
        x, y = batch(step, er.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return tagged, grads_none, unchanged, applied, all(in_a_bucket(opt, p) for p in model.parameters()), er.allgather_object(params)


def test_comm_error_in_the_reduction_is_tagged_and_leaves_clean_state(ring):
    pending = ring.start(_fail_in_the_middle_of_a_reduction, "127.0.0.1", ring.address.port, 2)
    ring.next_round()  # the survivors' round
    results = pending.results(timeout_s=60, raise_errors=False)
    for key in ("at_step_2", "survivors_ready"):
        ring.store.delete_key(key)
    for tagged, grads_none, unchanged, applied, views, everyone in results[:2]:
        assert tagged, "a CommError raised before the update must say the live state is consistent"
        assert grads_none, "every .grad is None after the failure, so a retry does not add to a partial gradient"
        assert unchanged and applied == 2, "nothing was applied on the failed step"
        assert views and torch.equal(everyone[0], everyone[1])
