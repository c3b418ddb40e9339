"""A drain reaches the driver's loop through its drain watcher (a thread that asks Ray, off the loop), and the
ring's members learn of it in one message: the re-form notice carries the preemption notice (issue 34)."""

from __future__ import annotations

import queue
import time

from ray_integration.driver.watcher import DrainWatcher
from ray_integration.wire.channel import REPLAY_WINDOW, Channel
from ray_integration.wire.protocol import DriverKind, WorkerKind
from tests.sim_driver import job  # noqa: F401  (the fixture)


def _watch(answers, **kw):
    """A watcher over scripted answers (an exception is raised, not returned); what it put in its sink."""
    script = list(answers)

    def poll():
        answer = script.pop(0) if script else script_end
        if isinstance(answer, Exception):
            raise answer
        return answer

    script_end = answers[-1] if not isinstance(answers[-1], Exception) else {}
    sink: "queue.SimpleQueue" = queue.SimpleQueue()
    watcher = DrainWatcher(poll, sink, poll_s=0.01, **kw)
    watcher.start()
    deadline = time.monotonic() + 5
    while script and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    watcher.close()
    got = []
    while not sink.empty():
        got.append(sink.get())
    return got


def test_the_watcher_wakes_the_loop_only_when_the_draining_nodes_change_and_retries_a_failed_call():
    got = _watch([{}, {}, {"n1": 5}, {"n1": 5}, OSError("GCS hiccup"), {"n1": 5}, {"n1": 5, "n2": 0}, {}, {}])
    assert got == [("drains", {"n1": 5}), ("drains", {"n1": 5, "n2": 0}), ("drains", {})]


def test_a_lasting_failure_ends_the_run_with_a_named_error():
    got = _watch([OSError("GCS gone")] * 30, fail_after_s=0.1)
    assert len(got) == 1 and got[0][0] == "error"
    assert "asking Ray which nodes drain kept failing for 0.1" in str(got[0][1])
    assert str(got[0][1]).endswith("OSError: GCS gone")


def test_a_drain_reaches_every_member_in_one_notice_that_carries_the_preemption_notice(job):
    j = job(16, min_workers=8)  # two nodes of 8 (tests.sim_driver): the other node's members hold the state
    j.running()
    ring = j.driver.ring
    node = ring.node_ids[-1]
    drained = {w for w, n in zip(ring.worker_ids, ring.node_ids) if n == node}
    deadline_ms = int((time.time() + 120) * 1000)
    started = time.monotonic()
    j.pool.draining_script = {node: deadline_ms}
    j.wait(lambda: ring.round_id in j.pool.notified_at, "the members were told")
    assert time.monotonic() - started < 2.0  # the watcher's poll (0.1 s), then a step at once
    for w in ring.worker_ids:  # the first word of the drain is the notice (no preemption message before it)
        channel = Channel(j.server.connect(10.0), j.secret, w, replay_window=REPLAY_WINDOW)
        msg = channel.receive(j.keys.worker_inbox(w), 5.0)
        if msg["k"] == DriverKind.RING:  # its first ring's answer (this test's workers read nothing)
            msg = channel.receive(j.keys.worker_inbox(w), 5.0)
        assert msg["k"] == DriverKind.NOTICE and msg["round"] == ring.round_id and msg["change"]
        assert msg["preemption"]["deadline_ms"] == deadline_ms
        assert sorted(msg["preemption"]["nodes"][node]) == sorted(ring.worker_ids.index(d) for d in drained)
    assert all(j.pool.records[w].leaving for w in drained)


def test_a_preemption_notice_no_notice_carries_goes_alone_at_the_steps_end(job):
    # the leavers gone, the new ring's members hear that none of its ranks drains: a preemption notice of the
    # step that formed the ring, which sends them no notice
    j = job(16, min_workers=8)
    j.running()
    ring = j.driver.ring
    node = ring.node_ids[-1]
    stayers = [w for w, n in zip(ring.worker_ids, ring.node_ids) if n != node]
    j.pool.draining_script = {node: int((time.time() + 120) * 1000)}
    j.wait(lambda: ring.round_id in j.pool.notified_at, "the members were told")
    for w in ring.worker_ids:
        j.message(w, WorkerKind.RING_REQUEST, generation=2, reason="membership")
    j.wait(lambda: j.driver.ring.round_id > ring.round_id, "the ring without the drained node formed")
    assert set(j.driver.ring.worker_ids) == set(stayers)
    for w in stayers:
        channel = Channel(j.server.connect(10.0), j.secret, w, replay_window=REPLAY_WINDOW)
        got, formed = [], False  # (a repeat of the drain's notices may come before the new ring)
        while not (formed and got[-1]["k"] == DriverKind.PREEMPTION):
            msg = channel.receive(j.keys.worker_inbox(w), 5.0)
            assert msg is not None, f"{w}: no preemption notice after its new ring: {[m['k'] for m in got]}"
            got.append(msg)
            formed = formed or msg["k"] == DriverKind.RING and msg["generation"] == 2
        assert got[-1]["notice"]["nodes"] == {}
