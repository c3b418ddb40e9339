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

With a constant global batch ``G`` the global steps are ``G`` positions each
(the tail folded the same way), whatever the world size; each step of ``S``
positions is cut into ``M = ceil(G / (world * batch_size))`` consecutive
micro-batch chunks (sizes differing by at most one, larger first), and each
chunk is shared over the ranks as above. :func:`micro_step_sizes` lists the
chunks' global sizes, ``M`` per global step, so progress stays one integer.
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


def micro_batches(global_batch_size: int, world: int, batch_size: int) -> int:
    """``M``: micro-batches per rank per global step, so that no rank takes more than ``batch_size`` per pass."""
    if global_batch_size < 1 or world < 1 or batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size}, world={world}, batch_size={batch_size} must be >= 1")
    return -(-global_batch_size // (world * batch_size))


def micro_step_sizes(remaining: int, world: int, batch_size: int, global_batch_size: int) -> list[int]:
    """Global sizes of the remaining micro-batch chunks: ``M`` per global step of ``global_batch_size``."""
    parts = micro_batches(global_batch_size, world, batch_size)
    return [share(size, parts, j)[1] for size in step_sizes(remaining, 1, global_batch_size) for j in range(parts)]
