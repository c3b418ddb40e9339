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
positions is cut into ``ceil(S / (world * batch_size))`` consecutive micro-batch
chunks (``M`` for a regular step; more for the epoch's last step when a tail
was folded into it, so no rank ever takes more than ``batch_size`` per pass),
but never more than ``S // world`` (so no pass is empty on any rank: with
``batch_size=1`` and ``G`` not a multiple of the world size, a pass may then
take 2). Chunk sizes differ by at most one (larger first), and each chunk is
shared over the ranks as above. :func:`global_steps` lists the chunks' global
sizes per step; progress stays one integer.
"""

from __future__ import annotations

from elastic_ring.ring import runtime


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


def chunks_per_step(step_size: int, world: int, batch_size: int) -> int:
    """Backward passes per rank for a global step of ``step_size`` samples: enough that no rank takes more than
    ``batch_size`` in one pass, but never so many that a pass is empty on some rank (at most ``step_size // world``;
    a step with fewer samples than ranks has one pass, empty on the ranks it cannot reach)."""
    if step_size < 0 or world < 1 or batch_size < 1:
        raise ValueError(f"step_size={step_size}, world={world}, batch_size={batch_size} must be >= 0, >= 1, >= 1")
    need = -(-step_size // (world * batch_size))
    return max(1, min(need, step_size // world))


def micro_batches(global_batch_size: int, world: int, batch_size: int) -> int:
    """Micro-batches per rank in a regular global step (one of ``global_batch_size`` samples)."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
    return chunks_per_step(global_batch_size, world, batch_size)


def global_steps(remaining: int, world: int, batch_size: int, global_batch_size: int) -> list[list[int]]:
    """The remaining global steps, each as the global sizes of its micro-batch chunks (larger first)."""
    steps = []
    for size in step_sizes(remaining, 1, global_batch_size):
        parts = chunks_per_step(size, world, batch_size)
        steps.append([share(size, parts, j)[1] for j in range(parts)])
    return steps


def micro_step_sizes(remaining: int, world: int, batch_size: int, global_batch_size: int) -> list[int]:
    """Global sizes of the remaining micro-batch chunks, flattened over the steps of :func:`global_steps`."""
    return [chunk for step in global_steps(remaining, world, batch_size, global_batch_size) for chunk in step]


def ring_position(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """``(rank, world)``: as given, else the current ring's (0 and 1 without a ring); checked."""
    if rank is None or world is None:
        comm = runtime.current_or_none()
        rank, world = (comm.rank, comm.size) if comm is not None else (0, 1)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not in 0..{world - 1}")
    return rank, world
