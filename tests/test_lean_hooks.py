"""The lean gradient hook (reducer.py, adoption.py) equals the locked path and one process, over real rings:
fp16 compression, several backward passes per step, a parameter without a gradient, both zero_grad modes,
a re-form in between, a failure inside a lean hook; and it makes no Python call per parameter but itself."""

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.core import constants

IN, HIDDEN, OUT, PER_RANK = 12, 16, 4, 5


class Net(torch.nn.Module):
    """Three layers and a side branch that only even steps use (its parameters get no gradient on odd steps)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                         torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
        self.side = torch.nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.body(x)
        return y + self.side(x) if step % 2 == 0 else y


def batch(step: int, rank: int, k: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * k + rank)
    return torch.randn(PER_RANK, IN, generator=g), torch.randn(PER_RANK, OUT, generator=g)


def loss_of(model: Net, step: int, rank: int, k: int) -> torch.Tensor:
    x, y = batch(step, rank, k)
    return torch.nn.functional.mse_loss(model(x, step), y)


def reference(worlds: list[int], passes: int) -> list[torch.Tensor]:
    """One process: step s averages the gradients of worlds[s] ranks (each summed over its passes)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, world in enumerate(worlds):
        opt.zero_grad()
        for rank in range(world):
            for k in range(passes):
                (loss_of(model, step, rank, k) / world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class Counted:
    """Counts the hooks that took the locked path (an instance attribute shadows the method)."""

    def __init__(self, opt) -> None:
        reducer = opt._er_reducer
        self.locked = 0
        original = reducer._on_grad_ready_locked

        def locked(param):
            self.locked += 1
            return original(param)

        reducer._on_grad_ready_locked = locked


_KEPT: dict = {}


def _make(lean: bool, compression: str, passes: int):
    model = Net()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(),
                                  compression=getattr(er.Compression, compression), backward_passes_per_step=passes,
                                  fusion_threshold_bytes=600, first_bucket_bytes=100)
    return {"lean": lean, "model": model, "opt": opt, "count": Counted(opt), "locked": []}


def _train(run: dict, first: int, steps: int, set_to_none: bool) -> None:
    saved = constants.LEAN_HOOKS
    constants.LEAN_HOOKS = run["lean"]
    try:
        model, opt, count = run["model"], run["opt"], run["count"]
        for step in range(first, first + steps):
            before = count.locked
            opt.zero_grad(set_to_none=set_to_none)
            for k in range(opt.backward_passes_per_step):
                loss_of(model, step, er.rank(), k).backward()
            opt.step()
            run["locked"].append(count.locked - before)
    finally:
        constants.LEAN_HOOKS = saved


def _first_ring(compression, passes, set_to_none, steps, batch_below_bytes):
    _KEPT.clear()
    constants.GRAD_BATCH_BELOW_BYTES = batch_below_bytes  # 0: every gradient moves in its own hook (read per layout)
    runs = [_make(True, compression, passes), _make(False, compression, passes)]
    for step in range(steps):  # the lean and the locked optimizer step in turn, on the same ring
        for run in runs:
            _train(run, step, 1, set_to_none)
    _KEPT["runs"] = runs
    return [run["locked"] for run in runs], len(runs[0]["opt"].fusion_buckets)


def _second_ring(set_to_none, first, steps):
    runs = _KEPT.pop("runs")
    for step in range(first, first + steps):
        for run in runs:
            _train(run, step, 1, set_to_none)
    lean, locked = ([p.detach().clone() for p in run["model"].parameters()] for run in runs)
    views = all(p.grad is not None and p.grad.data_ptr() != 0 for p in runs[0]["model"].parameters())
    return [run["locked"] for run in runs], lean, locked, views


def _restore_batch_below(value):
    constants.GRAD_BATCH_BELOW_BYTES = value


@pytest.mark.parametrize("compression, passes, set_to_none, batch_below_bytes", [
    ("none", 1, True, 0),
    ("none", 1, True, 1 << 20),
    ("none", 2, False, 1 << 20),
    ("fp16", 1, False, 0),
    ("fp16", 2, True, 1 << 20),
])
def test_lean_hooks_equal_the_locked_path_and_one_process_across_a_reform(ring, compression, passes, set_to_none,
                                                                          batch_below_bytes):
    params = len(list(Net().parameters()))
    try:
        first = ring.run(_first_ring, compression, passes, set_to_none, 4, batch_below_bytes, world_size=3,
                         timeout_s=60)
        second = ring.run(_second_ring, set_to_none, 4, 4, world_size=2, timeout_s=60)
    finally:
        ring.run(_restore_batch_below, constants.GRAD_BATCH_BELOW_BYTES, world_size=3, timeout_s=30)
    expected = reference([3] * 4 + [2] * 4, passes)
    tolerance = dict(rtol=3e-3, atol=3e-3) if compression == "fp16" else dict(rtol=1e-5, atol=1e-6)
    for (locked_first, buckets), (locked_second, lean, locked, views) in zip(first, second):
        assert buckets > 2
        # the locked path serves every hook of the locked optimizer, and the lean optimizer's hooks only in a ring's
        # first step (checked), in the step after it (the first to ride in the last bucket starts locked) and at
        # the first gradient after a step without the side branch (its missing gradients went through synchronize)
        assert locked_second[0][:4] == locked_first[0]
        lean_locked, all_locked = locked_second  # both rings
        hooks = [passes * (params if step % 2 == 0 else params - 2) for step in range(8)]
        assert all_locked == hooks
        assert lean_locked[0] == hooks[0] and lean_locked[4] == hooks[4], lean_locked  # each ring's first step
        assert sum(lean_locked[2:4]) + sum(lean_locked[6:8]) == 0, lean_locked  # steady state: no locked hook
        assert views
        assert all(torch.equal(a, b) for a, b in zip(lean, locked)), "lean and locked paths differ"
        for p, e in zip(lean, expected):
            torch.testing.assert_close(p, e, **tolerance)
    for _, lean, _, _ in second[1:]:
        assert all(torch.equal(a, b) for a, b in zip(second[0][1], lean)), "ranks differ"


def _failure_inside_a_lean_hook():
    model = Net()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  fusion_threshold_bytes=600, first_bucket_bytes=100)
    count = Counted(opt)
    for step in (0, 2, 4):  # steps with every gradient: from the second on, the next step is armed lean
        opt.zero_grad()
        loss_of(model, step, er.rank(), 0).backward()
        opt.step()
    armed = opt._er_reducer._lean is not None
    before = [p.detach().clone() for p in model.parameters()]
    locked_before = count.locked
    runtime.current().fail(er.CommError("injected: the ring failed between two steps"))
    opt.zero_grad()
    try:
        loss_of(model, 6, er.rank(), 0).backward()
        opt.step()
    except er.CommError as exc:
        raised = (getattr(exc, "live_state_consistent", False), "injected" in str(exc))
    else:
        raised = None
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    cleared = all(p.grad is None for p in model.parameters())
    return armed, raised, unchanged, cleared, count.locked - locked_before, opt.applied_steps


def test_a_failure_inside_a_lean_hook_is_a_comm_error_with_the_live_state_whole(ring):
    for armed, raised, unchanged, cleared, locked, applied in ring.run(_failure_inside_a_lean_hook, world_size=2,
                                                                        timeout_s=60):
        assert armed, "after two steps agreed in the last bucket the next step's hooks start lean"
        assert locked == 0, "the failure was met on the lean path"
        assert raised == (True, True)
        assert unchanged and cleared and applied == 3


def _calls_per_step(lean: bool):
    from benchmarks._pycalls import CallCounter

    torch.manual_seed(0)
    width, depth = 8, 20

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])

    model, plain_model = make(), make()
    params = len(list(model.parameters()))
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                  fusion_threshold_bytes=1 << 20)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    x = torch.randn(4, width)
    saved = constants.LEAN_HOOKS
    constants.LEAN_HOOKS = lean
    try:
        counts = {}
        for name, m, o in (("ours", model, opt), ("plain", plain_model, plain)):
            for _ in range(3):
                o.zero_grad()
                m(x).sum().backward()
                o.step()
            with CallCounter() as counter:
                for _ in range(5):
                    o.zero_grad()
                    m(x).sum().backward()
                    o.step()
            counts[name] = counter.calls / 5
    finally:
        constants.LEAN_HOOKS = saved
    return counts["ours"] - counts["plain"], params, len(opt.fusion_buckets)


def test_a_lean_step_calls_nothing_per_parameter_but_its_hook(ring):
    """The reducer's Python calls per step beyond a plain optimizer's: its hooks (one per parameter) and a few
    per bucket and per step; the locked path pays several per parameter. (The plain run uses the same modules,
    so forward and backward cost the same.)"""
    for extra, params, buckets in ring.run(_calls_per_step, True, world_size=2, timeout_s=60):
        assert buckets == 1 and params == 40
        assert extra <= params + 40, extra
    for extra, params, _ in ring.run(_calls_per_step, False, world_size=2, timeout_s=60):
        assert extra >= 4 * params, extra  # the locked path, for contrast: what the lean one saves


def _misuse_in_steady_state():
    model = Net()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  backward_passes_per_step=2, fusion_threshold_bytes=600, first_bucket_bytes=100)
    for step in (0, 2, 4):
        opt.zero_grad()
        for k in range(2):
            loss_of(model, step, er.rank(), k).backward()
        opt.step()
    armed = opt._er_reducer._lean is not None
    errors = []
    loss_of(model, 6, er.rank(), 0).backward()  # the step's first pass, on lean hooks only
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        errors.append(str(exc))
    loss_of(model, 6, er.rank(), 1).backward()
    try:
        loss_of(model, 6, er.rank(), 2).backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    return armed, errors


def test_misuse_on_lean_hooks_gives_the_same_clear_errors(ring):
    for armed, errors in ring.run(_misuse_in_steady_state, world_size=2, timeout_s=60):
        assert armed and len(errors) == 2, errors
        assert "zero_grad() was called after loss.backward()" in errors[0]
        assert "more than backward_passes_per_step=2" in errors[1]
