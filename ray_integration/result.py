"""What :meth:`ElasticTrainer.run` returns: :class:`Result`, with Ray Train's names (``metrics``,
``metrics_dataframe``, ``checkpoint``, ``error``, ``path``) beside elastic_ring's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .driver.events import Event


@dataclass
class Result:
    """What :meth:`ElasticTrainer.run` returns: a completed run, or one that was stopped.

    ``completed``: ``fn`` returned on rank 0 of the final ring (``value`` is what it returned).
    ``stopped``: the run ended because of a stop (SIGTERM to the driver, or :meth:`ElasticTrainer.stop`)
    before ``fn`` completed; ``stop_reason`` says which. A clean stop ends at a commit, written as a
    durable checkpoint (``checkpoint_uri``) when the run has a location; a ``forced`` one (a second stop,
    or the workers not reaching a commit within ``stop_timeout_s``) killed the workers and
    ``abandoned`` says what training was lost. ``checkpoint_error`` is set when the last durable
    write (the final flush) failed: ``checkpoint_uri`` is then an older checkpoint.

    Ray Train's names: ``metrics`` (the last reported record), ``metrics_dataframe``, ``checkpoint``
    (a ``ray.train.Checkpoint``: the newest reported checkpoint, else the newest state checkpoint),
    ``error`` (always None: a failed run raises from ``run()``), ``path`` (the run's location).
    """

    value: Any                                   # what fn returned on rank 0 of the final ring (None if stopped)
    metrics_history: list[dict] = field(default_factory=list)  # rank 0's report records, oldest first
    events: list[Event] = field(default_factory=list)   # membership history
    checkpoint_uri: str | None = None            # URI of the newest durable state checkpoint
    checkpoint: Any = None                       # ray.train.Checkpoint: newest reported, else newest state checkpoint
    completed: bool = True                       # fn returned on rank 0
    stopped: bool = False                        # ended by a stop before fn completed
    stop_reason: str | None = None               # what asked for the stop ("SIGTERM", stop()'s reason), if any
    forced: bool = False                         # the stop was abandoned: the workers were killed, not at a commit
    abandoned: str | None = None                 # for a forced stop: which training was lost (and how to resume)
    checkpoint_error: str | None = None          # the final checkpoint flush failed: why
    message: str | None = None                   # the line printed to stderr for a stopped run
    path: str | None = None                      # the run's location (checkpoint_uri / storage_path/name)
    error: BaseException | None = None           # None: run() raises a failure instead of returning it

    @property
    def metrics(self) -> dict:
        """The last record rank 0 reported (its metrics with ``time``, ``rank``, ``round``, ``world_size``, ``step``,
        ``epoch``, ``samples``, ``driver_time``); ``{}`` when nothing was reported (Ray Train: None)."""
        return dict(self.metrics_history[-1]) if self.metrics_history else {}

    @property
    def metrics_dataframe(self) -> Any:
        """Every record of :attr:`metrics_history` as a pandas DataFrame, one row per record."""
        import pandas

        return pandas.DataFrame(self.metrics_history)

