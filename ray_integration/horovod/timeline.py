"""``hvd.start_timeline(file_path, mark_cycles=False)`` / ``hvd.stop_timeline()``: Horovod's dynamic timeline.

Between the two calls, rank 0 (Horovod's coordinator writes the timeline) records :mod:`elastic_ring.core.timeline`
events (collectives from launch to completion, fusion, commit / sync, membership) and ``stop_timeline()`` writes
them as one Chrome-trace JSON file (the format of ``ElasticTrainer(timeline_path=...)``,
:mod:`ray_integration.timeline_file`; open it in https://ui.perfetto.dev or chrome://tracing). The other ranks
record nothing. ``mark_cycles`` is accepted: elastic_ring has no background cycle to mark, so it adds no events.

The events are copied as they are recorded (a timeline listener, :func:`elastic_ring.core.timeline.add_listener`),
so the job's own timeline, when ``ElasticTrainer(timeline_path=...)`` turned it on, still gets every event too.
"""

from __future__ import annotations

import os
import pathlib
import socket
import threading
from typing import Any

import elastic_ring as er
from elastic_ring.core import timeline as _timeline

from ..timeline_file import TimelineFile
from .topology import rank


class _Recording:
    """The timeline being recorded on this process (None: none)."""

    current: "_Recording | None" = None
    lock = threading.Lock()

    def __init__(self, path: pathlib.Path, enabled_here: bool) -> None:
        self.path, self.enabled_here = path, enabled_here
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        """The timeline listener: keep the event."""
        self.events.append(event)


def _check_path(file_path: Any) -> pathlib.Path:
    if not isinstance(file_path, (str, os.PathLike)):
        raise ValueError(f"start_timeline(file_path={file_path!r}) needs a file path (str)")
    path = pathlib.Path(file_path)
    if path.is_dir():
        raise ValueError(f"start_timeline(file_path={str(path)!r}) is a directory; give a file name such as "
                         "timeline.json")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"start_timeline(file_path={str(path)!r}): the directory {str(path.parent)!r} does not "
                         "exist or is not writable")
    return path


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Begin recording this job's timeline to ``file_path`` (written by rank 0 at :func:`stop_timeline`). A
    second call switches to the new file, as Horovod's: what was recorded so far is written first."""
    me = rank()  # ValueError before hvd.init(), as Horovod's
    if not isinstance(mark_cycles, bool):
        raise ValueError(f"mark_cycles={mark_cycles!r} must be True or False")
    path = _check_path(file_path)
    if me != 0:
        return
    with _Recording.lock:
        if _Recording.current is not None:
            _stop_locked()
        recording = _Recording(path, enabled_here=not _timeline.is_enabled())
        _timeline.add_listener(recording)
        if recording.enabled_here:
            _timeline.enable()
        _Recording.current = recording


def stop_timeline() -> None:
    """Stop recording and write the file (rank 0; a no-op where nothing is recorded)."""
    rank()  # ValueError before hvd.init(), as Horovod's
    with _Recording.lock:
        if _Recording.current is not None:
            _stop_locked()


def _stop_locked() -> None:
    recording = _Recording.current
    _Recording.current = None
    _timeline.remove_listener(recording)
    if recording.enabled_here:
        _timeline.disable()  # ours: the events nobody else drains go too
    trace = TimelineFile(recording.path)
    ring = f"rank {er.rank()}" if er.is_initialized() else "rank 0"
    trace.add_worker_events(ring, socket.gethostname(), list(recording.events), 0)
    trace.write([])
