"""What the driver and the workers say to each other, and where.

The rendezvous store lives in the driver's process. Driver and workers talk
through its *queues*, one per receiver, in sealed JSON messages
(:mod:`.channel`); nothing is pickled and nothing unauthenticated is used.
Every message carries its sender (``from``), the sender's message counter
(``n``: a receiver drops a number it has already seen, so a captured message
cannot be replayed) and its kind (``k``: a :class:`WorkerKind` or a
:class:`DriverKind`, sent as its string). All names are made here, so the two
sides cannot drift apart.

Worker -> driver (queue ``{job}/driver``):

* ``hb``: a heartbeat every ``heartbeat_interval_s`` with the worker's
  heartbeat counter ``seq`` and, while it waits for a ring, the ``waiting``
  generation and ``reason``. The driver times silence on its own monotonic
  clock (time since the counter last advanced); no clocks are compared across
  hosts. A repeated ``waiting`` also recovers a lost request or answer.
* ``node_hb``: one worker's forward of its Ray node's heartbeats (``ElasticTrainer(heartbeats="node")``:
  :mod:`ray_integration.worker.node_beats`): ``beats`` maps worker ids to what each one's ``hb`` would carry
  (``seq``, ``synced``, ``waiting``, ``reason``). The driver applies each as that worker's heartbeat, but only for
  workers its records place on the sender's node (others are ignored and counted). A worker whose node's forwarder
  stalls sends its own ``hb`` meanwhile.
* ``ring_request``: ``generation``, ``reason`` (``start``, ``failure``, ``membership``);
* ``synced``: the worker completed a sync (it holds the job's state from now on);
* ``report``: one of rank 0's ``er.report`` records;
* ``timeline``: a batch of timeline events (``events``, ``dropped``, ``host``);
* ``resumed``: the checkpoint the job resumed from;
* ``checkpoint``: a durable checkpoint was written or failed;
* ``fault``: a worker thread failed (``what``, ``error``), just before the worker goes silent.

Driver -> worker (queue ``{job}/w/{worker_id}``), read by the worker's mailbox thread for its whole life
(:mod:`ray_integration.worker.mailbox`). Answers to its ring request:

* ``ring``: ``generation``, ``spec`` (a :class:`~elastic_ring.RingSpec` as plain
  data, without the secret) and ``stop`` (the job stops in this round: commit
  right after the sync, written durably, and end);
* ``stop``: ``generation``, ``why``: this worker is in no next ring;
* ``pending``: ``generation``: the driver is alive and still deciding (sent for
  a waiting worker's heartbeats, at most once per worker per heartbeat interval). A worker gives up waiting only after
  ``heartbeat_timeout_s`` without any word from the driver.

Notices about the *current* ring, acted on while ``fn`` trains, each tagged with the round it is for:

* ``abort``: ``round``, ``why``: a member of that round was lost; a collective or a formation of the round (or an
  older one) that waits on it fails now instead of at its timeout;
* ``notice``: ``round``, ``change``, ``persist``, ``stop`` and, for a drain's write, ``persist_id`` and
  ``within_s``: what the round does at its next commit (:mod:`state.membership`);
* ``preemption``: ``notice``: the ring's preemption notice (``seq``, ``deadline_ms``, ``nodes``), what
  ``get_preemption_info()`` answers.

And from the worker itself, ``keepalive`` (:data:`KEEPALIVE`, ``seq``): its mailbox's check that its connection
still carries.

The notices went through one Ray actor call per member before; a push into the member's queue costs the driver's loop
tens of microseconds instead of 0.2–0.4 ms, and one queue keeps the driver's order.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

DRIVER = "driver"


class Returned(NamedTuple):
    """What a worker's ``run`` returns to the driver (through Ray's own result): ``fn``'s ``value`` and the generation
    the worker last ``asked`` a ring for. A ring given before it asked (:func:`ray_integration.driver.decisions.
    prompt_ring`) was asked for after all when ``asked`` reached it, even if the request itself is still on its way
    (or lost): the driver need not wait for it to know."""

    value: Any
    asked: int

#: The kind of the message a worker's mailbox pushes into its own queue after a while without any
#: (:data:`ray_integration.worker.mailbox.KEEPALIVE_S`): the mailbox's connection, which may wait long for the
#: driver's next word, carries something at least that often, and a reader whose keepalive does not come back is
#: replaced by one on a fresh connection.
KEEPALIVE = "keepalive"


class _Kind(str, enum.Enum):
    """A message kind: a ``str`` (it is sent as its value in the JSON message) that prints as its value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, msg: dict) -> "_Kind | None":
        """The kind of a received message, or None if it names none of this class (ignored: a newer sender)."""
        try:
            return cls(msg.get("k"))
        except ValueError:
            return None


class WorkerKind(_Kind):
    """What a worker sends to the driver (queue ``{job}/driver``)."""

    HEARTBEAT = "hb"
    NODE_HEARTBEAT = "node_hb"
    RING_REQUEST = "ring_request"
    SYNCED = "synced"
    REPORT = "report"
    TIMELINE = "timeline"
    RESUMED = "resumed"
    CHECKPOINT = "checkpoint"
    FAULT = "fault"


class DriverKind(_Kind):
    """What the driver sends to a worker (queue ``{job}/w/{worker_id}``), and ``WAKE`` and ``PROBE`` to its own
    queue (``WAKE`` ends the driver's blocking read at the end of a run; ``PROBE`` times how far behind it reads:
    :class:`~.channel.InboxProbe`)."""

    RING = "ring"
    STOP = "stop"
    PENDING = "pending"
    ABORT = "abort"
    NOTICE = "notice"
    PREEMPTION = "preemption"
    WAKE = "wake"
    PROBE = "probe"


#: The trace thread of each timeline event category, in this order: the driver's timeline file
#: (``ElasticTrainer(timeline_path=...)``) and ``hvd.start_timeline``'s file lay their traces out alike.
CATEGORY_THREADS = {"collective": 1, "fusion": 2, "state": 3, "membership": 4}


class Keys:
    def __init__(self, job_id: str) -> None:
        self.job = job_id

    @property
    def driver_inbox(self) -> str:
        return f"{self.job}/driver"

    def worker_inbox(self, worker_id: str) -> str:
        return f"{self.job}/w/{worker_id}"

    def round_prefix(self, round_id: int) -> str:
        """The store keys of one round (gloo's and NCCL's rendezvous) start with this."""
        return f"{self.job}/round{round_id}/"
