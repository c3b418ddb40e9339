"""The job's timeline file: every worker's timeline events plus the driver's membership events,
as one Chrome-trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

One trace process per worker (named by worker id, host and the ranks it held),
one thread per event category; the driver's membership history (ring formed,
worker lost or joined, recovered, ...) is process 0. The file is written
atomically (a temporary file, then a rename), so a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from ..wire.protocol import CATEGORY_THREADS
from .events import Event


class TimelineFile:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        self._events: list[dict[str, Any]] = []
        self._pids: dict[str, int] = {}
        self._hosts: dict[str, str] = {}
        self._ranks: dict[str, set[int]] = {}
        self.dropped = 0

    def check_writable(self) -> None:
        """Fail before training if the file cannot be written."""
        if self.path.is_dir():
            raise ValueError(f"ElasticTrainer timeline_path={str(self.path)!r} is a directory; give a file name "
                             "such as timeline.json")
        parent = self.path.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"ElasticTrainer timeline_path={str(self.path)!r}: the directory {str(parent)!r} does "
                             "not exist or is not writable; create it or choose another path")

    def add_worker_events(self, worker_id: str, host: str, events: list[dict[str, Any]], dropped: int) -> None:
        pid = self._pids.setdefault(worker_id, len(self._pids) + 1)
        self._hosts[worker_id] = host
        self.dropped += dropped
        for event in events:
            rank = event.get("args", {}).get("rank")
            if rank is not None:
                self._ranks.setdefault(worker_id, set()).add(rank)
            self._events.append({**event, "pid": pid, "tid": CATEGORY_THREADS.get(event.get("cat"), 9)})

    def _driver_events(self, events: list[Event]) -> list[dict[str, Any]]:
        return [{"name": e.kind, "cat": "membership", "ph": "i", "s": "g", "ts": e.time * 1e6, "pid": 0, "tid": 0,
                 "args": {"round": e.round_id, "world": e.world_size, **_jsonable(e.detail)}} for e in events]

    def _metadata(self) -> list[dict[str, Any]]:
        meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "driver (membership)"}},
                {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}]
        for worker_id, pid in self._pids.items():
            ranks = ",".join(str(r) for r in sorted(self._ranks.get(worker_id, ()))) or "-"
            meta.append({"name": "process_name", "ph": "M", "pid": pid,
                         "args": {"name": f"{worker_id} on {self._hosts[worker_id]} (ranks {ranks})"}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for category, tid in CATEGORY_THREADS.items():
                meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": category}})
        return meta

    def write(self, driver_events: list[Event]) -> pathlib.Path:
        """Write everything collected so far (atomically)."""
        body = {"traceEvents": self._metadata() + self._driver_events(driver_events) + self._events,
                "displayTimeUnit": "ms", "otherData": {"dropped_events": self.dropped}}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)
        return self.path


def _jsonable(detail: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v) for k, v in detail.items()}
