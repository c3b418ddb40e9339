"""``hvd.DistributedOptimizer(process_set=...)`` and ``hvd.DistributedOptimizer(op=hvd.Adasum)`` on real gloo
rings: gradients reduced within the set only (the rank outside steps alone), Horovod's Adasum delta optimizer."""

from __future__ import annotations

import pytest
import torch

import ray_integration.horovod as hvd


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Linear(3, 2)


def _batch(rank: int) -> torch.Tensor:
    return torch.full((4, 3), float(rank + 1)) + torch.arange(12.0).reshape(4, 3) / 10


def _local_grads(rank: int) -> list[torch.Tensor]:
    model = _model()
    model(_batch(rank)).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _process_set_optimizer(op_name: str):
    hvd.init()
    rank = hvd.rank()
    evens = hvd.add_process_set([0, 2])
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   op=getattr(hvd, op_name), process_set=evens)
    model(_batch(rank)).pow(2).sum().backward()
    if rank == 1:  # outside the set: no collective; it steps with its own gradients, whatever the others do
        opt.step()
    else:
        opt.synchronize()  # Horovod's clipping pattern
        with opt.skip_synchronize():
            opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()], "names": sorted(opt._parameter_names.values())}
    hvd.barrier()  # the whole ring still works
    hvd.remove_process_set(evens)
    return out


@pytest.mark.parametrize("op_name", ["Average", "Sum"])
def test_a_process_set_optimizer_reduces_within_the_set_and_the_rank_outside_steps_alone(ring, op_name):
    results = ring.run(_process_set_optimizer, op_name, world_size=3, timeout_s=60)
    grads = {r: _local_grads(r) for r in range(3)}
    start = list(_model().parameters())
    for rank, out in enumerate(results):
        if rank == 1:
            expected = [p.detach() - 0.1 * g for p, g in zip(start, grads[1])]
        else:
            reduced = [(a + b) / (2 if op_name == "Average" else 1) for a, b in zip(grads[0], grads[2])]
            expected = [p.detach() - 0.1 * g for p, g in zip(start, reduced)]
        for got, want in zip(out["params"], expected):
            assert torch.allclose(got, want, atol=1e-6), (rank, got, want)
        assert out["names"] == ["bias", "weight"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[2]["params"]))


def _adasum_optimizer():
    hvd.init()
    rank = hvd.rank()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   op=hvd.Adasum)
    model(_batch(rank)).pow(2).sum().backward()
    opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    # the same deltas through hvd.allreduce(op=Adasum): what the optimizer must have applied
    deltas = [-0.1 * g for g in _local_grads(rank)]
    out["expected"] = [s + hvd.allreduce(d, op=hvd.Adasum) for s, d in zip(start, deltas)]
    try:
        with opt.skip_synchronize():
            pass
    except AssertionError:
        out["skip"] = "AssertionError"
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 process_set=hvd.add_process_set([0]))
    except NotImplementedError as exc:
        out["set"] = str(exc)
    return out


def test_the_adasum_optimizer_applies_the_adasum_of_the_local_steps_deltas(ring):
    results = ring.run(_adasum_optimizer, world_size=2, timeout_s=60)
    for out in results:
        for got, want in zip(out["params"], out["expected"]):
            assert torch.allclose(got, want, atol=1e-6)
        assert out["skip"] == "AssertionError" and "process set" in out["set"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    start = list(_model().parameters())
    averaged = [p.detach() - 0.1 * (a + b) / 2 for p, a, b in zip(start, _local_grads(0), _local_grads(1))]
    assert not all(torch.allclose(a, b) for a, b in zip(results[0]["params"], averaged))  # not an average


def _adasum_optimizer_on_three():
    hvd.init()
    model = _model()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    except NotImplementedError as exc:
        return "power of 2" in str(exc)
    return "no error"


def test_the_adasum_optimizer_refuses_three_ranks_on_every_rank(ring):
    assert ring.run(_adasum_optimizer_on_three, world_size=3, timeout_s=60) == [True] * 3
