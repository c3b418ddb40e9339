"""Issue 32, the driver's side of a preemption notice, as tables and state-machine steps (no Ray): when the ring
writes its state (a probe at once, the final write just in time from the measured write), what a re-forming ring
of leaving holders does (hand over, train on, write, release, fail), "saved" read from the write's number (never
from timestamps), a notice seen while the ring re-forms, and what the members are told (get_preemption_info)."""

from __future__ import annotations

import pytest

from ray_integration.config import TrainerConfig
from ray_integration.driver import context as c
from ray_integration.driver.decisions import MemberView as M
from ray_integration.driver.decisions import Step, reform_decision
from ray_integration.driver.drains import (
    DrainStep, DrainView, KeepersStep, PersistLog, PersistView, drain_step, keepers_step, persist_due,
)
from ray_integration.driver.formation import Ring
from ray_integration.driver.preemption import Preemption
from ray_integration.driver.states import Reforming, Running
from tests.test_driver_states import ctx, drive, kinds

LIMITS = TrainerConfig(min_workers=2, max_workers=2, elastic_timeout_s=60).limits


def P(pid=1, final=False, round_id=1, age=1.0, started=True, saved=False, failed=False):
    return PersistView(pid, final, round_id, age, started, saved, failed)


def D(need=None, probe=None, final=None, can=True):
    return DrainView(can, need, probe, final)


@pytest.mark.parametrize("left_s, drain, due", [
    (None, D(), True),                                  # no deadline known: nothing to time it by
    (14.0, D(need=0.3), False),                         # 14 s left, a write takes 0.3 s: train on
    (2.4, D(need=0.3), True),                           # at most 1.5 x 0.3 + 2 s left: now
    (2.5, D(need=0.3), False),
    (10.0, D(probe=P(age=6.0)), True),                  # the first probe is still in flight after 6 s: it is slow
    (10.0, D(probe=P(age=1.0)), False),
    (10.0, D(need=6.0, probe=P(age=9.0, saved=True)), True),
])
def test_persist_due(left_s, drain, due):
    assert persist_due(left_s, drain) is due


@pytest.mark.parametrize("needs, notified, takers, left_s, drain, expected", [
    # others hold the state and enough remain: the leavers leave at the next step boundary (once)
    (False, False, False, 14.0, D(), DrainStep.LEAVE),
    (False, True, False, 14.0, D(), DrainStep.NONE),
    # no checkpoint location: nothing to write; they leave and wait for a taker (then fail near the deadline)
    (True, False, False, 14.0, D(can=False), DrainStep.LEAVE),
    # replacements are ready: hand the state over live now, rather than at the deadline
    (True, False, True, 14.0, D(need=0.3, probe=P(saved=True)), DrainStep.LEAVE),
    # the notice: a probe at once (the ring trains on), then nothing while it is in flight
    (True, False, False, 14.0, D(), DrainStep.PROBE),
    (True, False, False, 13.0, D(probe=P(age=0.5)), DrainStep.NONE),
    # measured: train on until the final write is due, then ask for it
    (True, False, False, 9.0, D(need=0.3, probe=P(saved=True)), DrainStep.NONE),
    (True, False, False, 2.4, D(need=0.3, probe=P(saved=True)), DrainStep.PERSIST),
    (True, False, False, None, D(), DrainStep.PERSIST),     # no deadline: write now
    # the final write asked of this round is on its way, or landed: nothing more
    (True, True, False, 2.0, D(need=0.3, final=P(2, final=True, started=False)), DrainStep.NONE),
    (True, True, False, 1.0, D(need=0.3, final=P(2, final=True, saved=True)), DrainStep.NONE),
    # asked of an earlier round and never started (that ring re-formed first), or failed: asked again
    (True, False, False, 2.0, D(need=0.3, final=P(2, final=True, round_id=0, started=False)), DrainStep.PERSIST),
    (True, False, False, 2.0, D(need=0.3, final=P(2, final=True, failed=True)), DrainStep.PERSIST),
    # a probe of an earlier round that never started: asked again
    (True, False, False, 14.0, D(probe=P(round_id=0, started=False)), DrainStep.PROBE),
])
def test_drain_step(needs, notified, takers, left_s, drain, expected):
    assert drain_step(needs, notified, takers, left_s, drain, round_id=1) is expected


@pytest.mark.parametrize("keepers, takers, left_s, drain, checkpoint, expected, saved", [
    # a taker: hand over at once, even while the final write is still landing (the live handover never waits)
    (2, 1, 10.0, D(need=0.3, final=P(final=True)), False, KeepersStep.HANDOVER, False),
    # the final write landed: wait for a taker while the deadline allows, let them go DRAIN_MARGIN_S before it
    (2, 0, 10.0, D(need=0.3, final=P(final=True, saved=True)), True, KeepersStep.WAIT, False),
    (2, 0, 2.2, D(need=0.3, final=P(final=True, saved=True)), True, KeepersStep.RELEASE, True),
    # still landing: they wait for it, and go at the last moment all the same (the leaving rank 0 flushes it)
    (2, 0, 10.0, D(need=0.3, final=P(final=True)), True, KeepersStep.WAIT, False),
    (2, 0, 3.0, D(need=0.3, final=P(final=True)), True, KeepersStep.WAIT, False),
    (2, 0, 0.9, D(need=0.3, final=P(final=True)), True, KeepersStep.RELEASE, False),
    # no final write yet (a notice seen while re-forming, or a holder lost during the drain): train on if enough
    # of them for min_workers and it is not due, else a ring that only writes
    (2, 0, 12.0, D(need=0.3), True, KeepersStep.TRAIN, False),
    (1, 0, 12.0, D(need=0.3), True, KeepersStep.PERSIST, False),
    (2, 0, 2.0, D(need=0.3), True, KeepersStep.PERSIST, False),
    (2, 0, 12.0, D(need=0.3, final=P(final=True, started=False)), True, KeepersStep.TRAIN, False),  # never started
    (2, 0, 2.0, D(need=0.3, final=P(final=True, failed=True)), True, KeepersStep.PERSIST, False),  # failed: again
    # no time for a write any more: go if a checkpoint keeps the state, else fail
    (2, 0, 0.2, D(need=0.3), True, KeepersStep.RELEASE, False),
    (2, 0, 0.2, D(need=0.3), False, KeepersStep.FAIL, False),
    # no checkpoint location: wait for a taker, fail near the deadline
    (2, 0, 12.0, None, False, KeepersStep.WAIT, False),
    (2, 0, 4.0, None, False, KeepersStep.FAIL, False),
])
def test_keepers_step(keepers, takers, left_s, drain, checkpoint, expected, saved):
    kept = keepers_step(keepers, takers, left_s, 1.0, LIMITS, drain, checkpoint, round_id=1)
    assert (kept.step, kept.saved) == (expected, saved)


def test_saved_means_that_write_landed_not_any_write_after_the_notice():
    """Defect 3: a checkpoint that lands after the notice (a cadence write started before it) does not answer the
    drain's write; only a write tagged with its number (or a later one: a newer state) does."""
    log = PersistLog()
    probe = log.ask(final=False, round_id=3, now=10.0)
    final = log.ask(final=True, round_id=3, now=20.0)
    log.apply({"kind": "checkpoint_written", "uri": "ckpt-7", "commits": 40}, now=20.5)  # a cadence write
    log.apply({"kind": "checkpoint_failed", "persist": final, "error": "disk full"}, now=21.0)
    view = log.view(since=9.0, now=22.0, can_persist=True)
    assert not view.final.saved and view.final.failed and not view.probe.saved and view.need_s is None
    again = log.ask(final=True, round_id=4, now=22.0)
    log.apply({"kind": "persist_started", "persist": again}, now=22.1)
    log.apply({"kind": "checkpoint_written", "uri": "ckpt-9", "persist": again}, now=22.6)
    view = log.view(since=9.0, now=23.0, can_persist=True)
    assert view.final.persist_id == again and view.final.saved and view.probe.saved  # a newer state answers both
    assert view.need_s == pytest.approx(0.6)
    later = log.view(since=22.5, now=23.0, can_persist=True)   # a later drain starts afresh (the measure stays)
    assert later.probe is None and later.final is None and later.need_s == pytest.approx(0.6)


def test_a_write_whose_writer_died_is_asked_again_not_waited_for():
    """Found by a review: a final write that started on a worker that then died was still "landing"; the leaving
    holders left waited for it until 1 s before the deadline and went unsaved, though they could write again."""
    log = PersistLog()
    final = log.ask(final=True, round_id=3, now=10.0)
    log.apply({"kind": "persist_started", "persist": final}, now=10.2, worker="w0")
    alive = log.view(since=9.0, now=11.0, can_persist=True, working=lambda w: True)
    dead = log.view(since=9.0, now=11.0, can_persist=True, working=lambda w: w != "w0")
    assert not alive.final.failed and alive.final.pending(3) and dead.final.failed and not dead.final.pending(4)
    kept = [keepers_step(keepers=1, takers=0, left_s=20.0, waited_s=1.0, limits=LIMITS, drain=view,
                         checkpoint=True, round_id=4).step for view in (alive, dead)]
    assert kept == [KeepersStep.WAIT, KeepersStep.PERSIST]


def test_a_notice_seen_while_the_ring_re_forms_writes_the_state():
    """Defect 1: the only holders are leaving and the ring re-forms (a death in the drain): without a final write
    they are formed into a ring that writes it (below min_workers) or that trains on (enough of them)."""
    members = (M("a", waiting="failure", has_state=True, leaving=True, leave_in_s=12.0), M("b", dead=True))
    actions, nxt = drive(Reforming("failure", since=99.0), ctx(
        limits=LIMITS, members=members, unreported_losses=("b",), ever_had_state=True, checkpoint="ckpt-1",
        drain=D(need=0.3, probe=P(saved=True))))
    assert actions[-2] == c.Form(("a",), (), reason="failure", persist=True), actions
    assert kinds(actions)[-1] == "AddEvent:drain_write" and isinstance(nxt, Running)
    two = (M("a", waiting="failure", has_state=True, leaving=True, leave_in_s=12.0),
           M("b", waiting="failure", has_state=True, leaving=True, leave_in_s=12.0), M("c", dead=True))
    limits = TrainerConfig(min_workers=1, max_workers=3).limits
    actions, _ = drive(Reforming("failure", since=99.0), ctx(
        limits=limits, members=two, unreported_losses=("c",), ever_had_state=True, drain=D(need=0.3)))
    assert c.Form(("a", "b"), (), reason="failure") in actions  # they train on; the final write comes in time


def test_a_drain_first_seen_without_a_write_then_the_holders_lost_is_written_after_all():
    """Defect 1: the drain was seen while others held the state (the leaver was told to leave, no write); those
    holders die while the leaver waits: it holds the only state now, and it writes it instead of failing."""
    members = (M("a", waiting="membership", has_state=True, leaving=True, leave_in_s=20.0),
               M("b", dead=True), M("c", dead=True))
    decision = reform_decision(list(members), 0, False, True, 1.0, LIMITS, checkpoint=False, drain=D(), round_id=2)
    assert decision.step is Step.PERSIST, decision


def test_the_live_handover_never_waits_for_the_final_write():
    """Defect 2: replacements are ready while the leaving holders' final write is still landing: hand over now."""
    members = (M("a", waiting="membership", has_state=True, leaving=True, leave_in_s=25.0),
               M("b", waiting="membership", has_state=True, leaving=True, leave_in_s=25.0))
    actions, _ = drive(Reforming("membership", since=99.0), ctx(
        limits=LIMITS, members=members, joiners=("j",), ever_had_state=True, drain=D(need=4.0, final=P(final=True))))
    assert c.Form(("a", "b"), ("j",), reason="membership", handover=True, extra=2) in actions


def test_the_leavers_go_once_their_final_write_landed_near_the_deadline():
    members = (M("a", waiting="membership", has_state=True, leaving=True, leave_in_s=2.1),)
    actions, nxt = drive(Reforming("membership", since=99.0), ctx(
        limits=LIMITS, members=members, ever_had_state=True, checkpoint="ckpt-3",
        drain=D(need=0.3, final=P(final=True, saved=True))))
    released = [a for a in actions if isinstance(a, c.AddEvent) and a.kind == "drain_released"]
    assert c.StopWorkers(("a",), "its node drains; its state is in the drain commit's checkpoint") in actions
    assert released and released[0].detail["saved"] is True and c.DropRing() in actions
    assert isinstance(nxt, Reforming)


def test_a_running_ring_writes_a_probe_then_the_final_write_just_in_time():
    members = (M("a", has_state=True, leaving=True, leave_in_s=14.0), M("b", has_state=True, leaving=True,
                                                                          leave_in_s=14.0))
    running = Running()
    actions, _ = drive(running, ctx(limits=LIMITS, members=members, newly_draining=("a", "b"), drain=D()))
    assert c.RequestPersist("drain", 14.0) in actions             # the probe: no re-form
    actions, _ = drive(running, ctx(limits=LIMITS, members=members, drain=D(need=0.4, probe=P(saved=True))))
    assert not any(isinstance(a, (c.RequestPersist, c.Notify)) for a in actions)   # trains on
    near = tuple(M(m.worker_id, has_state=True, leaving=True, leave_in_s=2.5) for m in members)
    actions, _ = drive(running, ctx(limits=LIMITS, members=near, drain=D(need=0.4, probe=P(saved=True))))
    assert c.RequestPersist("drain", 2.5, change=True) in actions


def test_what_the_members_are_told_of_their_nodes_drains():
    records = {w: type("R", (), {"node_id": n, "dead": False, "finished": False})()
               for w, n in (("a", "n1"), ("b", "n1"), ("c", "n2"))}
    told = Preemption()
    ring = Ring(round_id=1, worker_ids=("a", "b", "c"), node_ids=("n1", "n1", "n2"))
    assert told.notice(ring, records, {}) is None                       # nothing drains: nothing to say
    assert told.notice(ring, records, {"n1": 1700000015000}) == {"seq": 1, "deadline_ms": 1700000015000,
                                                                 "nodes": {"n1": [0, 1]}}
    assert told.notice(ring, records, {"n1": 1700000015000}) is None    # known already
    moved = Ring(round_id=2, worker_ids=("c", "a", "b"), node_ids=("n2", "n1", "n1"))
    assert told.notice(moved, records, {"n1": 1700000015000})["nodes"] == {"n1": [1, 2]}  # the ranks moved
    gone = Ring(round_id=3, worker_ids=("c",), node_ids=("n2",))
    assert told.notice(gone, records, {"n1": 1700000015000}) == {"seq": 3, "deadline_ms": None, "nodes": {}}
    assert told.notice(gone, records, {"n1": 1700000015000}) is None


def test_leavers_let_go_while_the_others_re_form_do_not_finish_the_job():
    """A leaving member released (its fn returned) while staying members wait for capacity is not the job's end."""
    from ray_integration.driver.decisions import Outcome, running_outcome

    members = [M("a", finished=True, leaving=True), M("j", waiting="membership", has_state=True)]
    assert reform_decision(members, 0, False, True, 1.0, LIMITS).step is Step.WAIT
    assert running_outcome([M("a", finished=True, leaving=True), M("j")]) is Outcome.CONTINUE
    assert reform_decision([M("a", finished=True, leaving=True), M("b", finished=True, leaving=True)], 0, False, True,
                           1.0, LIMITS).step is Step.FINISH   # fn returned everywhere: the job is done
    assert reform_decision([M("a", finished=True), M("j", waiting="membership", has_state=True)], 0, False, True,
                           1.0, LIMITS).step is Step.FINISH


def test_a_final_write_still_landing_is_waited_for_before_failing():
    """The leavers went while their final write was landing (no checkpoint known yet): the write's outcome
    decides, not the moment; once its writer returned without it landing, the run fails (no checkpoint)."""
    log = PersistLog()
    final = log.ask(final=True, round_id=2, now=1.0)
    log.apply({"kind": "persist_started", "persist": final}, now=1.1, worker="w0")
    assert log.landing(lambda w: w == "w0") and not log.landing(lambda w: False)
    assert reform_decision([], 2, False, True, 1.0, LIMITS, checkpoint=False, write_landing=True).step is Step.WAIT
    assert reform_decision([], 2, False, True, 1.0, LIMITS, checkpoint=False).step is Step.FAIL
    assert reform_decision([], 2, False, True, 1.0, LIMITS, checkpoint=True).step is Step.FORM   # landed: resume
    log.apply({"kind": "checkpoint_written", "persist": final, "uri": "ckpt-2"}, now=1.4, worker="w0")
    assert not log.landing(lambda w: True)


@pytest.mark.parametrize("drain, left_s, expected, keep, release", [
    # staying members hold the state, but without the leaver the ring is below min_workers (2): the leaver stays
    # in the ring and trains until the final write is due
    (D(need=0.3, probe=P(saved=True)), 14.0, Step.FORM, True, False),
    # the final write is due, on its way, or landed: the leaver may go; the ring waits for capacity meanwhile
    (D(need=0.3, probe=P(saved=True)), 2.0, Step.WAIT, False, True),
    (D(need=0.3, final=P(final=True, started=True)), 10.0, Step.WAIT, False, True),
    (D(need=0.3, final=P(final=True, saved=True)), 10.0, Step.WAIT, False, True),
    # no checkpoint location: nothing to write, the leaver goes
    (D(can=False), 14.0, Step.WAIT, False, True),
])
def test_a_leaver_whose_ring_would_be_too_small_stays_until_the_final_write(drain, left_s, expected, keep, release):
    members = [M("a", waiting="membership", has_state=True),
               M("b", waiting="membership", has_state=True, leaving=True, leave_in_s=left_s)]
    decision = reform_decision(members, 0, False, True, 1.0, LIMITS, drain=drain, round_id=1)
    assert (decision.step, decision.keep_leavers, decision.release_leavers) == (expected, keep, release), decision


def test_leavers_kept_in_the_ring_never_take_a_stayers_or_a_joiners_place():
    """Staying holder s (the ring without the leavers would be below min_workers=2): the leavers train on in the
    room max_workers leaves after s and the ready joiner j; the other leavers go."""
    limits = TrainerConfig(min_workers=3, max_workers=4).limits
    members = (M("s", waiting="membership", has_state=True),) + tuple(
        M(f"l{i}", waiting="membership", has_state=True, leaving=True, leave_in_s=60.0) for i in range(4))
    actions, _ = drive(Reforming("membership", since=99.0), ctx(
        limits=limits, members=members, joiners=("j",), ever_had_state=True, drain=D(need=0.3, probe=P(saved=True))))
    assert c.StopWorkers(("l2", "l3"), "its node drains; it left the ring at the last commit") in actions, actions
    assert c.Form(("s", "l0", "l1"), ("j",), reason="membership") in actions, actions
