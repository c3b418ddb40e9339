"""Logging with identity: every line carries ``[rank 2/4 round 7 step 130]``.

The rank and round come from the current ring; the step from
:mod:`elastic_ring.core.progress` (the state layer's sampler sets it). Nothing here
configures handlers: applications decide where logs go.
"""

from __future__ import annotations

import logging

from . import identity as ring_identity, progress

def identity() -> str:
    """``[rank 2/4 round 7 step 130]``, or ``[no ring]`` before the first round."""
    ring = ring_identity.current()
    text = "no ring" if ring is None else ring.text
    step = progress.current().get("step")
    if step is not None:
        text += f" step {step}"
    return f"[{text}]"


class _IdentityAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{identity()} {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger whose lines start with this process's identity."""
    return _IdentityAdapter(logging.getLogger(name), {})
