"""The worker's mailbox (issue 34): the driver's notices about the current ring (abort, re-form/persist/stop,
preemption) travel through each worker's store queue, read by one thread for the worker's whole life, instead of a
Ray actor call per member. Real store, real sealed channels, the real pool's methods and the real handlers."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.collectives import preemption
from elastic_ring.core.auth import new_secret
from elastic_ring.ring import runtime
from elastic_ring.ring.store import StoreServer, connect
from ray_integration.config import TrainerConfig
from ray_integration.driver.pool import WorkerPool
from ray_integration.driver.records import WorkerRecord
from ray_integration.wire.channel import REPLAY_WINDOW, Channel
from ray_integration.wire.protocol import DRIVER, KEEPALIVE, DriverKind, Keys
from ray_integration.wire.settings import WorkerSettings
from ray_integration.worker.mailbox import ANSWERS, NOTICE_HANDLERS, Mailbox, NoticeFailed
from state import membership
from tests.relay import Relay


class NoRay:
    """A worker record's actor that fails the test if the pool calls it (a notice must not be a Ray call)."""

    def __getattr__(self, name):
        raise AssertionError(f"the pool made a Ray actor call ({name}) for a notice")


@pytest.fixture
def job():
    server = StoreServer("127.0.0.1")
    secret, keys = new_secret(), Keys("job-mailbox")
    pool = WorkerPool(TrainerConfig(min_workers=1, max_workers=4, progress=False),
                      Channel(server.store, secret, DRIVER), "127.0.0.1", server.address.port, keys, secret, None, {},
                      WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0))
    boxes: list[Mailbox] = []

    def mailbox(worker_id, handlers, on_failure=None, store=None):
        pool.records[worker_id] = WorkerRecord(worker_id, actor=NoRay(), info_ref=None, run_ref=None,
                                               created_at=time.monotonic())
        box = Mailbox(Channel(store or server.connect(10.0), secret, worker_id, replay_window=REPLAY_WINDOW),
                      keys.worker_inbox(worker_id),
                      handlers, on_failure)
        box.start()
        boxes.append(box)
        return box

    yield pool, mailbox, server, secret, keys
    for box in boxes:
        box.close()
    membership.reset()
    preemption.post(None)


def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.005)


def test_every_kind_the_driver_sends_a_worker_is_read_by_its_mailbox():
    to_workers = set(DriverKind) - {DriverKind.WAKE, DriverKind.PROBE}  # (those two go to the driver's own queue)
    assert ANSWERS | set(NOTICE_HANDLERS) == to_workers and not ANSWERS & set(NOTICE_HANDLERS)
    with pytest.raises(ValueError, match="are ring answers"):
        Mailbox(None, "q", {DriverKind.RING: print})


def test_the_pools_notices_reach_every_worker_in_order_through_the_store_without_a_ray_call(job):
    pool, mailbox, *_ = job
    got: dict[str, list] = {}
    for w in ("a", "b", "c"):
        got[w] = []
        mailbox(w, {kind: (lambda msg, w=w: got[w].append((msg["k"], msg.get("round"))))
                    for kind in NOTICE_HANDLERS})
    records = list(pool.records.values())
    records[2].dead = True  # a dead member is told nothing
    pool.abort_round(records, 7, "a member of round 7 was lost")
    pool.notify(records, 8, change=True)
    pool.tell_preemption(records, {"seq": 1, "deadline_ms": 0, "nodes": {"n1": [0]}})
    _until(lambda: len(got["a"]) == 3 and len(got["b"]) == 3)
    assert got["a"] == got["b"] == [("abort", 7), ("notice", 8), ("preemption", None)]  # the driver's order
    time.sleep(0.2)
    assert got["c"] == []


def test_the_real_handlers_act_while_nobody_waits_for_a_ring(job):
    pool, mailbox, *_ = job
    membership.reset()
    box = mailbox("w", NOTICE_HANDLERS)
    record = pool.records["w"]
    pool.notify([record], 5, change=True, persist=True, persist_id=3, within_s=30.0)
    _until(lambda: membership.pending(5).persist_id == 3)
    notice = membership.pending(5)
    assert notice.change and notice.persist and not notice.stop
    assert 25 < notice.persist_by - time.monotonic() <= 30  # on this process's own clock, from the arrival

    pool.tell_preemption([record], {"seq": 4, "deadline_ms": 1234, "nodes": {"node-1": [0, 1]}})
    _until(lambda: preemption._local() is not None and preemption._local()["seq"] == 4)
    assert preemption._local()["nodes"] == {"node-1": [0, 1]}

    # an abort of the next round before this process forms it: its formation fails at once when it comes
    server = StoreServer("127.0.0.1")
    key = new_secret()
    spec = lambda round_id: er.RingSpec(round_id=round_id, rank=0, world_size=1, store=server.address,  # noqa: E731
                                        job_id="mailbox", auth_key=key, connect_timeout_s=30)
    comm = runtime.init(spec(40))  # this process's ring of that job (of one rank), in use
    try:
        pool.abort_round([record], 41, "a member of round 41 was lost")
        _until(lambda: comm.errored)  # the ring in use fails (a collective blocked on it would raise now) ...
        with pytest.raises(er.CommError, match="round 41 was aborted before it formed: a member of round 41 was lost"):
            runtime.init(spec(41))  # ... and so does the aborted round's formation, at once
        runtime.init(spec(42))  # a later round is not affected
    finally:
        runtime.shutdown()
    assert box.alive and box.next(0.05) is None  # notices are not answers


def test_a_drains_notice_carries_its_preemption_notice_and_the_worker_applies_both_from_one_message(job):
    pool, mailbox, *_ = job
    membership.reset()
    preemption.post(None)
    seen = []
    box = mailbox("w", {**NOTICE_HANDLERS, DriverKind.NOTICE: lambda msg: (seen.append(msg["k"]),
                                                                            NOTICE_HANDLERS[DriverKind.NOTICE](msg))})
    record = pool.records["w"]
    pool.notify([record], 6, change=True, preemption={"seq": 9, "deadline_ms": 777, "nodes": {"node-2": [1]}})
    _until(lambda: membership.pending(6).change)
    assert preemption._local()["seq"] == 9 and preemption._local()["nodes"] == {"node-2": [1]}
    assert seen == ["notice"]
    pool.repeat_notices([record], 6)  # a repeat sends the notice and the newest preemption notice
    _until(lambda: len(seen) == 2)
    assert box.alive


def test_answers_wait_for_the_rendezvous_and_notices_do_not_stand_in_their_way(job):
    pool, mailbox, server, secret, keys = job
    seen = []
    box = mailbox("w", {kind: seen.append for kind in NOTICE_HANDLERS})
    driver = pool.send
    driver.send(keys.worker_inbox("w"), DriverKind.PENDING, generation=1)
    driver.send(keys.worker_inbox("w"), DriverKind.ABORT, round=3, why="lost")
    driver.send(keys.worker_inbox("w"), DriverKind.STOP, generation=1, why="done")
    assert [box.next(5.0)["k"] for _ in range(2)] == ["pending", "stop"]
    _until(lambda: len(seen) == 1)
    started = time.monotonic()
    assert box.next(0.3) is None and 0.25 < time.monotonic() - started < 2.0  # its deadline, not a hang


def test_forged_and_foreign_messages_are_dropped_unread(job):
    pool, mailbox, server, secret, keys = job
    seen = []
    box = mailbox("w", {kind: seen.append for kind in NOTICE_HANDLERS})
    stranger = Channel(server.connect(10.0), new_secret(), DRIVER)  # not the job's secret
    stranger.send(keys.worker_inbox("w"), DriverKind.ABORT, round=1, why="forged")
    peer = Channel(server.connect(10.0), secret, "another-worker")  # genuine, but not the driver's
    peer.send(keys.worker_inbox("w"), DriverKind.ABORT, round=2, why="not the driver")
    pool.abort_round([pool.records["w"]], 3, "the driver's")
    _until(lambda: len(seen) == 1)
    time.sleep(0.1)
    assert [m["round"] for m in seen] == [3] and box._channel.forged == 1


def test_a_notice_it_cannot_apply_ends_the_thread_loudly(job):
    pool, mailbox, server, secret, keys = job
    failures = []
    box = mailbox("w", NOTICE_HANDLERS, on_failure=failures.append)
    pool.send.send(keys.worker_inbox("w"), DriverKind.ABORT, why="no round named")
    _until(lambda: failures)
    assert isinstance(failures[0], NoticeFailed) and "names no round" in str(failures[0])
    with pytest.raises(NoticeFailed, match="names no round"):
        box.next(5.0)  # the rendezvous's next wait raises it too: nobody waits on a reader that is gone
    assert not box.alive


def _on_a_store_of_its_own(mailbox, failures):
    """A store server the test can make go away, and a mailbox reading from it."""
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", other.port, is_master=False, wait_for_workers=False)
    return other, mailbox("w", NOTICE_HANDLERS, on_failure=failures.append, store=client)


def test_a_store_that_is_gone_ends_the_thread_after_its_retries_and_wakes_the_waiting_rendezvous(job):
    pool, mailbox, *_ = job
    failures = []
    other, box = _on_a_store_of_its_own(mailbox, failures)
    raised = []

    def wait():
        try:
            box.next(60.0)
        except (RuntimeError, OSError) as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    del other  # the store server goes away (its process ended)
    waiter.join(30)
    assert raised and failures and time.monotonic() - started < 30
    assert "reading the worker's queue" in str(raised[0])


def test_a_closed_mailbox_does_not_report_the_store_going_away(job):
    pool, mailbox, *_ = job
    failures = []
    other, box = _on_a_store_of_its_own(mailbox, failures)
    box.close()  # the worker's run ended
    del other
    _until(lambda: not box.alive, timeout_s=30)
    assert failures == []


def test_a_reader_stuck_on_a_silently_dead_connection_is_replaced_and_nothing_pushed_meanwhile_is_lost(job):
    pool, mailbox, server, secret, keys = job
    relay = Relay(server.address)
    try:
        through_relay = lambda: connect(er.StoreAddress("127.0.0.1", relay.port), 10.0)  # noqa: E731
        got = []
        own = Channel(server.connect(10.0), secret, "w")  # the worker's sending channel: its keepalives go out there
        box = Mailbox(Channel(through_relay(), secret, "w", connect=through_relay), keys.worker_inbox("w"),
                      {DriverKind.ABORT: lambda msg: got.append(msg["round"])}, send=own, idle_s=0.6,
                      keepalive_s=0.2)
        box.start()
        pool.send.send(keys.worker_inbox("w"), DriverKind.ABORT, round=1, why="lost")
        time.sleep(2.0)  # a quiet connection that carries: its keepalives come back, the reader is never replaced
        assert got == [1] and box.replaced == 0 and box._keepalives >= 5
        relay.black_hole()  # the reader now waits for ever: TCPStore's timeout cannot end its pop
        started = time.monotonic()
        pool.send.send(keys.worker_inbox("w"), DriverKind.ABORT, round=2, why="lost while the flow was dead")
        _until(lambda: got == [1, 2])
        assert box.replaced == 1 and box.alive and time.monotonic() - started < 5.0
        pool.send.send(keys.worker_inbox("w"), DriverKind.ABORT, round=3, why="lost")
        _until(lambda: got == [1, 2, 3])
        time.sleep(1.5)
        assert box.replaced == 1  # the new reader's keepalives come back
        box.close()
    finally:
        relay.close()


def test_a_replaced_reader_that_wakes_hands_its_message_over_and_nothing_is_taken_for_a_replay(job):
    """The first reader is replaced while it is only slow (descheduled between its pop and its check): it then
    checks an older message than its successor already did. Both are handled, and a replay is still refused."""
    pool, mailbox, server, secret, keys = job
    inbox = keys.worker_inbox("w")
    connect_direct = lambda: server.connect(10.0)  # noqa: E731
    got = []
    first = Channel(connect_direct(), secret, "w", connect=connect_direct, replay_window=REPLAY_WINDOW)
    release = threading.Event()
    real_verify = first.verify

    def slow_verify(key, raw):  # the old reader holds the driver's first message and does not run for a while
        if not release.is_set() and (b'"round": 1' in raw or b'"round":1' in raw):
            release.wait()
        return real_verify(key, raw)

    first.verify = slow_verify
    box = Mailbox(first, inbox, {DriverKind.ABORT: lambda msg: got.append(msg["round"])},
                  send=Channel(connect_direct(), secret, "w"), idle_s=0.6, keepalive_s=0.2)
    box.start()
    sealed = []
    real_push = server.store.queue_push
    tap = type("Tap", (), {"queue_push": lambda self, k, v: (sealed.append(v), real_push(k, v))[1]})()
    pool.send._store, kept = tap, pool.send._store
    pool.send.send(inbox, DriverKind.ABORT, round=1, why="first")  # the old reader takes it, and stalls
    pool.send._store = kept
    _until(lambda: box.replaced == 1)  # its keepalive did not come back: a new reader on a fresh connection
    others = [WorkerRecord(f"o{i}", actor=NoRay(), info_ref=None, run_ref=None, created_at=0.0) for i in range(70)]
    pool.abort_round(others, 1, "to 70 other members: numbered per queue, no gap in this worker's numbers")
    pool.send.send(inbox, DriverKind.ABORT, round=2, why="second")
    _until(lambda: got == [2])  # the new reader's, checked first (its number is the higher one)
    release.set()
    _until(lambda: got == [2, 1])  # the old reader's, older but not seen: handed over, not taken for a replay
    for _ in range(2):
        real_push(inbox, sealed[0])  # a stranger pushes the captured first message again
    pool.send.send(inbox, DriverKind.ABORT, round=3, why="third")
    _until(lambda: 3 in got)
    time.sleep(0.3)
    assert got == [2, 1, 3]  # the replays were refused
    box.close()


def test_mailbox_options_are_checked():
    with pytest.raises(ValueError, match="idle_s=0 must be a positive number of seconds"):
        Mailbox(None, "q", NOTICE_HANDLERS, send=object(), idle_s=0)
    with pytest.raises(ValueError, match="send and idle_s go together"):
        Mailbox(None, "q", NOTICE_HANDLERS, idle_s=5.0)
    with pytest.raises(ValueError, match="keepalive_s=-1 must be a positive"):
        Mailbox(None, "q", NOTICE_HANDLERS, keepalive_s=-1)


def test_a_process_that_did_not_run_gives_its_reader_a_grace_instead_of_replacing_it(job):
    """A SIGSTOPped worker's reader cannot read its keepalive while stopped: not a dead connection."""
    pool, mailbox, server, secret, keys = job
    got = []
    connect_direct = lambda: server.connect(10.0)  # noqa: E731
    first = Channel(connect_direct(), secret, "w", connect=connect_direct)
    reading = threading.Event()
    reading.set()
    real_receive = first.receive

    def receive_like_a_stopped_process(key, timeout_s):
        msg = real_receive(key, timeout_s)
        reading.wait()  # the reader does not run while the process is stopped
        return msg

    first.receive = receive_like_a_stopped_process
    box = Mailbox(first, keys.worker_inbox("w"), {DriverKind.ABORT: lambda msg: got.append(msg["round"])},
                  send=Channel(connect_direct(), secret, "w"), idle_s=1.2, keepalive_s=0.4)
    stopped = threading.Event()
    real_wait = box._closing.wait

    def wait_like_a_stopped_process(timeout):  # the watchdog's own sleep overshoots too, as the process stops
        if box._keepalive is not None and not stopped.is_set():
            stopped.set()
            reading.clear()  # the process stops with its keepalive on its way ...
            time.sleep(2.0)  # ... and runs again 2 s later (longer than idle_s), its reader a little after this
            threading.Timer(0.3, reading.set).start()  # thread: the watchdog looks first
        return real_wait(timeout)

    box._closing.wait = wait_like_a_stopped_process
    box.start()
    _until(stopped.is_set)
    time.sleep(3.0)
    assert box.replaced == 0  # the keepalive came back once the process ran again
    pool.send.send(keys.worker_inbox("w"), DriverKind.ABORT, round=9, why="lost")
    _until(lambda: got == [9])
    box.close()


def test_a_notice_taken_from_the_queue_by_a_stranger_arrives_with_the_repeat(job):
    pool, mailbox, server, secret, keys = job
    membership.reset()
    pool.records["w"] = WorkerRecord("w", actor=NoRay(), info_ref=None, run_ref=None, created_at=time.monotonic())
    record = pool.records["w"]
    pool.notify([record], 5, change=True)  # an older round's: not pushed again for round 6
    pool.notify([record], 6, change=True, persist=True, persist_id=4, within_s=30.0)
    pool.notify([record], 6, stop=True)
    pool.tell_preemption([record], {"seq": 2, "deadline_ms": 0, "nodes": {"n": [0]}})
    inbox = keys.worker_inbox("w")
    stolen = [server.store.queue_pop(inbox) for _ in range(4)]  # a stranger takes them all
    assert len(stolen) == 4 and server.store.queue_len(inbox) == 0
    time.sleep(0.5)
    pool.repeat_notices([record], 6)
    got = []
    handlers = {kind: (lambda msg, real=real: (got.append((msg["k"], msg.get("round"))), real(msg)))
                for kind, real in NOTICE_HANDLERS.items()}
    mailbox("w", handlers)
    _until(lambda: len(got) == 3)
    assert got == [("notice", 6), ("notice", 6), ("preemption", None)]
    notice = membership.pending(6)
    assert notice.change and notice.persist and notice.stop and notice.persist_id == 4
    assert 28.0 < notice.persist_by - time.monotonic() <= 29.6  # the write's deadline less the time since it was sent
    assert preemption._local()["seq"] == 2
