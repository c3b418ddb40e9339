"""DistributedOptimizer over real processes equals one process training on the whole batch."""

import pytest
import torch

import elastic_ring as er

IN, HIDDEN, OUT = 12, 32, 4


def make_model(seed=0, extra_layer=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
              torch.nn.Linear(HIDDEN, OUT)]
    if extra_layer:
        layers.append(torch.nn.Linear(OUT, OUT))
    return torch.nn.Sequential(*layers)


def global_batch(step, n, per_rank):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n * per_rank, IN, generator=g), torch.randn(n * per_rank, OUT, generator=g)


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference_training(kind, n, per_rank, steps, passes=1):
    """One process, the concatenated batch of all ranks (and passes)."""
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, n, per_rank)
            for r in range(n):  # mean per rank's batch, summed over passes, averaged over ranks
                sl = slice(r * per_rank, (r + 1) * per_rank)
                (torch.nn.functional.mse_loss(model(x[sl]), y[sl]) / n).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _distributed_training(kind, steps, passes, threshold, compression_name):
    n, r, per_rank = er.size(), er.rank(), 6
    model = make_model()
    compression = getattr(er.Compression, compression_name)
    opt = er.DistributedOptimizer(make_optimizer(kind, model.parameters()), model.named_parameters(),
                                  backward_passes_per_step=passes, fusion_threshold_bytes=threshold,
                                  compression=compression)
    assert isinstance(opt, type(make_optimizer(kind, [torch.nn.Parameter(torch.ones(1))])))
    launched_during_backward = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, n, per_rank)
            sl = slice(r * per_rank, (r + 1) * per_rank)
            torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        verdict = opt._er_reducer._verdict
        if verdict is not None:  # the step's check is answered on a helper thread, which launches what is ready
            verdict.settle()
        launched_during_backward.append(len(opt._er_reducer._in_flight))
        opt.step()
    expected = reference_training(kind, n, per_rank, steps, passes)
    tol = dict(rtol=2e-3, atol=2e-3) if compression_name == "fp16" else dict(rtol=1e-5, atol=1e-6)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, **tol)
    everyone = er.allgather_object([p.detach() for p in model.parameters()])
    identical = all(torch.equal(a, b) for other in everyone for a, b in zip(everyone[0], other))
    return identical, launched_during_backward, len(opt.fusion_buckets)


@pytest.mark.parametrize(
    "kind, passes, threshold, compression, world",
    [
        ("sgd", 1, 64 << 20, "none", 3),
        ("adam", 1, 2048, "none", 3),
        ("sgd", 2, 4096, "none", 2),
        ("adam", 3, 64 << 20, "none", 2),
        ("sgd", 1, 2048, "fp16", 3),
    ],
)
def test_matches_single_process_on_concatenated_batch(ring, kind, passes, threshold, compression, world):
    results = ring.run(_distributed_training, kind, 4, passes, threshold, compression, world_size=world)
    for identical, launched, buckets in results:
        assert identical, "all ranks must end with bit-identical parameters"
        # every bucket was launched by the gradient hooks (or by the check's helper once every rank
        # agreed), before step() was called
        assert launched == [buckets] * 4
    if threshold == 2048:
        assert results[0][2] > 1


def _different_models():
    model = make_model(extra_layer=er.rank() == 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x = torch.randn(4, IN)
    try:
        model(x).sum().backward()
        opt.step()
    except er.TensorMismatchError as exc:
        return str(exc)
    return None


def test_different_models_fail_at_the_first_step_on_every_rank(ring):
    messages = ring.run(_different_models, world_size=2, timeout_s=30)
    assert messages[0] is not None and messages[0] == messages[1]
    assert "different numbers of tensors" in messages[0] or "disagree on tensor" in messages[0]


def _collective_on_one_rank_only(strict: bool = True):
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  strict_checks=strict)
    try:
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.randn(4, IN)).sum()
            loss.backward()
            opt.step()
            if er.rank() == 0:  # the classic bug: logging through a collective on rank 0 only
                er.allreduce(loss.detach())
    except er.TensorMismatchError as exc:
        return str(exc)
    except er.CommError as exc:
        return f"CommError: {exc}"
    return None


def test_collective_called_by_one_rank_only_is_a_clear_error_with_strict_checks(ring):
    messages = ring.run(_collective_on_one_rank_only, world_size=2, timeout_s=60)
    assert messages[0] is not None and messages[0] == messages[1]
    assert "different collectives" in messages[0] and "DistributedOptimizer step" in messages[0]


def test_collective_called_by_one_rank_only_without_strict_checks_fails_the_ring_fast_never_hangs():
    """What docs/performance.md says strict checks alone catch clearly: here gloo meets a 48-byte probe paired
    with a gradient bucket and aborts that process; its peer's collective fails at once. A fresh ring: a rank dies."""
    import time

    from tests.process_ring import ProcessRing, RankFailure

    pool = ProcessRing(2)
    try:
        started = time.monotonic()
        results = pool.run(_collective_on_one_rank_only, False, world_size=2, timeout_s=60)
        assert time.monotonic() - started < 30
    finally:
        pool.close()
    assert isinstance(results[0], RankFailure) and results[0].type_name == "ProcessDied", results
    assert results[1].startswith("CommError: ") and "collective failed" in results[1], results


def _broadcast_state():
    r = er.rank()
    model = make_model(seed=10 + r)
    model.register_buffer("counter", torch.tensor([r]))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 1:  # only the root has optimizer state
        model(torch.randn(2, IN)).sum().backward()
        opt.step()
    er.broadcast_parameters(model, root_rank=1)
    er.broadcast_optimizer_state(opt, root_rank=1)
    params = [p.detach() for p in model.parameters()] + [model.counter]
    state = opt.state_dict()
    moments = [state["state"][i]["exp_avg"] for i in sorted(state["state"])]
    everyone = er.allgather_object((params, moments, state["param_groups"][0]["lr"]))
    same_params = all(torch.equal(a, b) for o in everyone for a, b in zip(everyone[1][0], o[0]))
    same_moments = all(len(o[1]) == len(everyone[1][1]) and all(torch.equal(a, b) for a, b in zip(everyone[1][1], o[1])) for o in everyone)
    return same_params, same_moments, {o[2] for o in everyone}, model.counter.item()


def test_broadcast_parameters_and_optimizer_state(ring):
    results = ring.run(_broadcast_state)
    for same_params, same_moments, lrs, counter in results:
        assert same_params and same_moments
        assert lrs == {0.02} and counter == 1


def _misuse():
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    errors = []
    model(torch.randn(2, IN)).sum().backward()
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        errors.append(str(exc))
    opt.step()
    opt.zero_grad()
    model(torch.randn(2, IN)).sum().backward()
    try:
        model(torch.randn(2, IN)).sum().backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    opt.step()
    return errors


def test_misuse_gives_clear_errors(ring):
    results = ring.run(_misuse, world_size=2)
    for errors in results:
        assert len(errors) == 2
        assert "zero_grad() was called after loss.backward()" in errors[0]
        assert "backward_passes_per_step=1" in errors[1]


def _clip_and_schedule():
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(4, IN) * (er.rank() + 1)
    model(x).pow(2).sum().backward()
    opt.synchronize()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    sched.step()
    return float(norm), opt.param_groups[0]["lr"], [p.detach().clone() for p in model.parameters()]


def test_synchronize_then_clip_and_lr_scheduler(ring):
    results = ring.run(_clip_and_schedule, world_size=2)
    assert results[0][0] == pytest.approx(results[1][0])  # clipped the same, averaged gradients
    assert results[0][1] == 0.05
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b)


def _unused_parameter():
    model = make_model()
    unused = torch.nn.Linear(3, 3)
    params = list(model.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
    opt = er.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), params)
    model(torch.randn(2, IN)).sum().backward()
    opt.step()
    return unused.weight.grad is not None and float(unused.weight.grad.abs().sum()) == 0.0


def test_parameter_without_gradient_does_not_hang(ring):
    assert ring.run(_unused_parameter, world_size=2, timeout_s=30) == [True, True]


def _world_size_one():
    model = make_model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for m, o in ((model, opt), (plain, plain_opt)):
        torch.manual_seed(3)
        m(torch.randn(5, IN)).sum().backward()
        o.step()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())), len(opt._er_reducer._in_flight)


def test_world_size_one_is_plain_training(ring):
    assert ring.run(_world_size_one, world_size=1) == [(True, 0)]


def test_invalid_arguments():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        er.DistributedOptimizer(sgd, model.named_parameters(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="not in named_parameters"):
        er.DistributedOptimizer(sgd, list(model.named_parameters())[:2])
    with pytest.raises(ValueError, match="duplicate names"):
        er.DistributedOptimizer(sgd, [("a", p) for p in model.parameters()])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        er.DistributedOptimizer(model, model.named_parameters())
    with pytest.raises(ValueError, match="compression="):
        er.DistributedOptimizer(sgd, model.named_parameters(), compression="fp16")
