"""Checks of option values shared by every layer: each error names the owner, the field, the value and the fix.

``True`` is an ``int`` in Python and ``nan`` compares false with everything, so
naive ``isinstance``/``>`` checks let both through; these do not.
"""

from __future__ import annotations

import math
from typing import Any


def _label(owner: str, name: str) -> str:
    """``RingSpec.rank`` (owner given with a trailing dot) or ``ElasticTrainer min_workers``."""
    return f"{owner}{name}" if owner.endswith(".") else f"{owner} {name}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(owner: str, name: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              hint: str = "") -> int:
    """``value`` if it is a whole int (not a bool) within ``[minimum, maximum]``; else ValueError."""
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = []
        if minimum is not None:
            bounds.append(f">= {minimum}")
        if maximum is not None:
            bounds.append(f"<= {maximum}")
        want = "an int" + (" " + " and ".join(bounds) if bounds else "")
        raise ValueError(f"{_label(owner, name)}={value!r} must be {want}" + (f"; {hint}" if hint else ""))
    return value


def check_number(owner: str, name: str, value: Any, minimum: float = 0.0, allow_equal: bool = False,
                 unit: str = "", hint: str = "") -> float:
    """``value`` if it is a finite number (not a bool) above ``minimum`` (or equal, with ``allow_equal``)."""
    ok = is_number(value) and (value >= minimum if allow_equal else value > minimum)
    if not ok:
        what = f"a finite number{' of ' + unit if unit else ''} {'>=' if allow_equal else '>'} {minimum:g}"
        raise ValueError(f"{_label(owner, name)}={value!r} must be {what}" + (f"; {hint}" if hint else ""))
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_label(owner, name)}={value!r} must be True or False")
    return value
