"""The worker's one reader of its queue (``{job}/w/{worker_id}``), for the worker's whole life.

The driver sends a worker two sorts of messages on that queue (:mod:`..wire.protocol`):

* answers to a ring request (``ring``, ``stop``, ``pending``), which the elastic loop's rendezvous waits for
  (:meth:`Mailbox.next`, with a deadline);
* notices about the current ring, which must act while ``fn`` trains: ``abort`` (a member of the round was lost:
  a collective that waits on it fails now), ``notice`` (re-form, persist or stop at the next commit) and
  ``preemption`` (what ``get_preemption_info()`` answers). They are handed to their handler on this thread.

One thread (the reader) blocks on the queue (its own store connection, no polling) and sorts what arrives. Until
2026-11-28 the notices were Ray actor calls, one per member: 1,023 of them cost the driver's loop 0.25 s, against
0.04 s for 1,023 sealed pushes into the members' queues (``python -m benchmarks.control_plane --ray-calls``), and
one queue keeps the driver's order.

A connection that waits long for the driver's next word may die without a sound (a NAT or a firewall that forgets
idle flows, a cable): after :data:`KEEPALIVE_S` seconds without a message the mailbox pushes a ``keepalive`` into
its own queue (through the worker's sending connection), and when that one has not come back within ``idle_s`` a
new reader takes over on a fresh connection (the stuck one is left to its daemon thread: TCPStore's blocking pop
cannot be cancelled there). Should the stuck one wake after all, it hands over the message it got and ends; the
two readers may then handle two messages out of order, and the channel's replay check takes numbers that come
out of order within a window (:data:`~..wire.channel.REPLAY_WINDOW`).

A message is genuine (its MAC under the job's secret checks, its number is new) or it is dropped unread
(:class:`~..wire.channel.Channel`); only the driver's messages are read. A store failure the channel's
reconnection cannot mend, or a handler's failure (:class:`NoticeFailed`), ends the reading: the rendezvous raises it
at its next wait, and ``on_failure`` tells the worker (which reports it to the driver and goes silent, as when its heartbeat thread
fails), so nothing is swallowed and nothing waits on a reader that is gone.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from elastic_ring.collectives import preemption
from elastic_ring.core.errors import CommError
from elastic_ring.core.log import get_logger
from elastic_ring.ring import runtime
from state import membership

from ..wire.channel import Channel, with_retries
from ..wire.protocol import DRIVER, KEEPALIVE, DriverKind

_log = get_logger(__name__)

#: After this long without a message, a worker's mailbox pushes a ``keepalive`` into its own queue.
KEEPALIVE_S = 10.0
#: A keepalive not back in its queue's reader within this long means the reader is stuck on a dead connection.
KEEPALIVE_BACK_S = 30.0

#: The kinds that are answers to a ring request (the rendezvous reads them); every other kind has a handler.
ANSWERS = frozenset({DriverKind.RING, DriverKind.STOP, DriverKind.PENDING})


class NoticeFailed(Exception):
    """A notice from the driver could not be applied (a handler raised): not a store that is gone."""


class Mailbox:
    """Reads ``queue_key`` through ``channel`` (a connection of its own: it blocks there) from :meth:`start` on.
    ``handlers`` maps each notice kind to what to do with the message; ``on_failure(exc)`` runs once if reading
    ends with an error.

    ``send`` and ``idle_s`` (together, or neither): when nothing came for ``keepalive_s``, the mailbox pushes a
    ``keepalive`` through ``send`` (the worker's sending channel) into its own queue; one that has not come back
    within ``idle_s`` means the reader is stuck on a dead connection, and a new reader takes over on a fresh one
    (``channel`` must be made with ``connect=``). Without them it waits for the driver as long as it takes."""

    #: One blocking pop's timeout; it only bounds how long one wait lasts (a timeout just waits again).
    WAIT_S = 3600.0

    def __init__(self, channel: Channel, queue_key: str, handlers: dict[DriverKind, Callable[[dict], None]],
                 on_failure: Callable[[BaseException], None] | None = None, send: Channel | None = None,
                 idle_s: float | None = None, keepalive_s: float = KEEPALIVE_S,
                 name: str = "elastic-ring-mailbox") -> None:
        unknown = set(handlers) & ANSWERS
        if unknown:
            raise ValueError(f"Mailbox: {sorted(map(str, unknown))} are ring answers (the rendezvous reads them), "
                             "not notices with a handler")
        if (send is None) != (idle_s is None):
            raise ValueError("Mailbox: send and idle_s go together (its keepalives need a channel to go out on)")
        if idle_s is not None and not idle_s > 0:
            raise ValueError(f"Mailbox: idle_s={idle_s!r} must be a positive number of seconds, or None")
        if not keepalive_s > 0:
            raise ValueError(f"Mailbox: keepalive_s={keepalive_s!r} must be a positive number of seconds")
        self._channel, self._key, self._handlers, self._on_failure = channel, queue_key, dict(handlers), on_failure
        self._send, self._idle_s, self._keepalive_s, self._name = send, idle_s, keepalive_s, name
        self._answers: "queue.SimpleQueue[dict]" = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()  # one message handled at a time (a replaced reader may still hand one over)
        self._reader = 0  # the current reader's number; a replaced one ends after the message it may still get
        self._thread: threading.Thread | None = None
        self._heard_at = time.monotonic()
        self._keepalive: tuple[int, float] | None = None  # (number, sent at) of the keepalive on its way
        self._keepalives = 0
        self.replaced = 0  # readers replaced because a keepalive did not come back within idle_s

    def start(self) -> None:
        self._start_reader(self._channel)
        if self._idle_s is not None:
            threading.Thread(target=self._watch, name=f"{self._name}-watch", daemon=True).start()

    def _start_reader(self, channel: Channel) -> None:
        with self._lock:
            self._reader += 1
            self._heard_at = time.monotonic()
            self._keepalive = None
            self._thread = threading.Thread(target=self._run, args=(self._reader, channel), name=self._name,
                                            daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """A reader reads (none failed and the current one runs)."""
        return self._failure is None and self._thread is not None and self._thread.is_alive()

    def _run(self, number: int, channel: Channel) -> None:
        while not self._closing.is_set() and number == self._reader:
            try:
                # a broken connection is replaced and the wait retried (with backoff) before it is fatal
                msg = with_retries(lambda: channel.receive(self._key, self.WAIT_S),
                                   f"reading the worker's queue {self._key}")
            except BaseException as exc:
                if number == self._reader:  # (a replaced reader's dead connection failing at last is no error)
                    self._fail(exc)
                return
            try:
                with self._lock:
                    self._heard_at = time.monotonic()
                    if msg is not None and not self._closing.is_set():
                        self._sort(msg)
            except BaseException as exc:  # a handler failed (whichever reader handed the message over)
                failed = NoticeFailed(f"the driver's {msg.get('k')!r} message could not be applied: "
                                      f"{type(exc).__name__}: {exc}")
                failed.__cause__ = exc
                self._fail(failed)
                return

    def _sort(self, msg: dict) -> None:
        """Under ``_lock``: hand ``msg`` over (a ring answer), apply it (a notice), or note a keepalive."""
        if msg.get("from") != DRIVER:
            if self._send is not None and msg.get("from") == self._send.sender and msg.get("k") == KEEPALIVE:
                if self._keepalive is not None and msg.get("seq") == self._keepalive[0]:
                    self._keepalive = None  # it came back: the connection carries
            return  # (another sender's, genuine: nobody else writes here)
        kind = DriverKind.of(msg)
        if kind in ANSWERS:
            self._answers.put(msg)
        elif kind in self._handlers:
            self._handlers[kind](msg)
        else:
            _log.warning("worker mailbox %s: a message of unknown kind %r from the driver ignored (a newer driver?)",
                         self._key, msg.get("k"))

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except BaseException as exc:  # (a reader that could not be started, say): surfaced, never silent
            self._fail(exc)

    def _watch_loop(self) -> None:
        """Push a keepalive when nothing came for KEEPALIVE_S; replace a reader whose keepalive did not come back
        within ``idle_s``: its connection died without a sound, and a blocking pop there waits for ever
        (TCPStore's timeout then waits for the server's answer to its cancel). What the driver pushed meanwhile is
        still in the queue (TCPStore's blocking pop waits for the queue first, then takes a message with a second
        request): the new reader gets it."""
        assert self._idle_s is not None and self._send is not None
        period = min(self._idle_s, self._keepalive_s) / 4
        last = time.monotonic()
        while not self._closing.wait(period):
            if self._failure is not None:
                return
            now = time.monotonic()
            with self._lock:
                overslept = now - last - period
                if overslept > period and self._keepalive is not None:  # this process did not run (SIGSTOP,
                    seq, sent = self._keepalive                          # starved): nor could its reader
                    self._keepalive = (seq, sent + overslept)
                last = now
                stuck = self._keepalive is not None and now - self._keepalive[1] > self._idle_s
                due = self._keepalive is None and now - self._heard_at >= self._keepalive_s
                if due:
                    self._keepalives += 1
                    self._keepalive = (self._keepalives, now)
            if due:
                try:
                    self._send.send(self._key, KEEPALIVE, seq=self._keepalives)
                except (RuntimeError, OSError) as exc:  # the store is unreachable for now: the reader sees it too
                    _log.warning("worker mailbox %s: its keepalive could not be sent (%s); trying again", self._key,
                                 exc)
                    with self._lock:
                        self._keepalive = None
            if stuck:
                self._replace(now)

    def _replace(self, now: float) -> None:
        _log.warning("worker mailbox %s: its keepalive did not come back within %.0f s: reading on a fresh store "
                     "connection", self._key, self._idle_s)
        try:
            channel = with_retries(self._sibling, f"reconnecting the worker's queue {self._key}")
        except BaseException as exc:
            self._fail(exc)
            return
        self.replaced += 1
        self._start_reader(channel)

    def _sibling(self) -> Channel:
        try:
            return self._channel.sibling()
        except CommError as exc:  # unreachable for now: retried
            raise OSError(str(exc)) from exc

    def _fail(self, exc: BaseException) -> None:
        """Surface ``exc``: to the rendezvous's next wait and to the worker (``on_failure``), once."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
        self._answers.put({})  # wakes a waiting rendezvous, which then raises the failure
        if self._on_failure is not None and not self._closing.is_set():
            self._on_failure(exc)

    def next(self, timeout_s: float) -> dict | None:
        """The next answer to a ring request (``ring``, ``stop`` or ``pending``), or None when ``timeout_s``
        passes first. Raises the reading's failure once it ended with one: ``RuntimeError``/``OSError`` for a
        store it cannot reach, :class:`NoticeFailed` for a notice it could not apply."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._failure is not None:
                raise self._failure
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                msg = self._answers.get(timeout=remaining)
            except queue.Empty:
                return None
            if msg:
                return msg

    def close(self) -> None:
        """Stop reading and sending keepalives (the reader ends at its next message or store error: a daemon)."""
        self._closing.set()


def _round(msg: dict) -> int:
    round_id = msg.get("round")
    if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
        raise ValueError(f"the driver's {msg.get('k')!r} message names no round (round={round_id!r})")
    return round_id


def apply_abort(msg: dict) -> None:
    """``abort``: a member of the round was lost; a collective or a formation of it (or older) fails now."""
    runtime.abort_round(_round(msg), str(msg.get("why") or "a member of the round was lost"))


def apply_notice(msg: dict) -> None:
    """``notice``: what the round must do at its next commit (re-form, persist, stop); ``persist_id`` numbers the
    write the driver asked for, retried for ``within_s`` seconds from now (this process's clock). It may carry the
    ring's new preemption notice (``preemption``), applied first: ``fn`` that sees the change sees the drain too."""
    if msg.get("preemption") is not None:
        preemption.post(msg["preemption"])
    within, persist_id = msg.get("within_s"), msg.get("persist_id") or 0
    if within is not None and (isinstance(within, bool) or not isinstance(within, (int, float))):
        raise ValueError(f"the driver's notice has within_s={within!r}: not a number of seconds")
    if isinstance(persist_id, bool) or not isinstance(persist_id, int) or persist_id < 0:
        raise ValueError(f"the driver's notice has persist_id={persist_id!r}: not a write number")
    by = None if within is None else time.monotonic() + max(0.0, float(within))
    membership.post(membership.Notice(_round(msg), bool(msg.get("change")), bool(msg.get("persist")),
                                      bool(msg.get("stop")), persist_id, by))


def apply_preemption(msg: dict) -> None:
    """``preemption``: the ring's newest preemption notice (what ``get_preemption_info()`` answers)."""
    preemption.post(msg.get("notice"))


#: What a worker does with each notice (``RingWorker`` reads its queue with these).
NOTICE_HANDLERS: dict[DriverKind, Callable[[dict], None]] = {
    DriverKind.ABORT: apply_abort, DriverKind.NOTICE: apply_notice, DriverKind.PREEMPTION: apply_preemption}
