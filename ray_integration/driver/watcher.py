"""The driver's watchers of Ray: threads that wake the driver loop when a worker's Ray task completes
(:class:`RayWatcher`) and when the set of draining nodes changes (:class:`DrainWatcher`)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import ray

from elastic_ring.core.log import get_logger

from .pool import WorkerPool

_log = get_logger(__name__)


class _Watcher:
    """A daemon thread that runs :meth:`_watch` until closed, waking the driver loop through ``sink``. Every exception
    it meets is handed to the loop (``("error", ...)``, naming ``what`` failed), which ends the run with it."""

    def __init__(self, sink: "queue.Queue[tuple[str, Any]]", name: str, what: str) -> None:
        self._sink, self._what = sink, what
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # handed to the driver loop
            if not self._closing.is_set():
                self._sink.put(("error", RuntimeError(f"{self._what} failed: {type(exc).__name__}: {exc}")))

    def _watch(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)


class RayWatcher(_Watcher):
    """A thread that blocks in ``ray.wait`` on the pool's refs and wakes the driver when one completes."""

    WAIT_S = 0.2

    def __init__(self, pool: WorkerPool, sink: "queue.Queue[tuple[str, Any]]") -> None:
        super().__init__(sink, "elastic-ring-ray-watcher", "watching the workers through Ray")
        self._pool = pool
        self._reported: set[Any] = set()

    def _watch(self) -> None:
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


class DrainWatcher(_Watcher):
    """A thread that asks Ray every ``poll_s`` which nodes drain (a GCS call, kept off the loop's thread) and wakes
    the driver with the answer (``("drains", {node id: deadline ms})``) whenever it changed: a drain reaches the loop
    within ``poll_s`` of Ray knowing it, and the loop steps at once. A failed call is logged and tried again at the
    next poll; calls failing for ``fail_after_s`` in a row end the run with the last error, as anything else the
    thread meets does. A call that blocks (Ray's GCS client retries on its own) only delays the drains the loop
    sees."""

    def __init__(self, poll: Callable[[], dict[str, int]], sink: "queue.Queue[tuple[str, Any]]", poll_s: float,
                 fail_after_s: float = 10.0) -> None:
        super().__init__(sink, "elastic-ring-drain-watcher", "watching Ray's draining nodes")
        self._poll, self._poll_s, self._fail_after_s = poll, poll_s, fail_after_s

    def _watch(self) -> None:
        last: dict[str, int] = {}
        failing_since: float | None = None
        while not self._closing.wait(self._poll_s):
            try:
                draining = self._poll()
            except Exception as exc:  # a GCS hiccup is retried; a lasting failure ends the run, named
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    _log.warning("asking Ray which nodes drain failed (%s: %s); trying again every %.1f s for %.0f s",
                                 type(exc).__name__, exc, self._poll_s, self._fail_after_s)
                if now - failing_since >= self._fail_after_s:
                    raise RuntimeError(f"asking Ray which nodes drain kept failing for {now - failing_since:.1f} s: "
                                       f"{type(exc).__name__}: {exc}") from exc
                continue
            failing_since = None
            if draining != last:
                last = draining
                self._sink.put(("drains", dict(draining)))
