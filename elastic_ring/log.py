"""Logging with identity: every line carries ``[rank 2/4 round 7 step 130]``.

The rank and round come from the current ring; the step is set by whoever
drives training (the state layer) through :func:`set_step`. Nothing here
configures handlers: applications decide where logs go.
"""

from __future__ import annotations

import logging

_step: int | None = None


def set_step(step: int | None) -> None:
    """Record the training step that log lines of this process should show."""
    global _step
    _step = step


def identity() -> str:
    """``[rank 2/4 round 7 step 130]``, or ``[no ring]`` before the first round."""
    from . import runtime  # late: runtime imports this module

    comm = runtime.current_or_none()
    if comm is None:
        text = "no ring"
    else:
        text = comm.spec.identity
    if _step is not None:
        text += f" step {_step}"
    return f"[{text}]"


class _IdentityAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{identity()} {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger whose lines start with this process's identity."""
    return _IdentityAdapter(logging.getLogger(name), {})
