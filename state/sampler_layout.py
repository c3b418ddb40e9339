"""Pure layout of an epoch's remaining samples over a ring: which rank takes which positions.

The remaining positions ``[processed, n)`` of the epoch's permutation are cut
into *global steps* of ``batch_size * world`` positions; a tail that does not
fill a step is folded into the last step, so every rank has the same number of
steps (lock step: every rank calls the optimizer the same number of times).
Within a step, rank ``r`` takes a contiguous share of ``q`` or ``q + 1``
positions. After ``k`` steps, exactly the first ``sum(step_sizes[:k])``
remaining positions are processed, whatever the world size: the progress of an
epoch is one integer, and re-partitioning after a resize or a rollback is
exact.
"""

from __future__ import annotations


def step_sizes(remaining: int, world: int, batch_size: int) -> list[int]:
    """Global sizes of the remaining steps (positions per step, summed over ranks)."""
    if remaining < 0 or world < 1 or batch_size < 1:
        raise ValueError(f"remaining={remaining}, world={world}, batch_size={batch_size} must be >= 0, >= 1, >= 1")
    per_step = world * batch_size
    full, tail = divmod(remaining, per_step)
    if full == 0:
        return [tail] if tail else []
    sizes = [per_step] * full
    sizes[-1] += tail
    return sizes


def share(step_size: int, world: int, rank: int) -> tuple[int, int]:
    """``(offset, count)`` of ``rank``'s positions within a step of ``step_size`` positions."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not in 0..{world - 1}")
    q, extra = divmod(step_size, world)
    return rank * q + min(rank, extra), q + (1 if rank < extra else 0)
