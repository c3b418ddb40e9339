"""Small pure policies: they look at numbers and return decisions; they do nothing."""

from __future__ import annotations

from dataclasses import dataclass


def workers_to_request(live: int, max_workers: int) -> int:
    """Keep up to ``max_workers`` actors requested; pending ones show the autoscaler the demand."""
    return max(0, max_workers - live)


def should_grow(world_size: int, ready_joiners: int, max_workers: int, change_pending: bool) -> bool:
    """Ask the ring to re-form at its next commit when a fully started joiner waits and there is room."""
    return not change_pending and ready_joiners > 0 and world_size < max_workers


def ready_to_start(ready: int, started: int, min_workers: int, max_workers: int, quiet_s: float, grace_s: float) -> bool:
    """Form the first ring once ``min_workers`` are ready and either every started actor is
    ready, ``max_workers`` are, or no new one became ready for ``grace_s``."""
    if ready < min_workers:
        return False
    return ready >= max_workers or ready >= started or quiet_s >= grace_s


@dataclass(frozen=True)
class FailureDecision:
    give_up: bool
    message: str = ""


def after_failure(failures: int, max_failures: int) -> FailureDecision:
    """Count a failure against ``max_failures``."""
    if failures > max_failures:
        return FailureDecision(True, f"{failures} failures exceed max_failures={max_failures}; "
                                     "raise max_failures or look at why workers keep failing")
    return FailureDecision(False)


def persist_before_leaving(remaining: int, min_workers: int) -> bool:
    """Write a durable checkpoint at the drain commit when the ring left behind would be too small."""
    return remaining < min_workers
