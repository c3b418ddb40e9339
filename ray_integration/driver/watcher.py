"""The driver's Ray watcher: a thread that wakes the driver loop when a worker's Ray task completes."""

from __future__ import annotations

import queue
import threading
from typing import Any

import ray

from .pool import WorkerPool


class RayWatcher:
    """A thread that blocks in ``ray.wait`` on the pool's refs and wakes the driver when one completes.
    Every exception it meets is handed to the driver loop, which ends the run with it."""

    WAIT_S = 0.2

    def __init__(self, pool: WorkerPool, sink: "queue.Queue[tuple[str, Any]]") -> None:
        self._pool, self._sink = pool, sink
        self._closing = threading.Event()
        self._reported: set[Any] = set()
        self._thread = threading.Thread(target=self._run, name="elastic-ring-ray-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                refs = [r for r in self._pool.watched_refs() if r not in self._reported]
                if not refs:
                    self._closing.wait(self.WAIT_S)
                    continue
                ready, _ = ray.wait(refs, num_returns=1, timeout=self.WAIT_S, fetch_local=False)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                    self._reported.update(ready)
                    self._sink.put(("ray", ready))
        except BaseException as exc:  # handed to the driver loop
            if not self._closing.is_set():
                self._sink.put(("error", RuntimeError(f"watching the workers through Ray failed: "
                                                      f"{type(exc).__name__}: {exc}")))

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
