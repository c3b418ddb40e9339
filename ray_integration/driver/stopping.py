"""Stopping a run: the trainer's stop requests (from any thread or a signal handler) and its SIGTERM handler."""

from __future__ import annotations

import queue
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable

from elastic_ring.core.log import get_logger

if TYPE_CHECKING:
    from .loop import Driver

_log = get_logger(__name__)


class StopControl:
    """The trainer's stop requests, from any thread or a signal handler; applied to the driver of the run.

    A stop asked for while no run is in progress is kept for the next :meth:`ElasticTrainer.run`; every
    stop asked for while a run is in progress is consumed by that run (the next one starts afresh).
    The lock is reentrant: a SIGTERM handler runs on the main thread, possibly while it holds the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._token: object | None = None  # the run in progress, if any
        self.reason: str | None = None
        self.abort_reason: str | None = None
        self._driver: Driver | None = None
        self._wakeups: "queue.SimpleQueue[tuple[str, Any]] | None" = None

    def request(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                if self._driver is not None:
                    self._driver.request_stop(reason)
            else:
                self.abort_reason = f"a second {reason}" if reason == self.reason else \
                    f"{reason} (a second stop request, after {self.reason})"
                if self._driver is not None:
                    self._driver.abort(self.abort_reason)
            if self._wakeups is not None:
                self._wakeups.put(("stop", reason))  # SimpleQueue.put is reentrant: safe in a signal handler

    def begin(self) -> tuple[object, str | None]:
        """A run starts: returns its token and the stop asked for before it (None if none)."""
        with self._lock:
            if self._token is not None:
                raise RuntimeError("ElasticTrainer.run is already running on this trainer (in another thread); "
                                   "one trainer runs one job at a time: create an ElasticTrainer per concurrent job")
            self._token = object()
            return self._token, self.reason

    def attach(self, driver: Driver, wakeups: "queue.SimpleQueue[tuple[str, Any]]") -> None:
        """From now on stops go to ``driver``; one asked for before is applied at once."""
        with self._lock:
            self._driver, self._wakeups = driver, wakeups
            if self.reason is not None:
                driver.request_stop(self.reason)
            if self.abort_reason is not None:
                driver.abort(self.abort_reason)

    def end(self, token: object) -> str | None:
        """The run of ``token`` is over: detach, and return (and forget) the stop it consumed."""
        with self._lock:
            if self._token is not token:
                return None  # already ended
            consumed = self.reason
            self._token, self._driver, self._wakeups = None, None, None
            self.reason = self.abort_reason = None
            return consumed


class Signals:
    """SIGTERM: stop at the next commit, written durably; a second SIGTERM abandons the stop at once.

    Python delivers signals to the main thread only, so the handler is installed only when ``run()`` is on
    the main thread; otherwise the caller wires it: ``signal.signal(SIGTERM, lambda *_: trainer.stop("SIGTERM"))``.
    """

    def __init__(self, stop: Callable[[str], None]) -> None:
        self._installed = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop("SIGTERM"))
            self._installed = True
        else:
            _log.info("ElasticTrainer.run is not on the main thread, so it does not handle SIGTERM itself; to stop "
                      "at a commit on SIGTERM, call signal.signal(signal.SIGTERM, lambda *_: trainer.stop('SIGTERM')) "
                      "in the main thread (docs/api.md)")

    def restore(self) -> None:
        if self._installed:
            # None: the previous handler was not installed from Python; the default is the closest
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
