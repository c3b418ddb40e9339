"""What :meth:`ElasticTrainer.run` returns: :class:`Result`, with Ray Train's names (``metrics``,
``metrics_dataframe``, ``checkpoint``, ``error``, ``path``) beside elastic_ring's own.

The old uses keep working for a while, each with a ``DeprecationWarning`` naming the new name:
``Result.metrics`` as the list it was (an int index, a slice, iterating, ``len()``: ``metrics_history``),
``Result.checkpoint`` as the URI string it was (``checkpoint_uri``), and ``Result(metrics=[...])``
(``metrics_history=``) or ``Result(checkpoint="<uri>")`` (``checkpoint_uri=``).
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any

from .events import Event

_LIST_USE = ("Result.metrics is now the last reported record (a dict, as Ray Train's); the list of every record is "
             "Result.metrics_history: {use} Result.metrics as a list is deprecated")
_STR_USE = ("Result.checkpoint is now a ray.train.Checkpoint (as Ray Train's); using it as a string ({use}) is "
            "deprecated: the newest state checkpoint's URI is Result.checkpoint_uri, the checkpoint's own location "
            "Result.checkpoint.path")


class Metrics(dict):
    """The last record rank 0 reported (a dict). Deprecated on the way out, as on the list ``Result.metrics``
    used to be: an int index or a slice reads :attr:`Result.metrics_history`, iterating and ``len()`` see the
    dict's keys, each with a ``DeprecationWarning``. ``dict(m)``, ``{**m}``, ``.keys()``, ``.items()``, ``in``,
    ``==``, ``bool()`` and ``json.dumps`` are plain dict operations, without warnings."""

    def __init__(self, last: dict, history: list[dict]) -> None:
        super().__init__(last)
        self._history = history

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice) or (isinstance(key, int) and not isinstance(key, bool)):
            warnings.warn(_LIST_USE.format(use=f"reading Result.metrics[{key!r}] from"), DeprecationWarning,
                          stacklevel=2)
            return self._history[key]
        return super().__getitem__(key)

    def __iter__(self):
        warnings.warn(_LIST_USE.format(use="iterating (it now yields the last record's keys); iterating"),
                      DeprecationWarning, stacklevel=2)
        return super().__iter__()

    def __len__(self) -> int:
        warnings.warn(_LIST_USE.format(use="len() (now the last record's number of keys); taking len() of"),
                      DeprecationWarning, stacklevel=2)
        return super().__len__()

    def __bool__(self) -> bool:  # (without it, truth would call __len__: `if result.metrics:` stays quiet)
        return dict.__len__(self) > 0


def _checkpoint_class() -> type:
    from ray.train import Checkpoint

    return Checkpoint


_result_checkpoint_class: type | None = None


def __getattr__(name: str) -> Any:
    """``ResultCheckpoint``, made when first asked for (by :func:`result_checkpoint`, or pickle finding the class):
    importing this module does not import ``ray.train``."""
    global _result_checkpoint_class
    if name != "ResultCheckpoint":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _result_checkpoint_class is None:
        _result_checkpoint_class = _make_result_checkpoint(_checkpoint_class())
    return _result_checkpoint_class


def result_checkpoint(checkpoint: Any, legacy: str) -> Any:
    """``checkpoint`` (a ``ray.train.Checkpoint``) as Result's: the same path and filesystem, and its use as a
    string reads ``legacy`` (what ``Result.checkpoint`` was: the state checkpoint's URI) with a warning."""
    made = __getattr__("ResultCheckpoint")(checkpoint.path, filesystem=checkpoint.filesystem)
    made._legacy_uri = legacy
    return made


def _make_result_checkpoint(base: type) -> type:
    """A ray.train.Checkpoint subclass whose string uses warn and act on ``_legacy_uri`` (made on first use: ray
    is imported only then)."""

    def legacy(self: Any, use: str) -> str:
        warnings.warn(_STR_USE.format(use=use), DeprecationWarning, stacklevel=3)
        return self._legacy_uri

    def __getattr__(self, name: str) -> Any:  # only for names a Checkpoint lacks: str's methods (startswith...)
        if not name.startswith("_") and hasattr(str, name) and "_legacy_uri" in self.__dict__:
            return getattr(legacy(self, f".{name}"), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __eq__(self, other: Any) -> Any:
        if isinstance(other, str):
            return legacy(self, "== a str") == other
        return NotImplemented

    namespace = {
        "__doc__": "Result.checkpoint: a ray.train.Checkpoint; its use as a string is deprecated (checkpoint_uri).",
        "__module__": __name__,
        "__str__": lambda self: legacy(self, "str()"),
        "__fspath__": lambda self: legacy(self, "os.fspath()"),
        "__format__": lambda self, spec: format(legacy(self, "a format string"), spec),
        "__add__": lambda self, other: legacy(self, "+") + other,
        "__radd__": lambda self, other: other + legacy(self, "+"),
        "__contains__": lambda self, item: item in legacy(self, "in"),
        "__getitem__": lambda self, key: legacy(self, "[...]")[key],
        "__len__": lambda self: len(legacy(self, "len()")),
        "__bool__": lambda self: True,
        "__eq__": __eq__,
        "__hash__": object.__hash__,
        "__getattr__": __getattr__,
    }
    return type("ResultCheckpoint", (base,), namespace)


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
    ``Result(metrics=[...])`` (the list it took before) still works, with a ``DeprecationWarning``.
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
    metrics: InitVar[list | None] = None         # deprecated: the list of records (metrics_history now)

    def __post_init__(self, metrics: list | None) -> None:
        if metrics is not None:
            warnings.warn("Result(metrics=[...]) is deprecated: the list of every record is metrics_history=[...] "
                          "(Result.metrics is now the last record, a dict)", DeprecationWarning, stacklevel=3)
            if not isinstance(metrics, list):
                raise TypeError(f"Result(metrics=...) takes the list of records (deprecated; give "
                                f"metrics_history=[...]), got {type(metrics).__name__}")
            if self.metrics_history and self.metrics_history != metrics:
                raise ValueError("Result got metrics=[...] and metrics_history=[...] with different records; give "
                                 "metrics_history only")
            self.metrics_history = metrics
        if isinstance(self.checkpoint, str):
            warnings.warn("Result(checkpoint=<a URI string>) is deprecated: the URI is checkpoint_uri=...; "
                          "Result.checkpoint is a ray.train.Checkpoint", DeprecationWarning, stacklevel=3)
            uri = self.checkpoint
            if self.checkpoint_uri is None:
                self.checkpoint_uri = uri
            from .train_api import as_ray_checkpoint

            self.checkpoint = result_checkpoint(as_ray_checkpoint(uri), uri)
        elif self.checkpoint is not None and "_legacy_uri" not in getattr(self.checkpoint, "__dict__", {}):
            from .train_api import checkpoint_url

            self.checkpoint = result_checkpoint(self.checkpoint, self.checkpoint_uri or checkpoint_url(self.checkpoint))

    def _metrics(self) -> Metrics:
        """The last record rank 0 reported (its metrics with ``time``, ``rank``, ``round``, ``world_size``, ``step``,
        ``epoch``, ``samples``, ``driver_time``); ``{}`` when nothing was reported (Ray Train: None)."""
        return Metrics(self.metrics_history[-1] if self.metrics_history else {}, self.metrics_history)

    @property
    def metrics_dataframe(self) -> Any:
        """Every record of :attr:`metrics_history` as a pandas DataFrame, one row per record."""
        import pandas

        return pandas.DataFrame(self.metrics_history)


# the InitVar's default was captured by the generated __init__; the name now reads the last record
Result.metrics = property(Result._metrics, doc=Result._metrics.__doc__)  # type: ignore[assignment]
