"""Bucket-size autotuning: the pure schedule and decision (tables), then real rings that must agree."""

import time

import pytest
import torch

import elastic_ring as er
from elastic_ring.reduction.autotune import Autotuner, choose, distinct_candidates

MIB = 1 << 20


@pytest.mark.parametrize(
    "sizes, default, plans, expected",
    [
        ([4, 16, 64], 16, {4: "a", 16: "b", 64: "c"}, [4, 16, 64]),
        # 64 gives the same buckets as 16 (a small model): tried once, as the default
        ([4, 16, 64], 16, {4: "a", 16: "b", 64: "b"}, [4, 16]),
        ([4, 16, 64], 16, {4: "b", 16: "b", 64: "b"}, [16]),
        # the default is always a candidate
        ([4, 64], 16, {4: "a", 16: "b", 64: "c"}, [4, 16, 64]),
        # same plan, none of them the default: the smallest is kept
        ([2, 4, 16], 16, {2: "a", 4: "a", 16: "b"}, [2, 16]),
    ],
)
def test_distinct_candidates(sizes, default, plans, expected):
    assert distinct_candidates(sizes, default, plans.__getitem__) == expected


@pytest.mark.parametrize(
    "candidates, times, default, margin, expected",
    [
        ([4, 16, 64], [10.0, 12.0, 11.0], 16, 0.0, 4),
        ([4, 16, 64], [11.9, 12.0, 13.0], 16, 0.03, 16),   # within 3 % of the best: keep the default
        ([4, 16, 64], [11.0, 12.0, 13.0], 16, 0.03, 4),    # 9 % better: switch
        ([4, 16], [5.0, 5.0], 99, 0.03, 4),                # default not tried: the fastest, first on ties
        ([16], [7.0], 16, 0.03, 16),
    ],
)
def test_choose(candidates, times, default, margin, expected):
    assert choose(candidates, times, default, margin) == expected


def test_choose_needs_one_time_per_candidate():
    with pytest.raises(ValueError, match="one time per candidate"):
        choose([1, 2], [1.0], 1, 0.0)


def run_schedule(tuner, local_ms, agreed_ms):
    """Drive a tuner as the reducer does: step k uses ``tuner.current``; its check carries
    ``outgoing()`` and brings back the agreed (slowest-rank) value of the candidate that just
    finished. Returns the size used at every step and the (step, new size) switches."""
    used, switches, finished = [], [], None
    for step in range(100):
        if tuner.done:
            break
        size = tuner.current
        used.append(size)
        if tuner.outgoing():
            tuner.incoming(int(agreed_ms[finished] * 1000))
        switch = tuner.end_step(None if step == 0 else local_ms[size] / 1e3)
        if tuner.outgoing():
            finished = size
        if switch is not None:
            switches.append((step, switch))
    return used, switches


def test_schedule_tries_each_candidate_then_keeps_the_agreed_best():
    tuner = Autotuner([4, 16, 64], default=16, warmup_steps=1, sample_steps=2, margin=0.03)
    # this rank alone would pick 64; the slowest rank's numbers (agreed) make 4 the best
    used, switches = run_schedule(tuner, local_ms={4: 30.0, 16: 20.0, 64: 10.0}, agreed_ms={4: 15.0, 16: 20.0, 64: 25.0})
    assert used == [4, 4, 4, 16, 16, 16, 64, 64, 64, 4]
    # after the last candidate: the best agreed so far (4) until the last score arrives, then the final choice
    assert switches == [(2, 16), (5, 64), (8, 4)]
    assert tuner.result.chosen_bytes == 4 and tuner.result.candidates == (4, 16, 64)
    assert tuner.result.step_ms == (15.0, 20.0, 25.0) and tuner.result.tuning_steps == 10
    assert tuner.end_step(0.01) is None and tuner.current == 4


def test_single_candidate_needs_no_tuning():
    tuner = Autotuner([16], default=16, warmup_steps=2, sample_steps=5, margin=0.03)
    assert tuner.done and tuner.result.chosen_bytes == 16 and tuner.outgoing() == 0


# ---------------------------------------------------------------- real rings

SLEEP_MS = {0: {"small": 40, "default": 0, "large": 20}, 1: {"small": 0, "default": 40, "large": 20}}
NAMES = {1024: "small", 2048: "default", 1 << 20: "large"}


def _tune_with_rank_specific_slowness():
    """Each rank is slow under a different bucket size, so local choices would differ
    (rank 0 would keep the default, rank 1 pick the small size); the agreed (slowest-rank)
    times make the large size the only good one, and every rank must pick it."""
    from elastic_ring.core import constants

    saved = constants.AUTOTUNE_CANDIDATE_BYTES, constants.AUTOTUNE_WARMUP_STEPS, constants.AUTOTUNE_SAMPLE_STEPS
    constants.AUTOTUNE_CANDIDATE_BYTES = (1024, 1 << 20)
    constants.AUTOTUNE_WARMUP_STEPS, constants.AUTOTUNE_SAMPLE_STEPS = 1, 3
    try:
        torch.manual_seed(0)
        # 16x16 layers: 1 KiB buckets give 6 buckets, 2 KiB give 3, 1 MiB one
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)], torch.nn.Linear(16, 4))
        opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      fusion_threshold_bytes=2048, first_bucket_bytes=0, autotune=True)
        used = []
        for step in range(24):
            opt.zero_grad()
            out = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + er.rank())))
            out.pow(2).mean().backward()  # the first gradient binds the ring: the tuner's first size is in use
            used.append(opt.fusion_threshold_bytes)
            time.sleep(SLEEP_MS[er.rank()][NAMES[opt.fusion_threshold_bytes]] / 1e3)
            opt.step()
    finally:
        constants.AUTOTUNE_CANDIDATE_BYTES, constants.AUTOTUNE_WARMUP_STEPS, constants.AUTOTUNE_SAMPLE_STEPS = saved
    params = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return opt.autotune_result, used, len(opt.fusion_buckets), params


def test_every_rank_picks_the_same_size_from_the_slowest_ranks_times(ring):
    results = ring.run(_tune_with_rank_specific_slowness, world_size=2, timeout_s=60)
    (r0, used0, buckets0, p0), (r1, used1, buckets1, p1) = results
    assert r0 is not None and r0 == r1, "every rank must reach the same decision"
    assert r0.candidates == (1024, 2048, 1 << 20)
    assert used0[:12] == [1024] * 4 + [2048] * 4 + [1 << 20] * 4
    assert r0.chosen_bytes == 1 << 20 and buckets0 == buckets1 == 1
    assert used0 == used1, "both ranks used the same bucket size at every step"
    assert r0.step_ms[2] < min(r0.step_ms[:2])
    assert torch.equal(p0, p1)


def _autotune_switch(autotune, threshold):
    model = torch.nn.Linear(8, 8)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  fusion_threshold_bytes=threshold, autotune=autotune)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    return opt._er_reducer._autotune, opt.autotune_result, opt.fusion_threshold_bytes


def test_autotune_is_on_by_default_and_off_when_asked_or_when_the_size_is_given(ring):
    from elastic_ring.core.constants import AUTOTUNE, OPTIMIZER_BUCKET_BYTES

    assert ring.run(_autotune_switch, None, None, world_size=2)[0][0] is AUTOTUNE
    off = ring.run(_autotune_switch, False, None, world_size=2)[0]
    assert off == (False, None, OPTIMIZER_BUCKET_BYTES)
    assert ring.run(_autotune_switch, None, 1 << 20, world_size=2)[0] == (False, None, 1 << 20)
    # a tiny model: every candidate gives the same buckets, so the choice is immediate
    tuned = ring.run(_autotune_switch, True, None, world_size=2)[0]
    assert tuned[0] is True and tuned[1].chosen_bytes == OPTIMIZER_BUCKET_BYTES and tuned[1].tuning_steps == 0
