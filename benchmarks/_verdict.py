"""A benchmark row's verdict against its own noise (pure functions; ``tests/test_benchmark_verdict.py``).

``benchmarks.step`` interleaves blocks of steps of several methods in the same processes. For a row:

* the baseline (DDP) has two configurations; the faster one is chosen **once per row**, by the median of all
  its steps (:func:`faster_config`). Taking the faster of two in every block, as before, picks the minimum of
  two noisy timings of about the same speed, which is biased low by about half a standard deviation: a few
  percent against us on a noisy machine;
* a block's ratio is the baseline's median step / ours (above 1: ours is faster); the row's ratio is the median
  over blocks (:func:`block_ratios`);
* an **A/A** column times a second, identical copy of ours in the same interleaving. Its ratio against ours
  would be exactly 1 on a quiet machine; what it is instead measures the run's own spread. The band
  (:func:`aa_band`) is the larger of the A/A ratio's distance from 1 and ``z`` standard errors of its median
  (from the median absolute deviation of the blocks' A/A ratios);
* :func:`verdict`: ours is ``ahead`` or ``behind`` only outside that band, else ``within A/A``.
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

AHEAD, BEHIND, WITHIN = "ahead", "behind", "within A/A"

#: Standard errors of the A/A median on each side of 1 that still count as noise.
Z = 2.0


def faster_config(configs: Mapping[str, Sequence[Sequence[float]]]) -> str:
    """The configuration (name -> blocks of step times) with the lowest median over all of its steps."""
    if not configs:
        raise ValueError("faster_config needs at least one configuration")
    medians = {}
    for name, blocks in configs.items():
        steps = [t for block in blocks for t in block]
        if not steps:
            raise ValueError(f"configuration {name!r} has no step times")
        medians[name] = statistics.median(steps)
    return min(medians, key=lambda name: (medians[name], name))


def block_ratios(baseline: Sequence[Sequence[float]], ours: Sequence[Sequence[float]]) -> list[float]:
    """Per block: the baseline's median step time / ours (above 1: ours is faster in that block)."""
    if len(baseline) != len(ours) or not ours:
        raise ValueError(f"block_ratios needs the same number of blocks (> 0), got {len(baseline)} and {len(ours)}")
    return [statistics.median(b) / statistics.median(o) for b, o in zip(baseline, ours)]


def median_se(values: Sequence[float]) -> float:
    """The standard error of the median of ``values``, from their median absolute deviation (robust to a few
    outlying blocks): 1.4826 MAD estimates the spread of normal noise, sqrt(pi/2) of it over sqrt(n) is the
    median's standard error. 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    centre = statistics.median(values)
    mad = statistics.median([abs(v - centre) for v in values])
    return 1.4826 * mad * math.sqrt(math.pi / 2) / math.sqrt(n)


def aa_band(aa_ratios: Sequence[float], z: float = Z) -> float:
    """Half-width of the A/A band around 1.0: max(|median - 1|, z * standard error of the median)."""
    if not aa_ratios:
        raise ValueError("aa_band needs at least one A/A block ratio")
    return max(abs(statistics.median(aa_ratios) - 1.0), z * median_se(aa_ratios))


def verdict(ratio: float, band: float) -> str:
    """``ahead`` if ``ratio`` is above 1 + band, ``behind`` if below 1 - band, else ``within A/A``."""
    if band < 0 or math.isnan(band) or math.isnan(ratio):
        raise ValueError(f"verdict needs a ratio and a band >= 0, got ratio={ratio!r}, band={band!r}")
    if ratio > 1.0 + band:
        return AHEAD
    if ratio < 1.0 - band:
        return BEHIND
    return WITHIN
