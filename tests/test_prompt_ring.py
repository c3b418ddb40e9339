"""A loss answered before the survivors ask (issue 34, ``decisions.prompt_ring``): when a member is dead and every
other one is heard and ordinary, the driver forms the next ring at once and pushes each survivor its answer behind
the round's abort; the request each survivor then makes finds its answer waiting. The loop tests run the real
``Driver.run`` and pool over a real store (:mod:`tests.sim_driver`); the worker's side is the real mailbox and
rendezvous."""

from __future__ import annotations

import threading
import time

import elastic_ring as er
from ray_integration import ElasticTrainer
from ray_integration.driver.states import Finished, Reforming, Running
from ray_integration.wire.channel import REPLAY_WINDOW, Channel
from ray_integration.wire.protocol import DriverKind, WorkerKind
from ray_integration.worker.mailbox import NOTICE_HANDLERS, Mailbox
from ray_integration.worker.rendezvous import WorkerRendezvous
from tests import ray_jobs
from tests.sim_driver import job  # noqa: F401  (the fixture)
from tests.test_trainer_ray import check_invariant


def _channel(j, worker_id: str) -> Channel:
    return Channel(j.server.connect(10.0), j.secret, worker_id, replay_window=REPLAY_WINDOW)


def _queue(j, worker_id: str, until) -> list[dict]:
    """The messages in ``worker_id``'s queue (read as its mailbox would), up to the first that ``until`` accepts."""
    channel, got = _channel(j, worker_id), []
    while not got or not until(got[-1]):
        msg = channel.receive(j.keys.worker_inbox(worker_id), 5.0)
        assert msg is not None, f"{worker_id}'s queue ended after {[(m['k'], m.get('generation')) for m in got]}"
        got.append(msg)
    return got


def _lose_last(j):
    first = j.driver.ring
    victim, survivors = first.worker_ids[-1], list(first.worker_ids[:-1])
    for w in survivors:  # heard just now (this test's workers send no heartbeats of their own)
        j.message(w)
    j.wait(lambda: all(j.pool.records[w].beat_seq == j.seq[w] for w in survivors), "their heartbeats applied")
    j.wakeups.put(("ray", [("dead", victim)]))  # Ray reports the actor dead; no survivor has asked yet
    j.wait(lambda: any(e.kind == "recovered" and e.round_id == first.round_id + 1 for e in j.driver.events.events),
           "the next ring formed, every answer pushed")  # (the loop publishes the ring before it answers)
    return first, survivors


def test_a_loss_answers_every_survivor_behind_the_rounds_abort_and_their_requests_change_nothing(job):
    j = job(8, min_workers=2)
    j.running()
    first, survivors = _lose_last(j)
    ring = j.driver.ring
    assert list(ring.worker_ids) == survivors
    formed = next(e for e in j.driver.events.events if e.kind == "ring_formed" and e.round_id == ring.round_id)
    assert formed.detail.get("prompt") == 7 and formed.detail["reason"] == "failure", formed
    for w in survivors:
        r = j.pool.records[w]
        assert (r.generation, r.answered, r.expected, r.waiting) == (2, 2, 2, False)
        got = _queue(j, w, until=lambda m: m["k"] == "ring" and m["generation"] == 2)
        kinds = [(m["k"], m.get("round", m.get("generation"))) for m in got]
        assert kinds == [("ring", 1), ("abort", first.round_id), ("ring", 2)], kinds  # the abort first
        assert got[-1]["spec"]["round_id"] == ring.round_id and got[-1]["spec"]["world_size"] == 7
    # their failed collectives now ask for generation 2: each finds its answer, nothing is answered twice
    answers = dict(j.pool.answered_at)
    for w in survivors:
        j.message(w, WorkerKind.RING_REQUEST, generation=2, reason="failure")
        j.message(w, waiting=2, reason="failure")  # its heartbeat while it reads the answer
    j.wait(lambda: not any(j.pool.records[w].expected for w in survivors), "the requests applied")
    time.sleep(0.3)
    assert j.driver.ring is ring and isinstance(j.state, Running) and j.pool.answered_at == answers


def test_a_survivor_that_returns_instead_of_asking_re_forms_the_ring_at_once(job):
    # fn returned on it before its collective failed: the ring it was given would wait for it until the others'
    # formation timed out; the driver aborts that ring instead, and the job finishes when the others ask
    j = job(4, inbox=True, min_workers=2)  # (through the real inbox: its backlog is read)
    j.running()
    _, survivors = _lose_last(j)
    given = j.driver.ring
    j.wakeups.put(("ray", [("return", survivors[0], 1)]))  # it last asked for generation 1, not the one given
    j.wait(lambda: isinstance(j.state, Reforming), "the given ring re-formed")
    got = _queue(j, survivors[1], until=lambda m: m["k"] == "abort" and m["round"] == given.round_id)
    assert got[-1]["round"] == given.round_id
    for w in survivors[1:]:
        j.message(w, WorkerKind.RING_REQUEST, generation=3, reason="failure")
    j.wait(lambda: j.result, "the run ended")
    assert isinstance(j.result[0], Finished) and j.driver.ring is given


def test_the_real_rendezvous_finds_its_answer_waiting_and_asks_once(job):
    j = job(4, inbox=True, min_workers=2)
    j.running()
    worker = j.order[0]
    notices: list[tuple[str, object]] = []
    box = Mailbox(Channel(j.server.connect(10.0), j.secret, worker, replay_window=REPLAY_WINDOW),
                  j.keys.worker_inbox(worker), {k: (lambda m: notices.append((m["k"], m.get("round"))))
                                                for k in NOTICE_HANDLERS})
    box.start()
    try:
        rendezvous = WorkerRendezvous(j.senders[worker], box, j.keys, worker, j.secret, silence_s=10.0)
        rendezvous.generation = 1  # it was answered the first ring
        _, survivors = _lose_last(j)
        assert worker in survivors and j.pool.records[worker].expected == 2
        asked = time.monotonic()
        spec = rendezvous.next_ring("failure")  # what its failed collective does
        took = time.monotonic() - asked
        assert spec.round_id == j.driver.ring.round_id and spec.world_size == 3 and took < 0.5, took
        assert ("abort", 1) in notices
        j.wait(lambda: j.pool.records[worker].expected == 0, "its request applied")
        assert j.pool.records[worker].answered == 2 and not j.pool.records[worker].waiting
    finally:
        box.close()
    assert DriverKind.RING not in NOTICE_HANDLERS


def test_a_real_job_answers_its_survivors_before_they_ask_and_loses_no_sample(ray_session):
    # rank 2 is SIGKILLed while every rank rests after step 3 (no collective in flight): Ray reports the death before
    # any survivor's collective fails, and both survivors are answered in advance; every sample is still seen once
    # per epoch and the final ring holds identical parameters
    result = ElasticTrainer(min_workers=2, max_workers=3, progress=False).run(
        ray_jobs.train, config={"epochs": 2, "faults": [(1, 2, 3, "kill_resting")], "rest_s": 2.0})
    check_invariant(result, 2)
    lost = next(i for i, e in enumerate(result.events) if e.kind == "worker_lost")
    formed = next(e for e in result.events[lost:] if e.kind == "ring_formed")
    assert formed.detail["reason"] == "failure" and formed.world_size == 2, formed
    assert formed.detail.get("prompt") == 2, formed  # both survivors' answers were waiting for them
    recovered = next(e for e in result.events[lost:] if e.kind == "recovered")
    assert recovered.detail["seconds"] < 0.5, recovered


def test_a_survivor_that_asked_already_is_answered_for_its_request_and_one_awaiting_its_answer_stops_the_prompt(job):
    j = job(4, min_workers=2)
    j.running()
    asker = j.order[0]
    j.message(asker, WorkerKind.RING_REQUEST, generation=2, reason="failure")  # its collective failed first
    j.wait(lambda: j.pool.records[asker].waiting, "its request applied")
    _, survivors = _lose_last(j)
    formed = next(e for e in j.driver.events.events if e.kind == "ring_formed" and e.round_id == 2)
    assert formed.detail["prompt"] == 2  # the two that had not asked
    assert {w: (j.pool.records[w].generation, j.pool.records[w].expected) for w in survivors} == {
        asker: (2, 0), survivors[1]: (2, 2), survivors[2]: (2, 2)}
    # its heartbeats say it asked generation 2 (its request was lost): the answer given ahead is asked for
    j.message(survivors[1], asked=2)
    j.wait(lambda: j.pool.records[survivors[1]].expected == 0, "confirmed by a heartbeat")



def test_an_answer_lost_before_the_loss_is_sent_again_after_the_ring_given_ahead(job):
    # its answer for generation 1 never came: its heartbeats say it still waits for it when a peer dies; the ring
    # given ahead replaces that answer on the driver, which still sends the lost one again while the worker waits
    # for it (its round was aborted: its formation fails at once and it asks for generation 2, waiting in its queue)
    j = job(4, inbox=True, min_workers=2, heartbeat_interval_s=0.2)
    j.running()
    w = j.order[0]
    _, survivors = _lose_last(j)
    assert j.pool.records[w].expected == 2
    deadline = time.monotonic() + 10
    got, seen_abort, resent = _channel(j, w), False, None
    while resent is None:
        assert time.monotonic() < deadline, "the lost answer was not sent again"
        j.message(w, waiting=1, reason="start")  # its heartbeat: still waiting for generation 1
        msg = got.receive(j.keys.worker_inbox(w), 0.2)
        if msg is None:
            continue
        seen_abort = seen_abort or msg["k"] == "abort"
        if seen_abort and msg["k"] == "ring" and msg["generation"] == 1:
            resent = msg
    assert resent["spec"]["round_id"] == 1  # the aborted round's answer, as it was
    j.message(w, WorkerKind.RING_REQUEST, generation=2, reason="failure")  # its formation failed: it asks
    j.wait(lambda: j.pool.records[w].expected == 0 and j.pool.records[w].previous is None, "its request applied")
    assert j.driver.ring.round_id == 2 and isinstance(j.state, Running)


def test_a_member_returned_after_asking_for_the_ring_given_ahead_is_no_reason_to_re_form(job):
    # its request is still queued in the inbox (or lost) when Ray's word of its return overtakes it: the generation
    # its run returns with says it asked
    j = job(4, inbox=True, min_workers=2)
    j.running()
    _, survivors = _lose_last(j)
    ring = j.driver.ring
    j.reading.clear()  # the inbox thread stops after the next message it hands over; the rest wait in the store
    j.message(survivors[1])
    j.wait(lambda: j.pool.records[survivors[1]].beat_seq == j.seq[survivors[1]], "the inbox held")
    j.message(survivors[0], WorkerKind.RING_REQUEST, generation=2, reason="failure")  # queued, unread
    j.wakeups.put(("ray", [("return", survivors[0], 2)]))  # Ray's word overtakes the request
    j.wait(lambda: j.pool.records[survivors[0]].finished, "its return applied")
    assert j.pool.records[survivors[0]].expected == 0  # confirmed by its return
    time.sleep(0.4)
    assert isinstance(j.state, Running) and j.driver.ring is ring
    j.reading.set()
    j.wait(lambda: survivors[0] in j.pool.requested_at, "its request read")
    time.sleep(0.3)
    assert isinstance(j.state, Running) and j.driver.ring is ring


def test_a_rendezvous_waiting_for_a_lost_answer_keeps_the_one_given_ahead(job):
    # its answer for generation 1 was lost: the real rendezvous waits for it, reads the ring given ahead for
    # generation 2 meanwhile and keeps it, gets generation 1 again (its heartbeats), then finds 2 at once
    j = job(4, inbox=True, min_workers=2, heartbeat_interval_s=0.2)
    j.running()
    worker = j.order[0]
    assert _queue(j, worker, until=lambda m: m["k"] == "ring")[-1]["generation"] == 1  # (taken: lost)
    box = Mailbox(_channel(j, worker), j.keys.worker_inbox(worker), {k: (lambda m: None) for k in NOTICE_HANDLERS})
    box.start()
    try:
        rendezvous = WorkerRendezvous(j.senders[worker], box, j.keys, worker, j.secret, silence_s=10.0)
        _lose_last(j)
        assert j.pool.records[worker].expected == 2
        first: list = []
        waiting = threading.Thread(target=lambda: first.append(rendezvous.next_ring("start")))
        waiting.start()
        deadline = time.monotonic() + 10
        while not first:
            assert time.monotonic() < deadline, "generation 1 was not sent again"
            j.message(worker, waiting=1, reason="start", asked=1)  # its heartbeat while it waits
            time.sleep(0.1)
        waiting.join(5)
        assert first[0].round_id == 1  # the aborted round's answer: its formation would fail at once
        took = time.monotonic()
        spec = rendezvous.next_ring("failure")
        assert spec.round_id == j.driver.ring.round_id == 2 and time.monotonic() - took < 0.5
    finally:
        box.close()


def test_a_real_workers_run_returns_its_value_with_the_generation_it_last_asked_for(job, monkeypatch):
    # the real RingWorker (in this process, Ray's node id faked): it asks for its first ring through the real
    # rendezvous, forms it, and its run returns fn's value with that request's generation
    import ray

    from elastic_ring.collectives import preemption
    from elastic_ring.ring import elastic
    from elastic_ring.ring.report import set_reporter
    from ray_integration import data as data_input
    from ray_integration.wire.protocol import Returned
    from ray_integration.wire.settings import WorkerSettings
    from ray_integration.worker.actor import RingWorker
    from state.checkpoints.config import set_default_checkpointing
    from state.checkpoints.hooks import set_checkpoint_listener
    from state.state import set_resume_listener

    j = job(1, inbox=True)
    wid = j.order[0]
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "0" * 56})())
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    worker = RingWorker(wid, "127.0.0.1", j.server.address.port, j.keys.job, j.secret, 0.2, 10.0)
    settings = WorkerSettings(driver_silence_s=30.0, flush_timeout_s=5.0, tune_allocator=False)
    try:
        returned = worker.run(lambda config: (elastic._reform("start"), er.rank() + config["x"])[1], {"x": 41},
                              settings)
    finally:
        worker._stop.set()
        for reset in (set_reporter, set_default_checkpointing, set_resume_listener, set_checkpoint_listener,
                      data_input.install, preemption.install):
            reset(None)
    assert returned == Returned(41, 1) and j.driver.ring.worker_ids == (wid,)
