"""Waiting for a step's cross-rank check without blocking backward.

DistributedOptimizer starts its per-step check at the step's first gradient
and must not send a gradient bucket before the answer is yes (on gloo, a bucket
of a size the peers do not expect aborts the process). Waiting for the answer
inside the autograd hook would stall backward for a round trip, or, when ranks
are skewed, until the slowest rank starts its backward. A :class:`VerdictWaiter`
is waited for on a helper thread instead and, once the answer is in, calls
back the reducer, which launches the buckets that became ready meanwhile. The
training thread never blocks on it except in ``synchronize()``, which has to
wait for the buckets anyway.

One helper thread per process serves every waiter, in order: starting a thread
per step made the training thread wait until the new thread was scheduled
(``Thread.start`` waits for it), which on busy cores cost milliseconds per
step. The helper captures every exception (a mismatch, a lost peer) and hands
it to the training thread, which raises it at its next hook or in
``synchronize()``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

from ..core.errors import CommError
from .signature import PendingCheck

#: How often the idle helper thread wakes up to see whether it is still wanted.
_IDLE_POLL_S = 5.0


class VerdictWaiter:
    """Finish ``check`` on the helper thread, then run ``on_yes(self, values)`` there (unless it failed)."""

    def __init__(self, check: PendingCheck, on_yes: Callable[["VerdictWaiter", list[int]], None], deadline_s: float) -> None:
        self._check = check
        self._on_yes = on_yes
        self._deadline_s = deadline_s
        self.error: Exception | None = None
        self.values: list[int] | None = None
        self.seconds = 0.0  # from the hand-over to the answer
        self._done = threading.Event()
        self._queued_at = time.perf_counter()
        _helper().submit(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def joined(self) -> list[int]:
        """After a yes: the ranks that had joined (they answered with zeros)."""
        return self._check.joined

    @property
    def same_call(self) -> bool:
        """After a disagreement: whether only the steps differed (the ranks made the same call)."""
        return self._check.same_call

    def run(self) -> None:
        """On the helper thread: wait for the answer, then call back. Never raises."""
        try:
            self.values = self._check.finish()
            self.seconds = time.perf_counter() - self._queued_at
            self._on_yes(self, self.values)
        except Exception as exc:  # handed to the training thread, which raises it
            self.error = exc
        finally:
            self._done.set()

    def settle(self) -> None:
        """Block until the helper finished this waiter (its callback included), within the deadline; raise
        :class:`CommError` past it. What the helper met stays in :attr:`error` for the caller."""
        if not self._done.wait(self._deadline_s):
            raise CommError(
                f"the per-step cross-rank check did not finish within {self._deadline_s:.0f} s "
                "(collective_timeout_s plus a margin); a peer is probably lost"
            )


class _Helper:
    """The process's helper thread: runs waiters one after the other."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._queue: "queue.SimpleQueue[VerdictWaiter]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="elastic-ring-step-check", daemon=True)
        self._thread.start()

    def submit(self, waiter: VerdictWaiter) -> None:
        self._queue.put(waiter)

    def _loop(self) -> None:
        while True:
            try:
                waiter = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                continue  # idle; the thread is a daemon and ends with the process
            waiter.run()


_lock = threading.Lock()
_instance: _Helper | None = None


def _forget_after_fork() -> None:
    global _lock, _instance
    _lock, _instance = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_after_fork)


def _helper() -> _Helper:
    """The helper of this process (a forked child starts its own: threads do not survive fork)."""
    global _instance
    with _lock:
        if _instance is None or _instance.pid != os.getpid():
            _instance = _Helper()
        return _instance
