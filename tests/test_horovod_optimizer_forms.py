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


# ------------------------------------------------------------------ Adasum: unused parameters, failures, options
def _two_layers() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})


def _adasum_leaves_unused_parameters_alone():
    hvd.init()
    model = _two_layers()
    before = [p.detach().clone() for p in model["unused"].parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
                                   model.named_parameters(), op=hvd.Adasum)
    for _ in range(2):
        opt.zero_grad()
        model["used"](_batch(hvd.rank())).pow(2).sum().backward()
        opt.step()
    return ([torch.equal(a, b) for a, b in zip(before, model["unused"].parameters())],
            [p in opt.state and "momentum_buffer" in opt.state[p] for p in model["unused"].parameters()])


def test_the_adasum_optimizer_does_not_move_parameters_without_a_gradient(ring):
    for unchanged, has_state in ring.run(_adasum_leaves_unused_parameters_alone, world_size=2, timeout_s=60):
        assert unchanged == [True, True] and has_state == [False, False]


def _adasum_refused_before_the_local_step():
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2 + hvd.rank())  # the ranks disagree on the parameters' shapes
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), op=hvd.Adasum)
    before = [p.detach().clone() for p in model.parameters()]
    model(_batch(hvd.rank())).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        error = type(exc).__name__
    else:
        error = None
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # the ring is still usable
    return error, all(torch.equal(a, b) for a, b in zip(before, model.parameters())), len(opt.state), after


def test_a_mismatched_adasum_step_raises_on_every_rank_before_any_parameter_moves(ring):
    for error, unchanged, states, after in ring.run(_adasum_refused_before_the_local_step, world_size=2,
                                                    timeout_s=60):
        assert error == "TensorMismatchError" and unchanged and states == 0 and after == 2.0


def _adasum_restores_after_a_failed_collective():
    import os

    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model.named_parameters(),
                                   op=hvd.Adasum)
    model(_batch(hvd.rank())).pow(2).sum().backward()
    opt.step()  # a good step: Adam has state now
    saved = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items() if k == "exp_avg"}
    opt.zero_grad()
    model(_batch(hvd.rank())).pow(2).sum().backward()
    if hvd.rank() == 1:
        opt._apply_adasum = lambda *args: os._exit(1)  # dies after its local step, before the Adasum exchange
    try:
        opt.step()
    except hvd.HorovodInternalError:
        pass
    steps = [opt.state[p]["step"].item() for p in model.parameters()]
    return (all(torch.equal(a, b) for a, b in zip(saved, model.parameters())),
            all(torch.equal(state["exp_avg"], opt.state[p]["exp_avg"]) for p in [list(model.parameters())[-1]]),
            steps)


def test_a_failed_adasum_step_puts_the_parameters_and_the_optimizer_state_back(ring):
    results = ring.start(_adasum_restores_after_a_failed_collective, world_size=2).results(timeout_s=60,
                                                                                         raise_errors=False)
    unchanged, state_kept, steps = results[0]
    assert unchanged and state_kept and steps == [1.0, 1.0], results[0]


def _adasum_compresses_the_deltas():
    hvd.init()
    rank = hvd.rank()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   op=hvd.Adasum, compression=hvd.Compression.fp16)
    model(_batch(rank)).pow(2).sum().backward()
    opt.step()
    deltas = [-0.1 * g for g in _local_grads(rank)]
    compressed = [s + hvd.allreduce(d.half(), op=hvd.Adasum).float() for s, d in zip(start, deltas)]
    plain = [s + hvd.allreduce(d, op=hvd.Adasum) for s, d in zip(start, deltas)]
    got = [p.detach() for p in model.parameters()]
    return ([torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(got, compressed)],
            [torch.equal(a, b) for a, b in zip(got, plain)])


def test_the_adasum_optimizer_compresses_its_deltas_as_horovod(ring):
    for as_compressed, as_plain in ring.run(_adasum_compresses_the_deltas, world_size=2, timeout_s=60):
        assert as_compressed == [True, True] and not all(as_plain)


def _too_many_backward_passes(form: str):
    hvd.init()
    model = _model()
    options = {"op": hvd.Adasum} if form == "adasum" else {"process_set": hvd.add_process_set([0, 1])}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   backward_passes_per_step=2, **options)
    out = []
    for passes in (2, 3):
        opt.zero_grad()
        try:
            for _ in range(passes):
                model(_batch(hvd.rank())).pow(2).sum().backward()
        except AssertionError as exc:
            out.append("backward_passes_per_step=2" in str(exc))
            continue
        opt.step()
        out.append("stepped")
    return out


@pytest.mark.parametrize("form, world", [("adasum", 2), ("process_set", 3)])
def test_more_backward_passes_than_backward_passes_per_step_raise_as_horovod(ring, form, world):
    """The process set [0, 1] of three ranks: rank 2, outside it, steps alone and counts its passes too."""
    assert ring.run(_too_many_backward_passes, form, world_size=world, timeout_s=60) == [["stepped", True]] * world


def _step_after_synchronize_sums_once():
    import warnings

    hvd.init()
    rank = hvd.rank()
    evens = hvd.add_process_set([0, 2])
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   op=hvd.Sum, process_set=evens)
    model(_batch(rank)).pow(2).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.synchronize()
        opt.step()  # without skip_synchronize(): warns, applies what synchronize() reduced
    hvd.remove_process_set(evens)
    return [p.detach().clone() for p in model.parameters()], any("skip_synchronize" in str(w.message) for w in caught)


def test_step_after_synchronize_without_skip_warns_and_does_not_reduce_again(ring):
    results = ring.run(_step_after_synchronize_sums_once, world_size=3, timeout_s=60)
    start = list(_model().parameters())
    reduced = [a + b for a, b in zip(_local_grads(0), _local_grads(2))]
    for rank in (0, 2):
        params, warned = results[rank]
        assert warned
        for got, p, g in zip(params, start, reduced):
            assert torch.allclose(got, p.detach() - 0.1 * g, atol=1e-6)
