"""A steady-state step's agreement rides in its last gradient bucket: no collective of its own, the same
verdicts as the leading check (tables for the pure decoding; real gloo rings for the reducer)."""

import pytest
import torch

import elastic_ring as er
from elastic_ring.reduction import step_trailer
from elastic_ring.reduction.step_trailer import SLOTS, decode, encode, supports


def summed(*ranks):
    return [float(sum(column)) for column in zip(*ranks)]


D, E = 0x1234_5678_9ABC, 0x1234_5678_9ABD  # digests that differ in their lowest bit

DECODE_TABLE = [
    # (slots of every rank, world, foreign, same_plan, same_step, boundary)
    ([encode(D, 7, False)] * 3, 3, False, True, True, False),
    ([encode(D, 7, False), encode(D, 7, True), encode(D, 7, False)], 3, False, True, True, True),
    ([encode(D, 7, False), encode(E, 7, False)], 2, False, False, True, False),
    ([encode(D, 7, False), encode(D, 5, False)], 2, False, True, False, False),
    ([encode(D, 1 << 40, False), encode(D, (1 << 40) + 1, False)], 2, False, True, False, False),  # high steps too
    ([encode(D, 7, False), encode(D, None, False)], 2, False, True, True, False),   # a joiner's step: not compared
    ([encode(D, None, False)] * 2, 2, False, True, True, False),
    ([encode(D, 7, False)] * 2, 3, True, False, False, False),                      # a rank's slots are missing
]


@pytest.mark.parametrize("ranks, world, foreign, same_plan, same_step, boundary", DECODE_TABLE)
def test_decode(ranks, world, foreign, same_plan, same_step, boundary):
    verdict = decode(summed(*ranks), world)  # a reader that only knows the sums
    assert (verdict.foreign, verdict.same_plan, verdict.same_step, verdict.boundary) == (
        foreign, same_plan, same_step, boundary)
    assert verdict.agreed == (not foreign and same_plan and same_step)


@pytest.mark.parametrize("mine, ranks, same_plan, same_step", [
    ((D, 7), [encode(D, 7, False)] * 2, True, True),
    ((D, 7), [encode(E, 7, False)] * 2, False, True),      # every other rank agrees among itself, not with me
    ((D, 7), [encode(D, 8, False)] * 2, True, False),
    ((D, None), [encode(D, None, False), encode(D, 3, False)], True, True),  # I send no step: not compared
    ((D, 3), [encode(D, None, False), encode(D, 3, False)], True, True),
])
def test_decode_against_this_ranks_own_plan_and_step(mine, ranks, same_plan, same_step):
    verdict = decode(summed(*ranks), len(ranks), *mine)
    assert (verdict.foreign, verdict.same_plan, verdict.same_step) == (False, same_plan, same_step)


def test_a_foreign_all_ones_tensor_is_not_agreement_for_a_rank_that_knows_its_plan():
    ones = summed([1.0] * SLOTS, [1.0] * SLOTS)
    assert decode(ones, 2).agreed              # it looks consistent to a reader of the sums alone
    assert not decode(ones, 2, D, 7).agreed    # not to the reducer, which compares with its own plan


@pytest.mark.parametrize("sums", [
    [float("nan")] * SLOTS,                         # gradients of another collective
    summed(encode(D, 7, False), encode(D, None, False))[:35] + [2.0] * 32,  # step bits summed by a rank not compared
    [0.37] * SLOTS,                                 # not integers
    [2.0, 0.0] + [3.0] * (SLOTS - 2),               # a bit summed beyond the world size
    [2.0] * (SLOTS - 1),                            # the wrong length
])
def test_anything_but_two_ranks_slots_is_foreign(sums):
    assert decode(sums, 2).foreign and not decode(sums, 2).agreed


@pytest.mark.parametrize("dtype, world, fits", [
    (torch.float32, 2, True), (torch.float32, 1 << 24, True), (torch.float32, (1 << 24) + 1, False),
    (torch.float16, 2048, True), (torch.float16, 2049, False),
    (torch.bfloat16, 256, True), (torch.bfloat16, 257, False),
    (torch.float64, 10**9, True), (torch.int64, 2, False),
])
def test_supports_only_dtypes_that_sum_the_world_exactly(dtype, world, fits):
    assert supports(dtype, world) is fits


def test_every_sum_is_exact_in_the_smallest_dtype_at_its_largest_world():
    ranks = [encode(D, 2**32 - 1, True)] * 256
    exact = torch.tensor(summed(*ranks), dtype=torch.bfloat16)
    assert decode(exact.float().tolist(), 256).agreed


# ------------------------------------------------------------ on a real gloo ring

def _model_and_opt(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  fusion_threshold_bytes=64, first_bucket_bytes=0, autotune=False, **kwargs)
    return model, opt


def _step(model, opt, seed):
    opt.zero_grad()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed * 10 + er.rank()))
    model(x).pow(2).sum().backward()
    opt.step()


def _train_counting_checks(steps, **options):
    """Train ``steps`` steps; return the model, the optimizer and how many leading checks the reducer started."""
    from elastic_ring.reduction import reducer as grad_reducer

    calls = []
    original = grad_reducer.start_check
    grad_reducer.start_check = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        model, opt = _model_and_opt(**options)
        for seed in range(steps):
            _step(model, opt, seed)
    finally:
        grad_reducer.start_check = original
    return model, opt, len(calls)


def _count_checks_and_train(strict, steps=6):
    model, opt, checks = _train_counting_checks(steps, strict_checks=strict)
    return checks, [p.detach().clone() for p in model.parameters()], opt.applied_steps


def test_only_a_rings_first_step_has_a_collective_of_its_own_and_results_equal_strict_mode(ring):
    lean = ring.run(_count_checks_and_train, False, world_size=3, timeout_s=60)
    strict = ring.run(_count_checks_and_train, True, world_size=3, timeout_s=60)
    assert [checks for checks, _, _ in lean] == [1, 1, 1]     # the ring's first step only
    assert [checks for checks, _, _ in strict] == [6, 6, 6]   # every step
    for (_, a, steps_a), (_, b, steps_b) in zip(lean, strict):
        assert steps_a == steps_b == 6
        # the same updates (3 ranks sum in an order that depends on the bucket's length: not bit for bit)
        assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))
    for _, params, _ in lean[1:]:  # and bit-identical on every rank
        assert all(torch.equal(x, y) for x, y in zip(lean[0][1], params))


def _foreign_slots():
    model, opt = _model_and_opt()
    _step(model, opt, 0)
    original = step_trailer.encode
    if er.rank() == 1:  # as if this rank's last bucket had met another collective's data
        step_trailer.encode = lambda *a: [0.0] + original(*a)[1:]
    before = [p.detach().clone() for p in model.parameters()]
    try:
        _step(model, opt, 1)
    except er.TensorMismatchError as exc:
        message = str(exc)
    else:
        message = None
    finally:
        step_trailer.encode = original
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    try:
        er.barrier()
        after = "usable"
    except er.CommError:
        after = "aborted"
    return message, unchanged, after


def test_a_last_bucket_that_met_another_collective_aborts_the_ring_on_every_rank(ring):
    for message, unchanged, after in ring.run(_foreign_slots, world_size=2, timeout_s=60):
        assert message is not None and "met a different collective" in message and "strict_checks=True" in message
        assert unchanged and after == "aborted"


def _a_plan_of_the_same_sizes_that_differs():
    from elastic_ring.reduction.signature import signature_hash

    model, opt = _model_and_opt()
    _step(model, opt, 0)
    reducer = opt._er_reducer
    if er.rank() == 1:  # a rank whose plan differs in a way the sizes do not show
        reducer._kind = reducer._kind.replace("DistributedOptimizer step", "DistributedOptimizer step of another model")
        reducer._digest = reducer._agreed_digest = signature_hash(reducer._kind, reducer._entries)
    try:
        _step(model, opt, 1)
    except er.TensorMismatchError as exc:
        message = str(exc)
    else:
        message = None
    try:
        er.barrier()
        after = "usable"
    except er.CommError:
        after = "aborted"
    return message, after


def test_a_plan_that_differs_in_the_slots_is_treated_as_foreign_data_and_aborts_the_ring(ring):
    # honest ranks cannot differ there (the ring's leading check agreed on the plan): the ring is not trusted
    for message, after in ring.run(_a_plan_of_the_same_sizes_that_differs, world_size=2, timeout_s=60):
        assert message is not None and "met a different collective" in message and after == "aborted"


def _min_op_keeps_the_leading_check():
    _, opt, checks = _train_counting_checks(3, op=er.Max)
    return checks, opt._er_reducer._layout.trailer is None


def test_ops_whose_reduction_cannot_carry_the_slots_keep_a_leading_check_every_step(ring):
    assert ring.run(_min_op_keeps_the_leading_check, world_size=2, timeout_s=60) == [(3, True), (3, True)]


def test_strict_checks_is_validated():
    with pytest.raises(ValueError, match="strict_checks='yes' must be True or False"):
        er.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), strict_checks="yes")


def _collective_between_backward_and_step(strict):
    model, opt = _model_and_opt(strict_checks=strict)
    total = torch.zeros(1)
    for seed in range(8):
        opt.zero_grad()
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
        # the loop's own collective while ready buckets may still wait for the step check's answer (helper thread)
        total += er.allreduce(torch.ones(1), op=er.Sum)
        opt.step()
    return total.item(), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strict", [False, True], ids=["first-step-checked", "every-step-checked"])
def test_a_collective_between_backward_and_step_never_races_the_gated_buckets(ring, strict):
    results = ring.run(_collective_between_backward_and_step, strict, world_size=3, timeout_s=60)
    assert [total for total, _ in results] == [24.0] * 3
    assert all(torch.equal(a, b) for _, params in results[1:] for a, b in zip(results[0][1], params))
