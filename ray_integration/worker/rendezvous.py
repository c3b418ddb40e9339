"""The elastic loop's rendezvous on a worker: ask the driver for the next ring, wait for its answer.

The request goes to the driver's queue; the answer comes on this worker's own
queue, which its mailbox thread reads (:mod:`.mailbox`), waited for with a deadline (no polling). While it
waits, the worker's heartbeats repeat which generation it waits for, so a
request or an answer that never arrived is recovered (the driver answers again),
and the driver acknowledges each of them (``pending``). The wait ends with
:class:`~elastic_ring.RendezvousError` after ``silence_s`` without any word
from the driver: a joiner may wait long for the ring's next commit, but never
for a driver that is gone.
"""

from __future__ import annotations

import time
from typing import Callable

import elastic_ring as er
from state import membership

from ..wire.channel import Channel
from ..wire.protocol import DRIVER, DriverKind, Keys, WorkerKind
from .mailbox import Mailbox, NoticeFailed


class JobStopped(er.RingStopped):
    """The driver ended this worker's part in the job while it waited for a ring."""


class WorkerRendezvous:
    def __init__(self, send: Channel, mailbox: Mailbox, keys: Keys, worker_id: str, secret: bytes,
                 silence_s: float) -> None:
        self._send, self._mailbox, self._keys = send, mailbox, keys
        self._id, self._secret, self._silence_s = worker_id, secret, silence_s
        self.generation = 0
        self.waiting: tuple[int, str] | None = None  # (generation, reason) while at the rendezvous
        self.cuda_device: int | None = None  # this worker's GPU (NCCL rings), put into every spec
        self._synced_rounds: set[int] = set()
        self._handover_round: int | None = None  # a round whose members re-form right after its sync
        self._ahead: dict[int, dict] = {}  # answers for a generation it has not asked for yet (given ahead), read
        #: called with the first ring spec the driver hands this worker (before that ring forms), once
        self.on_first_ring: Callable[[er.RingSpec], None] | None = None

    def next_ring(self, reason: str) -> er.RingSpec:
        self.generation += 1
        generation = self.generation
        self.waiting = (generation, reason)
        try:
            self._send.send(self._keys.driver_inbox, WorkerKind.RING_REQUEST, generation=generation, reason=reason)
            return self._await_answer(generation, reason)
        finally:
            self.waiting = None

    def _await_answer(self, generation: int, reason: str) -> er.RingSpec:
        deadline = time.monotonic() + self._silence_s
        self._ahead = {g: m for g, m in self._ahead.items() if g >= generation}
        while True:
            # (an answer given ahead may have been read while this worker waited for an earlier one that got lost)
            msg = self._ahead.pop(generation, None) or self._read(generation, reason, deadline)
            if msg.get("from") != DRIVER or not isinstance(msg.get("generation"), int):
                continue
            if msg["generation"] > generation and DriverKind.of(msg) in (DriverKind.RING, DriverKind.STOP):
                self._ahead[msg["generation"]] = msg  # given ahead of a request it has not made yet: kept for it
                continue
            if msg["generation"] != generation:
                continue  # an answer to an earlier request
            kind = DriverKind.of(msg)
            if kind is DriverKind.PENDING:
                deadline = time.monotonic() + self._silence_s
                continue
            if kind is DriverKind.STOP:
                raise JobStopped(f"worker {self._id}: {msg.get('why', 'the driver ended the job')}")
            if kind is not DriverKind.RING:
                continue
            try:
                spec = er.RingSpec.from_wire({**msg["spec"], "cuda_device": self.cuda_device}, self._secret)
            except (ValueError, TypeError, KeyError) as exc:
                raise er.RendezvousError(f"worker {self._id}: the driver's ring answer is invalid: {exc}") from exc
            if msg.get("stop"):
                membership.post(membership.Notice(spec.round_id, stop=True, persist=True))
            if isinstance(msg.get("persist"), int) and msg["persist"] > 0:  # a round that writes the state, re-forms
                within = msg.get("within_s")
                by = time.monotonic() + float(within) if isinstance(within, (int, float)) else None
                membership.post(membership.Notice(spec.round_id, change=True, persist=True, persist_id=msg["persist"],
                                                  persist_by=by))
            if msg.get("handover"):
                self._handover_round = spec.round_id
            first, self.on_first_ring = self.on_first_ring, None
            if first is not None:
                first(spec)
            return spec

    def _read(self, generation: int, reason: str, deadline: float) -> dict:
        """The mailbox's next answer; :class:`~elastic_ring.RendezvousError` when the driver fell silent until
        ``deadline`` or the mailbox stopped reading."""
        try:
            msg = self._mailbox.next(max(0.0, deadline - time.monotonic()))
        except NoticeFailed as exc:  # (the mailbox reported it to the driver too)
            raise er.RendezvousError(f"worker {self._id}: its mailbox stopped reading while waiting for ring "
                                     f"{generation} ({reason}): {exc}") from exc
        except (RuntimeError, OSError) as exc:
            raise er.RendezvousError(f"worker {self._id} lost the driver's rendezvous store while waiting for "
                                     f"ring {generation} ({reason}): {exc}; the driver process probably "
                                     "ended") from exc
        except Exception as exc:  # any other end of its reading (e.g. a reader that could not be replaced)
            raise er.RendezvousError(f"worker {self._id}: its mailbox stopped reading while waiting for ring "
                                     f"{generation} ({reason}): {type(exc).__name__}: {exc}") from exc
        if msg is None:
            raise er.RendezvousError(
                f"worker {self._id}: no word from the driver for {self._silence_s:.0f} s (heartbeat_timeout_s) "
                f"while waiting for ring {generation} ({reason}); the driver is stuck or its messages are lost")
        return msg

    @property
    def holds_state(self) -> bool:
        """It completed a sync (repeated in every heartbeat, in case the ``synced`` message was lost)."""
        return bool(self._synced_rounds)

    def synced(self) -> None:
        """This worker holds the job's state now (the driver roots rings only at such workers)."""
        round_id = er.round_id()
        if round_id not in self._synced_rounds:
            self._synced_rounds.add(round_id)
            self._send.send(self._keys.driver_inbox, WorkerKind.SYNCED, round=round_id)

    def reform_after_sync(self) -> bool:
        """This round only hands the state over (its leaving members hold it): re-form right after the sync."""
        return self._handover_round is not None and self._handover_round == er.round_id()

    def stop_pending(self) -> bool:
        """This round commits right after its sync: the job stops in it, or it only writes the state durably
        (a drain's final write) and re-forms (the driver said so with the ring)."""
        notice = membership.pending()
        return notice.stop or notice.persist and notice.change
