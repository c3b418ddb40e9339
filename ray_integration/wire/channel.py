"""Sealed JSON messages through the rendezvous store's queues (see :mod:`.protocol`).

* :class:`Channel` sends (with bounded retries and backoff on store errors) and
  receives with a deadline (a blocking ``queue_pop``: no polling).
* A message whose MAC does not check is dropped and counted, never decoded; so
  is a message number already seen from its sender (a replay).
* :class:`Inbox` is the driver's receiver: a thread that blocks on the driver's
  queue and hands verified messages to the driver loop. It captures every
  exception and hands it over too, so a dead inbox ends the run with its cause
  instead of leaving the driver waiting.
* :class:`InboxProbe` measures how far behind the driver reads its queue (a
  probe it sends itself), so that its backlog is not taken for the workers'
  silence.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from elastic_ring.core.auth import seal_json, unseal_json
from elastic_ring.core.errors import AuthenticationError, CommError

from .protocol import DriverKind

T = TypeVar("T")

#: The kind of the driver's probe of its own inbox (:class:`InboxProbe`).
PROBE = DriverKind.PROBE.value

#: Store operations are retried this many times, backing off from RETRY_BASE_S up to RETRY_CAP_S.
RETRIES = 5
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0


def with_retries(op: Callable[[], T], what: str, retries: int = RETRIES,
                 on_error: Callable[[BaseException], None] | None = None) -> T:
    """``op()``, retried on store errors with exponential backoff; the last error is re-raised with ``what``.
    ``on_error(exc)`` runs before each retry (e.g. to reconnect a broken store connection)."""
    delay = RETRY_BASE_S
    for attempt in range(retries + 1):
        try:
            return op()
        except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
            if attempt == retries:
                raise type(exc)(f"{what} failed after {retries + 1} attempts: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, RETRY_CAP_S)
            if on_error is not None:
                try:
                    on_error(exc)
                except (RuntimeError, OSError) as again:  # still unreachable: the next attempt says so
                    exc.__context__ = again
    raise AssertionError("unreachable")


#: How far below a sender's highest message number on a queue a number not seen yet is still taken by a channel made
#: with ``replay_window=REPLAY_WINDOW`` (a worker's mailbox: a replaced reader and its successor may check two
#: messages out of order). Older ones are refused as replays. Other channels take only increasing numbers.
REPLAY_WINDOW = 64


def _accept(seen: tuple[int, int], n: int, window: int = REPLAY_WINDOW) -> tuple[int, int] | None:
    """The new record of a sender's message numbers after ``n``, or None if ``n`` was seen or is too old.
    ``seen`` is (the highest number, a bitmap whose bit i says that highest - i was seen)."""
    top, bits = seen
    if n > top:
        shift = n - top
        return n, ((bits << shift) | 1) & ((1 << window) - 1) if shift < window else 1
    offset = top - n
    if n < 1 or offset >= window or bits >> offset & 1:
        return None
    return top, bits | 1 << offset


class Channel:
    """One party's sealed messages. ``store`` must not be shared with a thread that blocks on it.
    ``connect()``, if given, makes a fresh store connection: a broken one is replaced before a retry. Messages are
    numbered per queue; ``replay_window``: how far out of order a receiver takes a sender's numbers on one queue
    (1: only increasing ones)."""

    def __init__(self, store: dist.Store, secret: bytes, sender: str,
                 connect: Callable[[], dist.Store] | None = None, replay_window: int = 1) -> None:
        self._store, self._secret, self.sender, self._connect = store, secret, sender, connect
        self._lock = threading.Lock()
        self._sent: dict[str, int] = {}  # queue -> the number of the last message sent there (numbered per queue)
        self._seen: dict[tuple[str, str], tuple[int, int]] = {}  # (sender, queue) -> (highest seen, window bits)
        self._window = replay_window
        self._seen_lock = threading.Lock()
        self.forged = 0
        self.reconnects = 0

    def sibling(self) -> "Channel":
        """A channel on a fresh connection of its own that shares this one's record of the message numbers seen
        (a reader that replaces a stuck one must not take a replay for new)."""
        if self._connect is None:
            raise ValueError("Channel.sibling needs a channel made with connect=")
        twin = Channel(self._connect(), self._secret, self.sender, connect=self._connect, replay_window=self._window)
        twin._seen, twin._seen_lock = self._seen, self._seen_lock
        return twin

    def _reconnect(self, exc: BaseException) -> None:
        if self._connect is not None and not isinstance(exc, dist.DistStoreError):  # a timeout is no broken link
            try:
                self._store = self._connect()
            except CommError as unreachable:  # still unreachable: an OSError, which the caller retries
                raise OSError(str(unreachable)) from unreachable
            self.reconnects += 1

    def send(self, queue_key: str, kind: str, **fields: Any) -> None:
        with self._lock:
            n = self._sent[queue_key] = self._sent.get(queue_key, 0) + 1
            text = seal_json(self._secret, queue_key, {"from": self.sender, "n": n, "k": kind, **fields})
            # A push is fire-and-forget (no round trip: a stalled driver, whose process holds the store, must not
            # block the workers' training): the first push into a connection that broke is lost without an
            # error, the next one fails and is retried over a fresh connection. What the driver must not miss
            # (the generation a worker waits for, that it holds the state) rides in every heartbeat too.
            with_retries(lambda: self._store.queue_push(queue_key, text), f"sending {kind} to {queue_key}",
                         on_error=self._reconnect)

    def pending(self, queue_key: str) -> int:
        """How many messages wait in ``queue_key`` (read by nobody yet)."""
        with self._lock:
            return int(with_retries(lambda: self._store.queue_len(queue_key), f"reading the length of {queue_key}",
                                    on_error=self._reconnect))

    def verify(self, queue_key: str, raw: bytes) -> dict | None:
        """The message in ``raw`` if it is genuine and new, else None (forgeries are counted)."""
        try:
            msg = unseal_json(self._secret, queue_key, raw)
        except (AuthenticationError, ValueError):
            self.forged += 1
            return None
        if not isinstance(msg, dict) or not isinstance(msg.get("n"), int) or not isinstance(msg.get("from"), str):
            self.forged += 1
            return None
        if isinstance(msg["n"], bool):
            self.forged += 1
            return None
        with self._seen_lock:
            key = (msg["from"], queue_key)
            seen = _accept(self._seen.get(key, (0, 0)), msg["n"], self._window)
            if seen is None:
                return None  # a replay, or a duplicate
            self._seen[key] = seen
        return msg

    def receive(self, queue_key: str, timeout_s: float) -> dict | None:
        """The next genuine message on ``queue_key``, or None when ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._store.set_timeout(datetime.timedelta(seconds=remaining))
                raw = self._store.queue_pop(queue_key)
            except dist.DistStoreError:
                if time.monotonic() >= deadline - 0.01:
                    return None  # the wait timed out
                raise
            except (RuntimeError, OSError) as exc:  # the connection broke: reconnect once and wait again
                if self._connect is None:
                    raise
                self._reconnect(exc)
                continue
            msg = self.verify(queue_key, raw)
            if msg is not None:
                return msg


class Inbox:
    """The driver's receiving thread: verified messages (and its own failure) go to ``sink``;
    ``on_message(msg)`` runs on the thread for each (the driver acknowledges waiting workers there)."""

    #: The blocking pop's timeout; it only bounds how long one wait lasts (a timeout just waits again).
    WAIT_S = 3600.0

    def __init__(self, channel: Channel, queue_key: str, sink: "queue.Queue[tuple[str, Any]]",
                 on_message: Callable[[dict], None] | None = None) -> None:
        self._channel, self._key, self._sink, self._on_message = channel, queue_key, sink, on_message
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ring-driver-inbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                msg = self._channel.receive(self._key, self.WAIT_S)
                if msg is not None and not self._closing.is_set():
                    self._sink.put(("msg", msg))
                    if self._on_message is not None:
                        self._on_message(msg)
        except BaseException as exc:  # handed to the driver loop, which ends the run with it
            if not self._closing.is_set():
                self._sink.put(("error", RuntimeError(f"the driver's message inbox failed: {type(exc).__name__}: {exc}")))

    def close(self, wake: Callable[[], None]) -> None:
        """Stop the thread; ``wake()`` must push any message to the inbox's queue to end a blocked pop."""
        self._closing.set()
        try:
            wake()
        except (RuntimeError, OSError):
            pass  # the store is already gone: the blocked pop has failed too
        self._thread.join(5)


class InboxProbe:
    """How far behind the driver reads its inbox, on its own clock: every ``interval_s`` it sends a sealed probe
    to its own queue (:meth:`tick`), and notes when that probe comes out of the loop's wakeups (:meth:`arrived`).
    The time between covers the store queue and the loop's own backlog, and no clocks of two hosts are compared.

    :meth:`delay_s` is the last probe's delay, or the age of the one still on its way if that is longer (the
    inbox is at least that far behind now). A probe not back within ``lost_after_s`` is taken for lost (a push
    into a broken connection is lost without an error): it stops counting, and another is sent."""

    def __init__(self, channel: Channel, queue_key: str, interval_s: float, lost_after_s: float) -> None:
        self._channel, self._key = channel, queue_key
        self._interval_s, self._lost_after_s = interval_s, lost_after_s
        self._seq = 0
        self._sent_at: float | None = None  # the probe on its way (driver clock)
        self._last_sent = float("-inf")
        self.measured_s = 0.0

    def tick(self, now: float) -> None:
        """Send the next probe when none is on its way (or it was lost) and ``interval_s`` passed."""
        lost = self._sent_at is not None and now - self._sent_at > self._lost_after_s
        if (self._sent_at is None or lost) and now - self._last_sent >= self._interval_s:
            self._seq += 1
            self._sent_at = self._last_sent = now
            self._channel.send(self._key, PROBE, probe=self._seq)

    def arrived(self, msg: dict, now: float) -> bool:
        """Note ``msg`` if it is this driver's probe (sent by :meth:`tick` through its own channel)."""
        if msg.get("k") != PROBE or msg.get("from") != self._channel.sender:
            return False
        if msg.get("probe") == self._seq and self._sent_at is not None:
            self.measured_s, self._sent_at = now - self._sent_at, None
        return True

    def delay_s(self, now: float) -> float:
        on_its_way = None if self._sent_at is None else now - self._sent_at
        if on_its_way is None or on_its_way > self._lost_after_s:
            return self.measured_s
        return max(self.measured_s, on_its_way)
