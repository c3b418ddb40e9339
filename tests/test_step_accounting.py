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


def _boundary_that_returns(asking):
    model, opt = _model_and_opt()
    if asking:
        opt.set_step_boundary(lambda: opt.applied_steps == 1, lambda: None)  # acts, and lets the step go on
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        opt.step()
    return model.weight.detach().clone(), model.bias.detach().clone()


def test_a_boundary_that_returns_keeps_the_steps_gradients(ring):
    plain, with_boundary = ring.run(_boundary_that_returns, False, world_size=2), ring.run(
        _boundary_that_returns, True, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], with_boundary[0]))


def _skip_at_the_epoch_end():
    from state import ElasticSampler, TorchState

    model, opt = _model_and_opt()
    sampler = ElasticSampler(12, batch_size=2, shuffle=False)
    state = TorchState(model=model, optimizer=opt, sampler=sampler)
    state.sync()
    positions = []
    for epoch in range(2):
        batches = list(state.sampler)
        for i, _ in enumerate(batches):
            opt.zero_grad()
            _backward(model)
            if epoch == 0 and i == len(batches) - 1:
                opt.synchronize()   # GradScaler on an overflow: reduced, then the apply is skipped
            else:
                opt.step()
            state.sampler.record_batch()
            if epoch == 1 and i == 0:
                positions.append((state.sampler.epoch, state.sampler.processed))
        positions.append((state.sampler.epoch, state.sampler.processed))
        state.sampler.set_epoch(epoch + 1)
        positions.append((state.sampler.epoch, state.sampler.processed))
    return positions, opt.applied_steps


def test_a_step_skipped_at_an_epochs_end_is_counted_in_that_epoch(ring):
    # world 2, 12 samples of batch 2: 3 steps per epoch. The skipped last step of epoch 0 is still pending at the
    # epoch's end (8 of 12), is counted in epoch 0 when set_epoch(1) starts the next, and epoch 1's first step
    # then covers its own 4 samples only (not 8, as when the skip was noticed at epoch 1's first gradient)
    assert ring.run(_skip_at_the_epoch_end, world_size=2) == [([(0, 8), (1, 0), (1, 4), (1, 12), (2, 0)], 5)] * 2


def _accumulate_with_clipping(clip):
    from state import ElasticSampler, TorchState

    model, opt = _model_and_opt()
    sampler = ElasticSampler(24, batch_size=2, global_batch_size=8, shuffle=False)
    state = TorchState(model=model, optimizer=opt, sampler=sampler)
    state.sync()
    early = None
    for batch in state.sampler:
        opt.zero_grad()
        model(torch.ones(len(batch), 4) * (batch[0] + 1)).sum().backward()
        if clip and not opt.step_applies_next and early is None:
            try:
                opt.synchronize()
            except RuntimeError as exc:
                early = str(exc)
        if clip and opt.step_applies_next:  # Horovod's clipping pattern, gated on the step that applies
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        state.sampler.record_batch()
    return model.weight.detach().clone(), opt.applied_steps, early


def test_clipping_with_a_global_batch_is_gated_on_the_applying_step(ring):
    plain = ring.run(_accumulate_with_clipping, False, world_size=2)
    clipped = ring.run(_accumulate_with_clipping, True, world_size=2)
    assert [p[1] for p in plain] == [p[1] for p in clipped] == [3, 3]  # 24 samples, 8 per step
    assert torch.equal(plain[0][0], clipped[0][0]) and torch.equal(clipped[0][0], clipped[1][0])
    assert "step_applies_next" in clipped[0][2], clipped[0][2]


def test_one_state_per_optimizer():
    from state import ElasticSampler, TorchState

    model, opt = _model_and_opt()
    TorchState(model=model, optimizer=opt, sampler=ElasticSampler(10, batch_size=2))
    try:
        TorchState(model=model, optimizer=opt)
    except ValueError as exc:
        assert "another State" in str(exc)
    else:
        raise AssertionError("a second State over the same optimizer must be refused")


def _grad_scaler_overflow():
    from state import ElasticSampler, TorchState

    model, opt = _model_and_opt()
    sampler = ElasticSampler(16, batch_size=2, shuffle=False)
    state = TorchState(model=model, optimizer=opt, sampler=sampler)
    state.sync()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    positions = []
    for i, batch in enumerate(state.sampler):
        opt.zero_grad()
        loss = model(torch.ones(len(batch), 4)).sum() * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        opt.synchronize()                    # Horovod's AMP pattern
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)                 # skips optimizer.step() on the overflow at i == 1
        scaler.update()
        state.sampler.record_batch()
        positions.append(state.sampler.processed)
    return positions, opt.applied_steps, state.sampler.step, scaler.get_scale()


def test_a_real_grad_scaler_overflow_is_a_consumed_step(ring):
    # 16 samples, batch 2, 2 ranks: 4 steps; the overflow at step 2 is skipped by GradScaler and counted when
    # step 3's first gradient arrives, so no batch is trained twice or lost after a recovery
    results = ring.run(_grad_scaler_overflow, world_size=2)
    assert results == [([4, 4, 12, 16], 3, 4, 2.0 ** 7)] * 2, results
