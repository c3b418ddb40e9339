"""benchmarks.step's verdict against its own noise (benchmarks/_verdict.py) and its Python-call counter."""

import math
import statistics

import pytest

from benchmarks._pycalls import CallCounter, calls_per_run
from benchmarks._verdict import AHEAD, BEHIND, WITHIN, aa_band, block_ratios, faster_config, median_se, verdict


@pytest.mark.parametrize("configs, chosen", [
    ({"ddp": [[10, 10, 10]], "ddp_view": [[9, 9, 9]]}, "ddp_view"),
    # the faster per block alternates, but over the row one is faster: it is chosen once for every block
    ({"ddp": [[10, 10, 10], [8, 8, 8], [10, 10, 10]], "ddp_view": [[9, 9, 9], [9, 9, 9], [9, 9, 9]]}, "ddp_view"),
    # a single slow outlier does not decide (medians, not means)
    ({"ddp": [[5, 5, 500]], "ddp_view": [[6, 6, 6]]}, "ddp"),
    # a tie goes to the first name in sorted order: the choice is deterministic
    ({"ddp_view": [[7]], "ddp": [[7]]}, "ddp"),
    ({"only": [[3, 4]]}, "only"),
])
def test_the_faster_ddp_configuration_is_chosen_once_per_row_by_its_median(configs, chosen):
    assert faster_config(configs) == chosen


def test_faster_config_refuses_empty_input():
    with pytest.raises(ValueError, match="at least one"):
        faster_config({})
    with pytest.raises(ValueError, match="'ddp' has no step times"):
        faster_config({"ddp": [[]]})


def test_block_ratios_are_the_baselines_median_over_ours():
    assert block_ratios([[10, 10, 30], [8, 8, 8]], [[5, 5, 5], [8, 9, 7]]) == [2.0, 1.0]
    with pytest.raises(ValueError, match="same number of blocks"):
        block_ratios([[1]], [[1], [1]])


@pytest.mark.parametrize("values, expected", [
    ([1.0], 0.0),
    ([1.0, 1.0, 1.0, 1.0], 0.0),
    # MAD 0.05 over 4 blocks: 1.4826 * 0.05 * sqrt(pi/2) / 2
    ([0.95, 1.05, 0.95, 1.05], 1.4826 * 0.05 * math.sqrt(math.pi / 2) / 2),
])
def test_median_standard_error(values, expected):
    assert median_se(values) == pytest.approx(expected)


@pytest.mark.parametrize("aa, band", [
    ([1.0] * 9, 0.0),  # a quiet machine: no band
    ([1.04] * 9, 0.04),  # a systematic A/A offset is the band even without spread
    ([0.97] * 5, 0.03),
    # spread without offset: z standard errors of the median
    ([0.95, 1.05, 0.95, 1.05, 1.0], 2.0 * median_se([0.95, 1.05, 0.95, 1.05, 1.0])),
])
def test_the_aa_band_is_the_larger_of_offset_and_spread(aa, band):
    assert aa_band(aa) == pytest.approx(band)


@pytest.mark.parametrize("ratio, band, expected", [
    (1.10, 0.05, AHEAD),
    (1.05, 0.05, WITHIN),  # on the edge: still noise
    (1.00, 0.00, WITHIN),
    (1.001, 0.00, AHEAD),
    (0.97, 0.05, WITHIN),
    (0.949, 0.05, BEHIND),
    (0.80, 0.30, WITHIN),  # a very noisy run cannot call anything
])
def test_verdict_table(ratio, band, expected):
    assert verdict(ratio, band) == expected


@pytest.mark.parametrize("ratio, band", [(1.0, -0.1), (float("nan"), 0.1), (1.0, float("nan"))])
def test_verdict_refuses_nonsense(ratio, band):
    with pytest.raises(ValueError):
        verdict(ratio, band)


def test_the_noise_of_two_equal_configurations_stays_within_their_band():
    """Simulated: ours and an identical copy with 5 % noise per block; the copy's ratio against ours falls
    inside the band derived from an independent A/A column of the same noise in nearly every run."""
    import random

    rng = random.Random(7)
    inside = 0
    for _ in range(200):
        def blocks():
            return [[rng.gauss(10.0, 0.5) for _ in range(3)] for _ in range(15)]
        ours, copy, other_copy = blocks(), blocks(), blocks()
        band = aa_band(block_ratios(copy, ours))
        ratio = statistics.median(block_ratios(other_copy, ours))
        inside += verdict(ratio, band) == WITHIN
    assert inside >= 170, inside


def _three_calls() -> int:
    def inner() -> int:
        return 1
    return inner() + inner()


def test_the_call_counter_counts_python_frames_not_c_calls():
    assert calls_per_run(_three_calls, 10) == 3
    with CallCounter(detail=True) as counter:
        sorted([3, 1, 2])  # C: not counted
        _three_calls()
    assert counter.calls == 3
    assert counter.by_function[("test_benchmark_verdict.py", "inner")] == 2
