"""``er.report(**metrics)``: training metrics from workers, through a pluggable reporter.

The worker runtime installs a reporter that forwards rank 0's metrics to the
driver (``ElasticTrainer``'s ``result.metrics`` and progress line). Without
one, metrics are logged. Each report carries the rank, round, world size and
wall time, and the step, epoch and samples of :mod:`elastic_ring.core.progress`
unless the caller reports its own.
"""

from __future__ import annotations

import numbers
import time
from typing import Any, Callable

from ..core import progress
from ..core.log import get_logger
from . import runtime

_log = get_logger(__name__)

Reporter = Callable[[dict[str, Any]], None]
_reporter: Reporter | None = None


def set_reporter(reporter: Reporter | None) -> None:
    """Install where reports go (the worker runtime does this); None restores logging."""
    global _reporter
    _reporter = reporter


def current_reporter() -> Reporter | None:
    """Where reports go in this process (None: logged)."""
    return _reporter


def report(**metrics: Any) -> None:
    """Report metrics (numbers or short strings) of this step, e.g. ``er.report(loss=0.3, epoch=2)``."""
    for key, value in metrics.items():
        if not isinstance(value, (numbers.Number, str, bool)):
            raise TypeError(f"er.report({key}=...) got a {type(value).__name__}; report numbers or strings "
                            "(use float(tensor) for a scalar tensor)")
    comm = runtime.current_or_none()
    record = {"time": time.time(), "rank": comm.rank if comm else 0, "round": comm.spec.round_id if comm else None,
              "world_size": comm.size if comm else 1, **progress.current(), **metrics}
    if _reporter is None:
        _log.info("report %s", metrics)
    else:
        _reporter(record)
