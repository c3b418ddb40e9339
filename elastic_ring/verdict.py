"""Waiting for a step's cross-rank check without blocking backward.

DistributedOptimizer starts its per-step check at the step's first gradient
and must not send a gradient bucket before the answer is yes (on gloo, a bucket
of a size the peers do not expect aborts the process). Waiting for the answer
inside the autograd hook would stall backward for a round trip, or, when ranks
are skewed, until the slowest rank starts its backward. A :class:`VerdictWaiter`
waits on a short-lived helper thread instead and, once the answer is in, calls
back the reducer, which launches the buckets that became ready meanwhile. The
training thread never blocks on it except in ``synchronize()``, which has to
wait for the buckets anyway.

The helper thread captures every exception (a mismatch, a lost peer) and hands
it to the training thread, which raises it at its next hook or in
``synchronize()``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .errors import CommError
from .signature import PendingCheck


class VerdictWaiter:
    """Finish ``check`` on a helper thread, then run ``on_yes(values)`` there (unless it failed)."""

    def __init__(self, check: PendingCheck, on_yes: Callable[["VerdictWaiter", list[int]], None], deadline_s: float) -> None:
        self._check = check
        self._on_yes = on_yes
        self._deadline_s = deadline_s
        self.error: Exception | None = None
        self.values: list[int] | None = None
        self.seconds = 0.0  # from the start of the wait to the answer
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ring-step-check", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def same_call(self) -> bool:
        """After a disagreement: whether only the steps differed (the ranks made the same call)."""
        return self._check.same_call

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self.values = self._check.finish()
            self.seconds = time.perf_counter() - started
            self._on_yes(self, self.values)
        except Exception as exc:  # handed to the training thread, which raises it
            self.error = exc
        finally:
            self._done.set()

    def settle(self) -> None:
        """Block until the helper finished (its callback included), within the deadline; raise
        :class:`CommError` past it. What the helper raised stays in :attr:`error` for the caller."""
        if not self._done.wait(self._deadline_s):
            raise CommError(
                f"the per-step cross-rank check did not finish within {self._deadline_s:.0f} s "
                "(collective_timeout_s plus a margin); a peer is probably lost"
            )
