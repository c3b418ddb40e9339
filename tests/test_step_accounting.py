"""DistributedOptimizer's step accounting (real rings): consumed steps (applied, or reduced and skipped as
GradScaler does), step boundaries the ring agrees on, and accumulate mode with pass weights."""

import torch

import elastic_ring as er


def _model_and_opt(**options):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **options)
    return model, opt


def _backward(model):
    model(torch.ones(3, 4) * (er.rank() + 1)).sum().backward()


def _consumed_and_skipped():
    model, opt = _model_and_opt()
    log = []
    opt.add_step_listener(lambda passes, applied: log.append((passes, applied)))
    for step in range(4):
        opt.zero_grad()
        _backward(model)
        if step == 1:  # what GradScaler does on an overflow: reduce, then skip the apply
            opt.synchronize()
            continue
        opt.step()
    return log, opt.applied_steps


def test_applied_and_skipped_steps_are_consumed_once(ring):
    for world in (1, 2):
        results = ring.run(_consumed_and_skipped, world_size=world)
        # step 1 was skipped: noticed when step 2's first gradient arrived, reported between steps 0 and 2
        assert results == [([(1, True), (1, False), (1, True), (1, True)], 3)] * world, (world, results)


def _boundary_without_a_model_hook(asking_rank):
    model, opt = _model_and_opt()
    acted = []
    opt.set_step_boundary(lambda: er.rank() == asking_rank and opt.applied_steps == 1, lambda: acted.append(
        opt.applied_steps))
    for _ in range(4):
        opt.zero_grad()
        _backward(model)   # the due boundary runs at this step's first gradient (nothing hooked the forward)
        opt.step()
    return acted


def test_a_boundary_asked_by_one_rank_acts_on_every_rank_after_the_same_step(ring):
    assert ring.run(_boundary_without_a_model_hook, 1, world_size=3) == [[2]] * 3


def _accumulate(weights):
    model, opt = _model_and_opt(backward_passes_per_step=2)
    opt.set_accumulate_in_step(True)
    if weights:
        opt.set_pass_shares(lambda j: ((3, 1)[j] if er.rank() == 0 else (2, 2)[j], 8))
    applied = []
    for _ in range(4):
        opt.zero_grad()   # between micro-batches: keeps the accumulating gradients
        _backward(model)
        opt.step()
        applied.append(opt.applied_steps)
    return applied, model.weight.detach().clone()


def test_accumulate_mode_applies_once_per_step_and_weights_passes(ring):
    plain = ring.run(_accumulate, False, world_size=2)
    assert [a for a, _ in plain] == [[0, 1, 1, 2]] * 2
    weighted = ring.run(_accumulate, True, world_size=2)
    assert [a for a, _ in weighted] == [[0, 1, 1, 2]] * 2
    # each rank's two passes have equal gradients g_r. Plain: their sum, 2·g_r. Weighted by n·W/S: rank 0
    # (3·2 + 1·2)/8 = 1, rank 1 (2·2 + 2·2)/8 = 1: g_r once. So the weighted update is half the plain one.
    w0 = _model_and_opt()[0].weight.detach()
    assert torch.allclose(plain[0][1] - w0, 2 * (weighted[0][1] - w0), rtol=0, atol=1e-6)
    assert torch.equal(weighted[0][1], weighted[1][1]) and torch.equal(plain[0][1], plain[1][1])
