"""A step's agreement, carried inside its last gradient bucket (no collective of its own).

In a steady-state step the ranks must still agree on three things before the
update is applied: that they reduced the same bucket plan, that they are at the
same optimizer step (a transaction id), and whether any rank asked for a step
boundary. A separate 48-byte check per step does this at the cost of a
collective and a wait on it before the first bucket may go out. Here the same
facts ride at the end of the last bucket's wire buffer, as exact small integers
that the bucket's SUM reduces along with the gradients:

* slot 0: 1 from every rank; the sum must be the world size (anything else means
  the bucket met a different collective on some rank: the ring is not trusted);
* slot 1: the rank's boundary flag (0/1); the sum is > 0 iff any rank asked;
* slots 2..33: the 32 low bits of the plan digest, one bit per slot; every sum
  must be 0 or the world size (all ranks have the same bit);
* slot 34: 1 from a rank whose applied-step count is compared in this ring
  (0 from a rank that joined without a re-based count), the count ``n``;
* slots 35..66: the 32 low bits of that step, one per slot; each sum must be
  0 or ``n``.

Every partial sum is an integer no larger than the world size, so the
reduction is exact in any float dtype whose integers are exact up to that size
(:func:`supports`); the slots never touch the gradients (they follow them).
:func:`decode` is a pure function of the summed slots and the world size. The
reducer treats a plan that differs as foreign data too: a step rides in its last
bucket only after a leading check of the ring agreed on the plan, so honest
ranks cannot differ there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BITS = 32
SLOTS = 3 + 2 * BITS
_MASK = (1 << BITS) - 1
_NO_STEP = (0.0,) * (1 + BITS)

#: The largest world size whose counts a dtype sums exactly (every integer up to it is representable).
_EXACT_UP_TO = {torch.float64: 1 << 53, torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


def supports(dtype: torch.dtype, world_size: int) -> bool:
    """Whether a wire buffer of ``dtype`` can carry the trailer exactly for ``world_size`` ranks."""
    return world_size <= _EXACT_UP_TO.get(dtype, 0)


@functools.lru_cache(maxsize=64)
def _bits(value: int) -> tuple[float, ...]:
    """The 32 low bits of ``value``, lowest first, as floats (cached: a plan's digest is encoded every step)."""
    return tuple(float((value >> k) & 1) for k in range(BITS))


def encode(digest: int, step: int | None, boundary: bool) -> list[float]:
    """This rank's slots: presence, boundary flag, the digest's bits, then the step's (if compared)."""
    head = [1.0, 1.0 if boundary else 0.0]
    head += _bits(digest & _MASK)
    if step is None:
        head += _NO_STEP
    else:
        head.append(1.0)
        head += [float(((step & _MASK) >> k) & 1) for k in range(BITS)]
    return head


@dataclass(frozen=True)
class Verdict:
    """What the summed slots say. ``foreign``: the bucket did not pair with this step's bucket on every
    rank (then nothing else is meaningful). ``same_plan`` / ``same_step``: every rank reduced the same
    plan / every compared rank is at the same step. ``boundary``: some rank asked for a step boundary."""

    foreign: bool
    same_plan: bool
    same_step: bool
    boundary: bool

    @property
    def agreed(self) -> bool:
        return not self.foreign and self.same_plan and self.same_step


def decode(sums: list[float], world_size: int, digest: int | None = None, step: int | None = None) -> Verdict:
    """Read the reduced slots of a world of ``world_size`` ranks. With this rank's own ``digest`` (and
    ``step``, if it sent one), every rank must have sent exactly those: data that merely looks consistent
    (a foreign all-ones tensor) does not pass for agreement."""
    if len(sums) != SLOTS or any(s != s for s in sums):  # NaN: the slots met foreign data
        return Verdict(True, False, False, False)
    values = [int(s) if float(s).is_integer() else -1 for s in sums]
    present, boundary, plan_bits, compared, step_bits = (values[0], values[1], values[2:2 + BITS], values[2 + BITS],
                                                         values[3 + BITS:])
    if present != world_size or not 0 <= boundary <= world_size or not 0 <= compared <= world_size:
        return Verdict(True, False, False, False)
    if any(v < 0 or v > world_size for v in plan_bits) or any(v < 0 or v > compared for v in step_bits):
        return Verdict(True, False, False, False)  # sums no honest ranks can produce
    if digest is None:
        same_plan = all(v in (0, world_size) for v in plan_bits)
    else:
        same_plan = plan_bits == [world_size * ((digest >> k) & 1) for k in range(BITS)]
    if step is None:
        same_step = all(v in (0, compared) for v in step_bits)
    else:
        same_step = step_bits == [compared * (((step & _MASK) >> k) & 1) for k in range(BITS)]
    return Verdict(False, same_plan, same_step, boundary > 0)
