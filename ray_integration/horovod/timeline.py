"""``hvd.start_timeline(file_path, mark_cycles=False)`` / ``hvd.stop_timeline()``: Horovod's dynamic timeline.

Between the two calls, rank 0 (Horovod's coordinator writes the timeline) records :mod:`elastic_ring.core.timeline`
events (collectives from launch to completion, fusion, commit / sync, membership) and writes them to the file as
it goes, as Horovod's does: a background thread appends what was recorded every :data:`FLUSH_S` seconds, so the
process holds at most that much, and a process killed mid-run (SIGKILL) leaves a trace of everything but its last
moments. The file is Chrome's trace *JSON Array Format* (a JSON array of events; open it in
https://ui.perfetto.dev or chrome://tracing): the format lets a trace end without its closing ``]``, which is how
a killed run leaves it, and viewers load it so; ``stop_timeline()`` writes the ``]``, so a stopped trace is
plain JSON (``json.load`` gives the list of events). One trace process (rank 0), one thread per event category,
as ``ElasticTrainer(timeline_path=...)``'s file (:mod:`ray_integration.driver.timeline`, which has every rank). The
other ranks record nothing. ``mark_cycles`` is accepted: elastic_ring has no background cycle to mark, so it adds
no events.

The events are copied as they are recorded (a timeline listener, :func:`elastic_ring.core.timeline.add_listener`),
so the job's own timeline, when ``ElasticTrainer(timeline_path=...)`` turned it on, still gets every event too.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
import warnings
from typing import Any

import elastic_ring as er
from elastic_ring.core import timeline as _timeline

from ..wire.protocol import CATEGORY_THREADS
from .topology import rank

#: How often rank 0's writer thread appends the recorded events to the file (seconds).
FLUSH_S = 0.5


class _Recording:
    """The timeline being recorded on this process (None: none): the open file and its writer thread."""

    current: "_Recording | None" = None
    lock = threading.Lock()

    def __init__(self, path: pathlib.Path, enabled_here: bool) -> None:
        self.path, self.enabled_here = path, enabled_here
        self._pending: list[dict[str, Any]] = []
        self._pending_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._error: OSError | None = None
        self._first = True
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - held open while recording
        self._append(self._metadata())
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._run, name="hvd-timeline-writer", daemon=True)
        self._writer.start()

    def __call__(self, event: dict[str, Any]) -> None:
        """The timeline listener: queue the event for the writer thread."""
        with self._pending_lock:
            self._pending.append(event)

    def _metadata(self) -> list[dict[str, Any]]:
        ring = f"rank {er.rank()}" if er.is_initialized() else "rank 0"
        meta = [{"name": "process_name", "ph": "M", "pid": 1,
                 "args": {"name": f"hvd timeline: {ring} on {socket.gethostname()}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": category}}
                 for category, tid in CATEGORY_THREADS.items()]
        return meta

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        with self._pending_lock:
            events, self._pending = self._pending, []
        self._append([{**e, "pid": 1, "tid": CATEGORY_THREADS.get(e.get("cat"), 9)} for e in events])

    def _append(self, events: list[dict[str, Any]]) -> None:
        """Write ``events`` after those written so far (each preceded by ``[`` or ``,``: the array stays
        loadable whenever the process dies)."""
        if not events:
            return
        with self._write_lock:
            if self._error is not None:
                return
            parts = []
            for event in events:
                parts.append(("[\n" if self._first else ",\n") + json.dumps(event, default=str))
                self._first = False
            try:
                self._file.write("".join(parts))
                self._file.flush()
            except OSError as exc:  # reported by stop_timeline(); recording goes on without the file
                self._error = exc

    def close(self) -> None:
        """Stop the writer, append what is left and the closing ``]``."""
        self._stop.set()
        self._writer.join(timeout=30)
        self._flush()
        with self._write_lock:
            try:
                if self._error is None:
                    self._file.write("[\n]\n" if self._first else "\n]\n")
                self._file.close()
            except OSError as exc:
                self._error = self._error or exc
        if self._error is not None:
            warnings.warn(f"hvd.stop_timeline(): writing {str(self.path)!r} failed ({self._error}); the trace "
                          "there stops where the error happened", RuntimeWarning, stacklevel=3)


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
    """Begin recording this job's timeline to ``file_path`` (rank 0 writes it as it goes, closed by
    :func:`stop_timeline`). A second call switches to the new file, as Horovod's: the first one is closed."""
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
    """Stop recording: the rest of the events and the closing ``]`` are written (rank 0; a no-op where nothing is
    recorded)."""
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
    recording.close()
