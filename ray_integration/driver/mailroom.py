"""What the driver does with the workers' mail besides deciding: reports, timeline, resume and checkpoint events go
to the trainer's outputs; waiting workers are acknowledged; finished rounds' store keys are deleted."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

from elastic_ring.core.log import get_logger

from ..wire.channel import Channel
from ..wire.protocol import DriverKind, Keys, WorkerKind
from .events import EventLog
from .pool import WorkerPool
from .progress import ProgressDisplay
from .timeline import TimelineFile

_log = get_logger(__name__)
#: After the driver's last state, late messages (a worker's final checkpoint event) are applied until the inbox is
#: quiet this long, or this limit passes.
LAST_MESSAGES_QUIET_S, LAST_MESSAGES_LIMIT_S = 0.2, 2.0


class Mailroom:
    """Moves what workers sent (reports, timeline, resume info, checkpoint events) to the trainer's outputs."""

    def __init__(self, pool: WorkerPool, events: EventLog, progress: ProgressDisplay, timeline: TimelineFile | None,
                 on_report: Callable[[dict], None] | None) -> None:
        self.pool, self.events, self.progress, self.timeline, self.on_report = pool, events, progress, timeline, on_report
        self.metrics: list[dict] = []
        self.resumed: dict | None = None

    def __call__(self, round_id: int, world_size: int | None) -> None:
        """Deliver the mail that arrived since the last call (the driver's current round and world size tag it)."""
        mail = self.pool.mail
        for info in mail.resumed:
            if self.resumed is None:
                self.resumed = info
                meta = info.get("meta") or {}
                self.events.add("resumed_from_checkpoint", round_id, world_size, uri=info.get("uri"),
                                seq=info.get("seq"), commits=meta.get("commits"), epoch=info.get("epoch"),
                                step=info.get("step"))
        for event in mail.checkpoints:
            detail = {k: v for k, v in event.items() if k != "kind"}
            self.events.add(str(event.get("kind", "checkpoint")), round_id, world_size, **detail)
        for record in mail.reports:
            self.metrics.append(record)
            if self.on_report is not None:
                self.on_report(record)
        if self.timeline is not None:
            for batch in mail.timeline:
                self.timeline.add_worker_events(*batch)
        mail.resumed.clear(), mail.checkpoints.clear(), mail.reports.clear(), mail.timeline.clear()
        self.progress.update(self.metrics, world_size)


def take_last_messages(pool: WorkerPool, wakeups: "queue.SimpleQueue[tuple[str, Any]]") -> None:
    """Apply the messages that arrived after the driver's last state (bounded): a worker sends its final
    checkpoint event just before its run returns, and Ray may report the return first. Returns once no
    message but heartbeats came for LAST_MESSAGES_QUIET_S, or after LAST_MESSAGES_LIMIT_S."""
    now = time.monotonic()
    limit, quiet = now + LAST_MESSAGES_LIMIT_S, now + LAST_MESSAGES_QUIET_S
    while (now := time.monotonic()) < min(limit, quiet):
        try:
            kind, payload = wakeups.get(timeout=min(limit, quiet) - now)
        except queue.Empty:
            return
        if kind == "msg":
            pool.apply(payload)
            if WorkerKind.of(payload) not in (WorkerKind.HEARTBEAT, WorkerKind.NODE_HEARTBEAT):
                quiet = time.monotonic() + LAST_MESSAGES_QUIET_S
        elif kind == "error":
            _log.warning("after the job ended: %s", payload)


class Acknowledger:
    """Tells workers waiting at the rendezvous that the driver is alive (``pending``), from the inbox thread: for
    their heartbeats (``hb``, or each one inside a ``node_hb``), at most once per worker per ``every_s`` (a driver
    behind its inbox reads a worker's queued heartbeats in a burst; one word per interval is all a worker needs,
    and it gives up only after ``driver_silence_s``)."""

    def __init__(self, send: Channel, keys: Keys, every_s: float,
                 known: Callable[[str], bool] | None = None) -> None:
        self._send, self._keys, self._every_s = send, keys, every_s
        self._known = known  # whether an id inside a node_hb is one of the job's workers (others are not told)
        self._last: dict[str, float] = {}  # worker id -> when it was last told (driver clock)

    def __call__(self, msg: dict) -> None:
        kind = WorkerKind.of(msg)
        if kind is WorkerKind.HEARTBEAT:
            self._pending(msg["from"], msg.get("waiting"))
        elif kind is WorkerKind.NODE_HEARTBEAT and isinstance(msg.get("beats"), dict):
            for worker_id, beat in msg["beats"].items():  # (a pending only says the driver is alive: no node check)
                if isinstance(beat, dict) and (self._known is None or self._known(worker_id)):
                    self._pending(worker_id, beat.get("waiting"))

    def _pending(self, worker_id: str, waiting: Any) -> None:
        if not isinstance(waiting, int) or isinstance(waiting, bool) or waiting <= 0:
            return
        now = time.monotonic()
        if now - self._last.get(worker_id, float("-inf")) < self._every_s:
            return
        self._last[worker_id] = now
        self._send.send(self._keys.worker_inbox(worker_id), DriverKind.PENDING, generation=waiting)


class RoundKeys:
    """Deletes the store keys (gloo's and NCCL's rendezvous) of rounds that can no longer be formed."""

    def __init__(self, store, keys: Keys) -> None:
        self._store, self._keys = store, keys
        self._done = 0

    def forget_before(self, round_id: int) -> None:
        if round_id <= self._done + 1:
            return
        prefixes = tuple(self._keys.round_prefix(r) for r in range(self._done + 1, round_id))
        for key in self._store.list_keys():
            if key.startswith(prefixes):
                self._store.delete_key(key)
        self._done = round_id - 1
