"""Bucket-size autotuning for DistributedOptimizer (as Horovod's autotuner, on one knob).

During the first steps of every ring the reducer tries a few bucket sizes,
measures the step time under each, and keeps the fastest. The decision must be
identical on every rank, or the ranks would send buckets of different sizes;
so every number the decision uses is agreed on: each candidate's score is the
median of its sampled step times on the *slowest* rank, obtained by riding in
the per-step cross-rank check of the next step (a MAX slot; no extra round
trip). The schedule is a pure function of the number of steps taken in the
ring, which all ranks share, and a new ring starts over (its world size, and
so its best size, may differ; joiners and survivors then agree trivially).

Schedule, with ``L = warmup + samples`` steps per candidate ``c``:

* steps ``[c*L, (c+1)*L)`` use candidate ``c``; the durations of the last
  ``samples`` of them are measured (a duration runs from the end of one
  step's reduction to the end of the next, so it covers the whole step);
* at the end of step ``(c+1)*L - 1`` the local median is ready; the check of
  step ``(c+1)*L`` carries it and brings back the maximum over ranks;
* after the last candidate, the best size agreed so far is used until the last
  score arrives; then :func:`choose` picks the final size for the ring.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence


@dataclass(frozen=True)
class AutotuneResult:
    """What the autotuner tried and chose (``opt.autotune_result``)."""

    candidates: tuple[int, ...]   #: bucket sizes tried, in bytes, in order
    step_ms: tuple[float, ...]    #: each one's median step time on the slowest rank
    chosen_bytes: int             #: the bucket size used from then on
    tuning_steps: int             #: steps of the ring spent tuning


def distinct_candidates(sizes: Sequence[int], default: int, plan_of: Callable[[int], Hashable]) -> list[int]:
    """``sizes`` plus ``default``, ascending, keeping one size per distinct bucket plan.

    When several sizes give the same plan, the one that is ``default`` is kept, else the smallest.
    """
    ordered = sorted(set(sizes) | {default})
    by_plan: dict[Hashable, int] = {}
    for size in ordered:
        plan = plan_of(size)
        if plan not in by_plan or size == default:
            by_plan[plan] = size
    return sorted(by_plan.values())


def choose(candidates: Sequence[int], times: Sequence[float], default: int, margin: float) -> int:
    """The fastest candidate, unless ``default`` is within ``margin`` of it (then the default)."""
    if len(candidates) != len(times) or not candidates:
        raise ValueError(f"need one time per candidate, got {len(candidates)} candidates and {len(times)} times")
    best = min(range(len(times)), key=lambda k: (times[k], k))
    if default in candidates and times[candidates.index(default)] <= times[best] * (1 + margin):
        return default
    return candidates[best]


class Autotuner:
    """The schedule above; feed it each step's duration and each step's agreed value."""

    def __init__(self, candidates: Sequence[int], default: int, warmup_steps: int, sample_steps: int, margin: float) -> None:
        if not candidates:
            raise ValueError("the autotuner needs at least one candidate bucket size")
        if warmup_steps < 1 or sample_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} and sample_steps={sample_steps} must be >= 1")
        self.candidates = list(candidates)
        self.default = default if default in self.candidates else self.candidates[0]
        self._warmup, self._samples, self._margin = warmup_steps, sample_steps, margin
        self._step = 0                       # steps completed in this ring
        self._durations: list[float] = []    # sampled durations of the current candidate (seconds)
        self._agreed: list[float] = []       # scores agreed so far, in candidate order (seconds)
        self._outgoing = 0                   # microseconds to send in the next check (0: nothing)
        self.result: AutotuneResult | None = None
        self.current = self.candidates[0]
        if len(self.candidates) == 1:
            self.result = AutotuneResult(tuple(self.candidates), (), self.current, 0)

    @property
    def done(self) -> bool:
        return self.result is not None

    def outgoing(self) -> int:
        """The value for this step's check (a median in microseconds, or 0)."""
        return self._outgoing

    def incoming(self, value: int) -> None:
        """This step's check came back with ``value``, the maximum over ranks of what they sent."""
        if self._outgoing:
            self._agreed.append(value / 1e6)
            self._outgoing = 0

    def end_step(self, seconds: float | None) -> int | None:
        """The step ended, ``seconds`` after the previous one (None: unknown). Returns a new bucket size to switch to, or None."""
        if self.done:
            return None
        length = self._warmup + self._samples
        candidate, position = divmod(self._step, length)
        self._step += 1
        if candidate < len(self.candidates):
            if position >= self._warmup and seconds is not None:
                self._durations.append(seconds)
            if position == length - 1:
                local = statistics.median(self._durations) if self._durations else 0.0
                self._outgoing = max(1, int(local * 1e6))
                self._durations = []
                upcoming = self.candidates[candidate + 1] if candidate + 1 < len(self.candidates) else self._best_so_far()
                return self._switch(upcoming)
            return None
        if len(self._agreed) == len(self.candidates):
            chosen = choose(self.candidates, self._agreed, self.default, self._margin)
            self.result = AutotuneResult(tuple(self.candidates), tuple(t * 1e3 for t in self._agreed), chosen, self._step)
            return self._switch(chosen)
        return None

    def _best_so_far(self) -> int:
        if not self._agreed:
            return self.default
        known = self.candidates[: len(self._agreed)]
        return choose(known, self._agreed, self.default, self._margin)

    def _switch(self, size: int) -> int | None:
        if size == self.current:
            return None
        self.current = size
        return size
