"""Tear down an old round's group off the critical path.

Destroying a gloo group joins its threads and closes one pair of sockets per
peer; measured on 2 cores, that took about 10 ms per peer (20 ms at 2 ranks,
80 ms at 8, 160 ms at 16), paid by every survivor at every failure and every
re-form, before it could form the next ring. The sockets must still close at
once (a peer blocked on this rank fails only then), but nothing has to wait for
it: :func:`drop` hands the last reference to one daemon thread, which lets it go
there (torch releases the GIL while it destroys a process group).

A destructor cannot raise into the thread that drops the reference (Python hands
such errors to ``sys.unraisablehook``); anything else that goes wrong in the
loop is captured, logged with the label of the group it was tearing down and
kept in ``failures``, and the thread goes on. Nothing waits on it except
:func:`drain`, which has a deadline, and the exit hook, which gives it two
seconds.

The caller must let go of its own reference right after :func:`drop` (``del``):
it still holds the GIL then, so in practice the object dies on the reaper
thread; if the caller were preempted in between, it would die on the caller's
thread, as it did before this module existed.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Any

_log = logging.getLogger(__name__)

#: How long the exit hook lets pending teardowns run before the process goes.
EXIT_DRAIN_S = 2.0


class Reaper:
    """One daemon thread that drops the objects it is handed, oldest first."""

    def __init__(self, name: str = "elastic-ring-reaper") -> None:
        self._queue: "queue.SimpleQueue[tuple[Any, str]]" = queue.SimpleQueue()
        self._pending = 0
        self._cond = threading.Condition()
        self._name = name
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []  # what went wrong, newest last (also logged)

    def drop(self, obj: Any, label: str) -> None:
        """Release ``obj`` (the caller's last reference) on the reaper thread. ``label`` names it in logs."""
        with self._cond:
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((obj, label))

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything handed over so far is released; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending(self) -> int:
        return self._pending

    def _run(self) -> None:
        while True:
            obj, label = self._queue.get()
            try:
                started = time.monotonic()
                obj = None  # the last reference: the destructor runs here, on this thread
                _log.debug("tore down %s in %.3f s", label, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - logged and kept; the thread must outlive it
                self.failures.append(f"{label}: {type(exc).__name__}: {exc}")
                _log.warning("tearing down %s failed: %s: %s", label, type(exc).__name__, exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()


_reaper = Reaper()


def drop(obj: Any, label: str) -> None:
    """Release ``obj`` on the process's reaper thread (see the module docstring)."""
    _reaper.drop(obj, label)


def drain(timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) for every teardown handed over so far."""
    return _reaper.drain(timeout_s)


atexit.register(drain, EXIT_DRAIN_S)
