"""The driver at many workers (issue 34): when its loop steps its state (ray_integration.driver.pacing: every
message is applied at once, but the state, whose step costs O(members), steps only for what may change a decision
or at the tick); one Context per step unless an action changed something; silence judged net of how far behind the
driver reads its inbox (wire.channel.InboxProbe); lost answers sent again net of that delay, backing off.

The loop tests run the real ``Driver.run`` with the pool's Ray calls replaced (:mod:`tests.sim_driver`)."""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time

import pytest

from benchmarks._control_pool import SimPool
from elastic_ring.core.auth import new_secret
from elastic_ring.ring.store import StoreServer
from ray_integration.config import TrainerConfig
from ray_integration.driver import pacing
from ray_integration.driver.events import EventLog
from ray_integration.driver.loop import TICK_S, Driver
from ray_integration.driver.context import AddEvent, DropRing, KillSilent, Notify
from ray_integration.driver.states import DriverState, Reforming, Running
from ray_integration.wire.channel import Channel, InboxProbe
from ray_integration.wire.protocol import DRIVER, Keys, WorkerKind
from ray_integration.wire.settings import WorkerSettings
from tests.sim_driver import job  # noqa: F401  (the fixture)


@pytest.mark.parametrize("kind, changed, wakes", [
    ("hb", False, False),            # a counter advanced: the tick will do
    ("hb", True, True),              # a new ring request
    ("node_hb", False, False),       # a node's heartbeats in one message (heartbeats="node")
    ("node_hb", True, True),         # one of them asks for a ring
    ("report", False, False),
    ("timeline", False, False),
    ("ring_request", False, True),   # every other kind steps at once
    ("ring_request", True, True),
    ("synced", False, False),        # every member's, after each round's sync: the tick will do
    ("fault", False, True),
    ("checkpoint", False, True),
    ("resumed", False, True),
])
def test_which_messages_wake_the_states(kind, changed, wakes):
    assert pacing.wakes_states(kind, changed) is wakes


@pytest.mark.parametrize("relevant, since_step_s, last_step_s, due", [
    (True, 0.0, 0.0, True), (False, 0.0, 0.0, False), (False, 0.099, 0.0, False), (False, 0.1, 0.0, True),
    (False, 5.0, 0.0, True),
    (True, 0.0005, 0.0001, True),     # a step of 0.1 ms (a few dozen members): a request steps at once
    (True, 0.003, 0.001, False),      # a step of 1 ms: the next waits until the loop has stepped a quarter
    (True, 0.004, 0.001, True),       # of the time since the last one began
    (True, 0.05, 0.05, False),        # a step of 50 ms: never later than the tick
    (True, 0.1, 0.05, True),
    (False, 0.05, 0.001, False),      # nothing relevant: the tick
])
def test_when_a_step_is_due(relevant, since_step_s, last_step_s, due):
    assert pacing.step_due(relevant, since_step_s, 0.1, last_step_s) is due


@pytest.mark.parametrize("since_s, repeats, due", [
    (1.9, 0, False), (2.0, 0, True), (3.9, 1, False), (4.0, 1, True), (16.0, 3, True), (31.9, 4, False),
    (32.0, 4, True), (1000.0, 5, False),  # five times at most
])
def test_when_a_rounds_notices_are_pushed_again(since_s, repeats, due):
    assert pacing.notice_repeat_due(since_s, repeats) is due


def test_heartbeats_of_running_members_step_the_state_only_at_the_tick(job):
    j = job(16)
    j.running()
    time.sleep(0.3)
    before, started = len(j.steps), time.monotonic()
    for batch in range(20):  # 1,000 heartbeats over about 0.5 s, in batches as the inbox hands them over
        for i in range(50):
            j.message(j.order[(batch * 50 + i) % len(j.order)])
        time.sleep(0.025)
    j.wait(lambda: all(r.beat_seq == j.seq[w] for w, r in j.pool.records.items()), "every heartbeat applied")
    elapsed = time.monotonic() - started
    steps = len(j.steps) - before
    assert steps <= math.ceil(elapsed / TICK_S) + 1, f"{steps} steps in {elapsed:.2f} s for 1,000 heartbeats"
    assert isinstance(j.state, Running) and not any(r.dead for r in j.pool.records.values())


def test_a_ring_request_steps_the_state_at_once(job):
    j = job(16)
    j.running()
    latencies = []
    for i, wid in enumerate(j.order[:5]):
        stepped = len(j.steps)
        j.wait(lambda: len(j.steps) > stepped, "a tick")  # just after a step: the next tick is TICK_S away
        before, sent = len(j.steps), time.monotonic()
        j.message(wid, WorkerKind.RING_REQUEST, generation=2, reason="membership")
        j.wait(lambda: len(j.steps) > before, "a step")
        latencies.append(j.steps[before] - sent)
        j.wait(lambda: j.pool.records[wid].generation == 2, "the request applied")
    assert statistics.median(latencies) < 0.75 * TICK_S, latencies  # (the tick would be TICK_S away)


def test_a_burst_of_requests_leaves_the_inbox_three_quarters_of_the_loop(job):
    """At 1,024 members a step costs several ms, and the re-form after a loss brings 1,023 ring requests: stepping at
    once for each kept the loop stepping back to back, and the inbox thread (which needs the GIL after each pop)
    handed over about one message per step. The loop now steps at most MAX_STEP_SHARE of the time while requests
    keep coming. Here every step holds the GIL 10 ms longer and a sealed request arrives through the store and the
    real inbox thread every 2 ms for 0.6 s."""
    j = job(16, inbox=True)
    j.running()
    advance, busy = j.driver.advance, []

    def slow(state):
        started = time.perf_counter()
        while time.perf_counter() - started < 0.01:  # the GIL held, as a step over many members holds it
            pass
        out = advance(state)
        busy.append((started, time.perf_counter()))
        return out

    j.driver.advance = slow  # type: ignore[method-assign]
    time.sleep(0.2)
    started = time.perf_counter()
    while time.perf_counter() - started < 0.6:
        j.message(j.order[0], WorkerKind.RING_REQUEST, generation=2, reason="failure")
        time.sleep(0.002)
    ended = time.perf_counter()
    stepping = sum(min(b, ended) - max(a, started) for a, b in busy if b > started and a < ended)
    assert stepping <= (pacing.MAX_STEP_SHARE + 0.1) * (ended - started) + 0.02, (stepping, ended - started, len(busy))
    j.wait(lambda: j.pool.records[j.order[0]].generation == 2, "the request applied")


# ---------------------------------------------------------------- one Context per step (plan item 2)
def test_a_quiet_step_builds_one_context(job):
    j = job(16)
    j.running()
    time.sleep(0.3)
    steps, contexts = len(j.steps), j.contexts
    time.sleep(0.5)  # ticks of a running ring where nothing happens
    assert len(j.steps) > steps
    assert j.contexts - contexts == len(j.steps) - steps, (j.contexts - contexts, len(j.steps) - steps)


class _Watch(DriverState):
    """A state that yields ``actions`` and keeps the Context it is shown after each."""

    def __init__(self, *actions) -> None:
        self.actions, self.seen = actions, []

    def step(self, ctx):
        for action in self.actions:
            self.seen.append((yield action))
        return self


def test_the_context_after_an_action_shows_what_it_changed(job):
    j = job(16, inbox=True)
    j.running()
    j.wait(lambda: all(r.beat_seq == j.seq[w] for w, r in j.pool.records.items()), "every heartbeat applied")
    j.driver.abort("watched")  # the loop ends (nothing else acts); then the watched step is driven here
    j.wakeups.put(("stop", "watched"))
    j.thread.join(10)
    j.wait(lambda: j.pool.inbox_backlog() == 0, "the inbox read")  # (unread messages hold silence verdicts back)
    victim = j.order[3]
    j.pool.records[victim].beat_at -= 60  # silent past heartbeat_timeout_s; the others are heard
    watch = _Watch(AddEvent("x"), KillSilent(), AddEvent("y"), Notify(), DropRing())
    j.driver.advance(watch)
    after_event, after_kill, after_second_event, after_notify, after_drop = watch.seen
    assert not any(m.dead for m in after_event.members)
    assert [m.worker_id for m in after_kill.members if m.dead] == [victim]
    assert after_second_event is after_kill and after_notify is after_kill  # nothing changed: the same Context
    assert after_drop is not after_kill and after_drop.members == () and after_drop.world_size is None


# ---------------------------------------------------------------- a driver behind its inbox (plan item 4)
def test_a_driver_behind_its_inbox_kills_no_healthy_worker_and_still_the_frozen_one(job):
    j = job(8, inbox=True, heartbeat_interval_s=0.2, heartbeat_timeout_s=4.0)
    waits: dict[str, tuple[int, str]] = {}
    beating, stop = set(j.order), threading.Event()

    def beat() -> None:  # each worker's heartbeat every interval, through the store's queue
        while not stop.is_set():
            for wid in sorted(beating):
                gen, reason = waits.get(wid, (0, None))
                j.message(wid, waiting=gen, reason=reason, synced=True)
            stop.wait(0.2)

    j.wait(lambda: len(j.pool.records) == 8 and all(r.info for r in j.pool.records.values()), "the workers started")
    waits.update({w: (1, "start") for w in j.order})
    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        j.wait(lambda: isinstance(j.state, Running), "the first ring formed")
        waits.clear()
        time.sleep(0.6)
        lost, frozen = j.order[0], j.order[7]
        beating -= {lost, frozen}  # a process lost (Ray says so) and one frozen (Ray does not know)
        j.wakeups.put(("ray", [("dead", lost)]))
        waits.update({w: (2, "failure") for w in j.order[1:4]})  # three survivors ask; three are still away
        j.wait(lambda: isinstance(j.state, Reforming), "the failure re-form began")
        j.reading.clear()  # the driver falls behind its inbox by 3 x suspect_after_s
        time.sleep(3 * j.driver.limits.suspect_after_s)
        j.reading.set()
        j.wait(lambda: j.pool.records[frozen].dead, "the frozen member is killed once the backlog is read", 5.0)
    finally:
        stop.set()
        beater.join(5)
    killed = sorted(w for w, r in j.pool.records.items() if r.dead)
    assert killed == sorted([lost, frozen]), {w: j.pool.records[w].cause for w in killed}


def test_a_cut_found_in_batches_is_not_taken_for_each_workers_broken_connection(job):
    """A live worker whose messages stopped while the driver hears the others is killed as a broken connection. When
    most stopped, it is not their connections (the store, the network, a starved cluster): killing them ended a
    simulated 1,024-worker job, batch after batch. Here 4 of 16 stop first (killed: 4 against 12 heard), then 5
    more within two heartbeat timeouts: 5 + 4 against 7 heard, a grace (``messages_lost``), nobody killed."""
    j = job(16, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    beating, waiting, stop = set(j.order), {}, threading.Event()

    def beat() -> None:
        while not stop.is_set():
            for wid in sorted(beating):
                j.message(wid, waiting=waiting.get(wid, 0), reason="failure" if wid in waiting else None, synced=True)
            stop.wait(0.2)

    j.running()
    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    first, cut, survivors = j.order[12:], j.order[7:12], j.order[:7]
    try:
        beating -= set(first)
        j.wait(lambda: all(j.pool.records[w].dead for w in first), "the first four were not killed", 5.0)
        assert all("connection to the job's store is broken" in j.pool.records[w].cause for w in first)
        beating -= set(cut)
        waiting.update({w: 2 for w in survivors})  # the survivors ask for the next ring; the cut stays silent
        lost = lambda: {e.detail.get("worker") for e in j.driver.events.events if e.kind == "messages_lost"}
        j.wait(lambda: set(cut) <= lost(), "the cut was not given a grace", 5.0)
        assert not any(j.pool.records[w].dead for w in cut), {w: j.pool.records[w].cause for w in cut}
    finally:
        stop.set()
        beater.join(5)


def test_the_inbox_probe_measures_how_far_behind_the_driver_reads():
    server = StoreServer("127.0.0.1")
    try:
        secret, key = new_secret(), "job-probe/driver"
        probe = InboxProbe(Channel(server.store, secret, DRIVER), key, interval_s=0.2, lost_after_s=1.0)
        receive = Channel(server.connect(10.0), secret, DRIVER)
        probe.tick(100.0)
        assert probe.delay_s(100.0) == 0.0 and probe.delay_s(100.5) == 0.5  # on its way: at least its age
        probe.tick(100.5)  # one at a time
        time.sleep(0.2)  # (a push has no round trip: let it land before counting on another connection)
        assert receive.pending(key) == 1
        msg = receive.receive(key, 5.0)
        assert probe.arrived(msg, 100.7) and probe.delay_s(100.7) == pytest.approx(0.7)
        assert not probe.arrived({"from": "w1", "k": "probe", "probe": 1}, 100.8)  # not the driver's
        probe.tick(100.8)
        assert probe.delay_s(101.0) == pytest.approx(0.7)  # the last one's, while the next is younger
        assert probe.delay_s(102.0) == pytest.approx(0.7)  # the next is lost: it stops counting
        probe.tick(102.0)  # and another goes
        time.sleep(0.2)
        assert receive.pending(key) == 2
    finally:
        server.close()


# ---------------------------------------------------------------- resending a lost answer (plan item 7)
def test_a_lost_answer_is_sent_again_net_of_the_inbox_delay_and_less_often_each_time():
    server = StoreServer("127.0.0.1")
    try:
        keys, wakeups = Keys("job-resend"), queue.SimpleQueue()
        config = TrainerConfig(min_workers=1, max_workers=1, progress=False)
        interval = config.heartbeat_interval_s
        pool = SimPool(config, Channel(server.store, new_secret(), DRIVER), "127.0.0.1", server.address.port, keys,
                       b"k" * 32, None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0),
                       wakeups=wakeups, nodes={"w": "n" * 56}, order=["w"], command=lambda kind, wids: None)
        pool.request(1)
        pool.apply_ray(wakeups.get()[1])
        record, seq = pool.records["w"], iter(range(1, 1000))

        def heartbeat() -> None:
            n = next(seq)
            pool.apply({"from": "w", "n": n, "k": "hb", "seq": n, "waiting": 1, "reason": "start"})

        def sent() -> int:
            return pool.send.pending(keys.worker_inbox("w"))

        heartbeat()
        pool.stop(record, "the answer the test loses")
        assert sent() == 1
        pool.inbox_delay_s = 3 * interval
        record.answered_at -= 3.5 * interval  # applied now, but sent before the answer arrived: the inbox is behind
        for _ in range(20):
            heartbeat()
        assert sent() == 1
        record.answered_at -= 2 * interval  # sent more than two intervals after the answer: it got lost
        heartbeat()
        assert sent() == 2
        record.answered_at -= 6 * interval  # the next resend waits twice as long: (2 + 3) x 2 intervals
        heartbeat()
        assert sent() == 2
        record.answered_at -= 4.5 * interval
        heartbeat()
        assert sent() == 3
    finally:
        server.close()


def test_a_heartbeat_wakes_the_states_only_with_news():
    server = StoreServer("127.0.0.1")
    try:
        wakeups = queue.SimpleQueue()
        config = TrainerConfig(min_workers=1, max_workers=1, progress=False)
        pool = SimPool(config, Channel(server.store, new_secret(), DRIVER), "127.0.0.1", server.address.port,
                       Keys("job-news"), b"k" * 32, None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0),
                       wakeups=wakeups, nodes={"w": "n" * 56}, order=["w"], command=lambda kind, wids: None)
        pool.request(1)
        pool.apply_ray(wakeups.get()[1])
        seq = iter(range(1, 100))

        def heartbeat(**fields) -> bool:
            n = next(seq)
            return pool.apply({"from": "w", "n": n, "k": "hb", "seq": n, **fields})

        assert heartbeat(waiting=1, reason="start")      # it asks for a ring
        assert not heartbeat(waiting=1, reason="start")  # the same request again
        assert not heartbeat(synced=True) and pool.records["w"].has_state  # noted; the tick will do
        pool.records["w"].beat_at -= 30
        assert not heartbeat()  # heard again after a gap (a driver behind its inbox hands heartbeats over in bursts)
    finally:
        server.close()


# ---------------------------------------------------------------- the silence scan (plan item 3, as a prefilter)
def test_the_silence_scan_builds_no_view_of_a_heard_worker(monkeypatch):
    from ray_integration.driver.records import WorkerRecord

    server = StoreServer("127.0.0.1")
    try:
        wakeups, order = queue.SimpleQueue(), [f"{i:08x}" for i in range(1000)]
        config = TrainerConfig(min_workers=1, max_workers=1000, progress=False)
        pool = SimPool(config, Channel(server.store, new_secret(), DRIVER), "127.0.0.1", server.address.port,
                       Keys("job-scan"), b"k" * 32, None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0),
                       wakeups=wakeups, nodes={w: f"{i // 8:056x}" for i, w in enumerate(order)}, order=order,
                       command=lambda kind, wids: None)
        driver = Driver(config, pool, "127.0.0.1", EventLog(), wakeups)
        pool.request(1000)
        pool.apply_ray(wakeups.get()[1])
        for record in pool.records.values():
            record.heard_at = record.beat_at  # heard: a silent one among them is lost, not a sign of tampering
        views = []
        view = WorkerRecord.view
        monkeypatch.setattr(WorkerRecord, "view", lambda self, *a: views.append(self.worker_id) or view(self, *a))
        assert not driver.kill_silent([], None) and views == []
        pool.records[order[500]].beat_at -= 60
        assert driver.kill_silent([], None) and pool.records[order[500]].dead and views == [order[500]]
    finally:
        server.close()


@pytest.mark.parametrize("fields, now, delay", [
    (dict(), 10.0, 0.0),                                                     # started, never heard
    (dict(generation=2, answered=1, reason="failure", beat_at=9.0), 10.0, 0.0),  # waits for a ring
    (dict(generation=2, answered=1, reason="failure", dead=True), 10.0, 0.0),    # dead: waits for nothing
    (dict(generation=1, answered=1, reason="start", beat_at=9.5), 10.0, 2.0),    # heard after the inbox delay
    (dict(leaving=True, leave_by=40.0, has_state=True, finished=True, beat_at=2.0), 10.0, 1.0),
])
def test_a_members_view_says_what_its_records_properties_say(fields, now, delay):
    """``WorkerRecord.view`` builds the view inline (one per member per step at 1,024 members); it must say what
    the record's own ``waiting``, ``silent_s`` and ``leave_in_s`` say."""
    from ray_integration.driver.decisions import MemberView
    from ray_integration.driver.records import WorkerRecord

    r = WorkerRecord("w", None, None, None, created_at=0.0, **fields)
    assert r.view(now, delay) == MemberView("w", dead=r.dead, finished=r.finished,
                                            waiting=r.reason if r.waiting else None, leaving=r.leaving,
                                            has_state=r.has_state, silent_s=r.silent_s(now, delay),
                                            leave_in_s=r.leave_in_s(now))


def test_a_new_state_steps_at_once_so_a_loss_aborts_its_round_without_waiting_for_the_tick(job):
    j = job(8)  # (min_workers=8: no ring without a replacement; the re-form waits, its abort must not)
    j.running()
    victim = j.order[-1]
    time.sleep(0.05)
    lost_at = time.time()
    j.wakeups.put(("ray", [("dead", victim)]))
    j.wait(lambda: any(e.kind == "worker_lost" for e in j.driver.events.events), "the re-form's first step")
    reported = next(e for e in j.driver.events.events if e.kind == "worker_lost")
    assert isinstance(j.state, Reforming) and reported.time - lost_at < TICK_S / 2, reported.time - lost_at
