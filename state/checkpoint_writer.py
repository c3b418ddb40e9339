"""Writes checkpoints in a background thread: training never waits, at most one write in flight.

``submit`` hands over a snapshot (already copied, so the next commit can reuse
its buffers) and returns at once. If a write is in flight, the newest
submission waits in a queue of one, replacing any older waiting one: the
newest state always gets written, and older ones may be skipped. A failed
write is logged with its path and re-raised by :meth:`flush`.
"""

from __future__ import annotations

import threading
from typing import Any

from elastic_ring.log import get_logger

from .checkpoint_store import CheckpointError, CheckpointStore

_log = get_logger(__name__)


class BackgroundWriter:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._waiting: tuple[Any, dict] | None = None
        self._busy = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: list[str] = []

    def submit(self, tree: Any, meta: dict) -> None:
        with self._cond:
            self._waiting = (tree, meta)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="elastic-ring-checkpoint-writer", daemon=True)
                self._busy = True
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                item, self._waiting = self._waiting, None
                if item is None:
                    self._busy = False
                    self._cond.notify_all()
                    return
            try:
                uri = self.store.save(*item)
                with self._cond:
                    self.written.append(uri)
                _log.info("checkpoint written: %s", uri)
            except (CheckpointError, OSError, RuntimeError) as exc:
                with self._cond:
                    self.error = exc
                _log.error("checkpoint write failed: %s", exc)

    def flush(self, timeout_s: float | None = None) -> str | None:
        """Wait until nothing is waiting or in flight; return the newest URI written; raise the last error."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy and self._waiting is None, timeout_s):
                raise TimeoutError(f"checkpoint write to {self.store.uri} did not finish within {timeout_s} s")
            error, self.error = self.error, None
            if error is not None:
                raise CheckpointError(f"the last checkpoint write failed: {error}") from error
            return self.written[-1] if self.written else None
