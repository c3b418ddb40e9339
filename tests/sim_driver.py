"""A driver's real loop (``Driver.run``: states, decisions, pool records, ring answers through a real store) with
the pool's Ray calls replaced as in ``benchmarks.control_plane`` (:class:`benchmarks._control_pool.SimPool`), and
``n`` workers simulated by the test: :class:`SimJob`, and the ``job`` fixture that makes them and closes them."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from benchmarks._control_pool import SimPool
from elastic_ring.core.auth import new_secret
from elastic_ring.ring.store import StoreServer
from ray_integration.config import TrainerConfig
from ray_integration.driver.events import EventLog
from ray_integration.driver.loop import Driver
from ray_integration.driver.states import Running
from ray_integration.wire.channel import Channel, Inbox
from ray_integration.wire.protocol import DRIVER, Keys, WorkerKind
from ray_integration.wire.settings import WorkerSettings


class SimJob:
    """A driver and its pool over a real store, with ``n`` simulated workers sending through ``wakeups`` (or, with
    ``inbox``, through the store's queue and the driver's real inbox thread, whose reading ``self.reading`` gates)."""

    def __init__(self, n: int, inbox: bool = False, **config: float) -> None:
        self.server = StoreServer("127.0.0.1")
        self.secret, self.keys = secret, keys = new_secret(), Keys("job-pacing")
        config = TrainerConfig(**{"min_workers": n, "max_workers": n, "progress": False, **config})
        self.wakeups: "queue.SimpleQueue" = queue.SimpleQueue()
        self.order = [f"{i:08x}" for i in range(n)]
        nodes = {wid: f"{i // 8:056x}" for i, wid in enumerate(self.order)}
        self.pool = SimPool(config, Channel(self.server.store, secret, DRIVER), "127.0.0.1", self.server.address.port,
                            keys, secret, None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0),
                            wakeups=self.wakeups, nodes=nodes, order=self.order, command=lambda kind, wids: None)
        self.driver = Driver(config, self.pool, "127.0.0.1", EventLog(), self.wakeups)
        self.seq = {wid: 0 for wid in self.order}
        self.steps: list[float] = []
        advance = self.driver.advance

        def counted(state):
            self.steps.append(time.monotonic())
            self.state = advance(state)
            return self.state

        self.state = None
        self.driver.advance = counted  # type: ignore[method-assign]
        self.contexts = 0
        context = self.driver.context

        def counted_context():
            self.contexts += 1
            return context()

        self.driver.context = counted_context  # type: ignore[method-assign]
        self.reading = threading.Event()
        self.reading.set()
        self.inbox = None
        if inbox:
            self.inbox = Inbox(Channel(self.server.connect(10.0), secret, DRIVER), keys.driver_inbox, self.wakeups,
                               on_message=lambda msg: self.reading.wait())
            self.inbox.start()
            self.senders = {wid: Channel(self.server.connect(10.0), secret, wid) for wid in self.order}
        self.result: list = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.driver.run()), daemon=True)
        self.thread.start()

    def message(self, wid: str, kind: WorkerKind = WorkerKind.HEARTBEAT, **fields) -> None:
        self.seq[wid] += 1
        if kind is WorkerKind.HEARTBEAT:
            fields.setdefault("seq", self.seq[wid])
        if self.inbox is not None:  # sealed, through the store's queue and the inbox thread
            self.senders[wid].send(self.keys.driver_inbox, kind.value, **fields)
        else:
            self.wakeups.put(("msg", {"from": wid, "n": self.seq[wid], "k": kind.value, **fields}))

    def wait(self, predicate, what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    def running(self) -> None:
        """Every worker starts and asks for its first ring; the ring forms."""
        self.wait(lambda: all(r.info for r in self.pool.records.values()) and len(self.pool.records) == len(self.order),
                  "the workers started")
        for wid in self.order:
            self.message(wid, waiting=1, reason="start", synced=True)
        self.wait(lambda: isinstance(self.state, Running), "the first ring formed")
        for wid in self.order:
            self.message(wid)  # formed: no longer waiting

    def close(self) -> None:
        self.reading.set()
        self.driver.abort("the test ends")
        self.wakeups.put(("stop", "the test ends"))
        self.thread.join(10)
        if self.inbox is not None:
            self.inbox.close(lambda: self.driver.pool.send.send(self.keys.driver_inbox, "wake"))
        self.server.close()


@pytest.fixture
def job():
    jobs: list[SimJob] = []
    yield lambda n, **kw: jobs.append(SimJob(n, **kw)) or jobs[-1]
    for j in jobs:
        j.close()
