"""This process's training progress: step, epoch and samples processed.

The state layer's ``ElasticSampler`` sets it after every recorded batch (and
after a restore or sync puts an older position back); a script without that
sampler can call :func:`set_progress` itself. Log lines show the step
(``[rank 0/2 round 3 step 130]``) and ``er.report`` records carry all three,
which is how the driver's progress display computes samples per second.
"""

from __future__ import annotations

_progress: dict[str, int] = {}


def set_progress(step: int | None = None, epoch: int | None = None, samples: int | None = None) -> None:
    """Record the global ``step``, the ``epoch`` and ``samples`` (processed by the whole ring since the
    job began); None leaves a field unchanged."""
    for name, value in (("step", step), ("epoch", epoch), ("samples", samples)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"set_progress {name}={value!r} must be an int >= 0")
        _progress[name] = value


def current() -> dict[str, int]:
    """A copy of what is known: some of ``step``, ``epoch``, ``samples``."""
    return dict(_progress)


def clear() -> None:
    """Forget the progress (a worker does this before running a new job)."""
    _progress.clear()
