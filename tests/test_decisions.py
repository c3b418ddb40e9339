"""The driver's decisions as tables: who is dead or stuck, when a ring is done, re-forms, stops or gives up.
Pure functions of typed observations: no Ray, no clocks."""

import pytest

from ray_integration.driver import decisions
from ray_integration.config import TrainerConfig
from ray_integration.driver.decisions import MemberView as M
from ray_integration.driver.decisions import Outcome, StartFailureKind, Step, start_failure_verdict
from ray_integration.driver.drains import DrainView, PersistView

LIMITS = TrainerConfig(min_workers=2, max_workers=4, heartbeat_interval_s=0.5, heartbeat_timeout_s=10,
                       collective_timeout_s=60, connect_timeout_s=30, elastic_timeout_s=20, stop_timeout_s=15,
                       max_failures=3).limits


@pytest.mark.parametrize("member, failure_age_s, expected", [
    # running normally: only the heartbeat rule
    (M("a", silent_s=0.3), None, None),
    (M("a", silent_s=9.9), None, None),
    (M("a", silent_s=10.1), None, "no heartbeat for 10.1 s"),
    (M("a", silent_s=None), None, None),                               # no beat yet: starting
    (M("a", silent_s=50, dead=True), None, None),                       # already dead
    (M("a", silent_s=50, finished=True), None, None),                   # returned from fn
    # peers re-form: a silent member is presumed dead after 3 intervals, even if the heartbeat rule has not fired
    (M("a", silent_s=1.4), 0.5, None),
    (M("a", silent_s=1.6), 0.5, "silent for 1.6 s while its peers re-formed"),
    (M("a", silent_s=1.6, waiting="failure"), 0.5, None),              # it is at the rendezvous: fine
    # heartbeating but away from the rendezvous: stuck only after collective + connect timeouts + grace
    (M("a", silent_s=0.2), 91.9, None),
    (M("a", silent_s=0.2), 92.1, "stuck in user code"),
    (M("a", silent_s=0.2, waiting="membership"), 500, None),
])
def test_kill_cause(member, failure_age_s, expected):
    kill = decisions.kill_cause(member, LIMITS, failure_age_s)
    assert (kill is None) == (expected is None), kill
    if kill:  # the driver looks only at workers silent past silence_limit_s, unless the stuck rule applies
        assert decisions.stuck_rule_applies(LIMITS, failure_age_s) or \
            member.silent_s > decisions.silence_limit_s(LIMITS, failure_age_s)
    if expected:
        assert expected in kill.cause
        # a verdict from silence is confirmed through Ray first; "stuck" is not about silence
        assert kill.confirm is ("stuck" not in expected)


@pytest.mark.parametrize("probe, verdict", [
    (decisions.Probe.PENDING, decisions.Verdict.WAIT),
    (decisions.Probe.UNANSWERED, decisions.Verdict.KILL),     # frozen, or its node is gone
    (decisions.Probe.ANSWERED, decisions.Verdict.UNHEARD),    # alive: its messages are lost, not its process
])
def test_after_probe(probe, verdict):
    assert decisions.after_probe(probe) is verdict


@pytest.mark.parametrize("silent, heard, others", [
    (1, 1_022, True),    # one worker's connection broke: it is lost and replaced
    (1, 1, True),        # a job of two: the other is heard
    (3, 5, True),
    (4, 4, True),
    (5, 4, False),       # most are silent: not their connections (a grace, then the run names it)
    (1_011, 12, False),  # the mass kill measured at 1,024 simulated workers on a starved VM
    (2, 0, False),       # nobody is heard
])
def test_the_driver_hears_the_others_only_when_the_silent_are_not_the_most(silent, heard, others):
    assert decisions.others_heard(silent, heard) is others


@pytest.mark.parametrize("times, others_heard, verdict, names", [
    (1, False, decisions.Verdict.UNHEARD, None),        # nobody is heard: a fresh grace, once
    (2, False, decisions.Verdict.UNHEARD, "tampering"),  # twice in a row: the run ends naming it
    (5, False, decisions.Verdict.UNHEARD, "tampering"),
    (1, True, decisions.Verdict.KILL, "connection to the job's store is broken"),  # only this one: a lost worker
])
def test_unheard_twice_in_a_row_names_tampering(times, others_heard, verdict, names):
    got, message = decisions.unheard_verdict("w1", times, forged=3, others_heard=others_heard)
    assert got is verdict
    assert (message is None) == (names is None)
    if names:
        assert names in message
    if names == "tampering":
        assert "w1" in message and "3 messages" in message


@pytest.mark.parametrize("gap_s, interval_s, since_grace_s, stalled", [
    (0.1, 0.5, 99, False), (0.9, 0.5, 99, False), (1.1, 0.5, 99, True),   # a gap of its own loop, past 1 s
    (1.5, 1.0, 99, False), (2.1, 1.0, 99, True),                          # or past two heartbeats
    (5.0, 0.5, 9.0, False),   # at most one grace per heartbeat_timeout_s (10): a slow loop keeps no frozen worker
])
def test_driver_stalled(gap_s, interval_s, since_grace_s, stalled):
    limits = TrainerConfig(heartbeat_interval_s=interval_s, heartbeat_timeout_s=10).limits
    assert decisions.driver_stalled(gap_s, since_grace_s, limits) is stalled


@pytest.mark.parametrize("backlog, deferred_s, defer", [
    (0, None, False), (3, None, True), (3, 0.9, True),
    (3, 1.1, False),   # at most two heartbeat intervals (0.5 s): a flood of messages keeps no frozen worker
])
def test_silence_verdicts_wait_for_the_inbox_but_not_forever(backlog, deferred_s, defer):
    assert decisions.defer_for_backlog(backlog, deferred_s, LIMITS) is defer


def test_stuck_deadline_follows_the_timeouts_so_raising_one_never_kills_survivors_forming_a_ring():
    # a survivor blocked forming a communicator waits connect_timeout_s after its collective timed out
    slow = TrainerConfig(connect_timeout_s=300, collective_timeout_s=60).limits
    assert slow.stuck_after_s > 300 + 60
    assert decisions.kill_cause(M("a", silent_s=0.1), slow, 300 + 60 + 1) is None


def test_a_member_writing_the_commit_the_driver_asked_for_is_never_stuck():
    # at a membership change (a drain, a stop) the driver passes no failure age: a slow durable write is not a hang
    assert decisions.kill_cause(M("a", silent_s=0.2), LIMITS, None) is None


@pytest.mark.parametrize("members, expected", [
    ([M("a"), M("b")], Outcome.CONTINUE),
    ([M("a", finished=True), M("b", finished=True)], Outcome.FINISH),
    ([M("a", finished=True), M("b")], Outcome.CONTINUE),                     # b is still finishing
    # one rank dies while the others return: the job is done, not re-formed
    ([M("a", finished=True), M("b", finished=True), M("c", dead=True)], Outcome.FINISH),
    # b's last collective failed because c died, a already returned: done
    ([M("a", finished=True), M("b", waiting="failure"), M("c", dead=True)], Outcome.FINISH),
    ([M("a"), M("b", dead=True)], Outcome.REFORM_FAILURE),
    ([M("a", waiting="failure"), M("b")], Outcome.REFORM_FAILURE),
    ([M("a", waiting="membership"), M("b")], Outcome.REFORM_MEMBERSHIP),
    ([M("a", waiting="membership"), M("b", dead=True)], Outcome.REFORM_FAILURE),
    # answered in advance (prompt_ring): fine until it returns without asking; the ring it was given never forms
    ([M("a", unasked=True), M("b")], Outcome.CONTINUE),
    ([M("a", finished=True, unasked=True), M("b")], Outcome.REFORM_FAILURE),
    ([M("a", finished=True, unasked=True), M("b", finished=True)], Outcome.FINISH),
])
def test_running_outcome(members, expected):
    assert decisions.running_outcome(members) is expected


S = dict(has_state=True)


@pytest.mark.parametrize("members, joiners, stop, ever, waited_s, expected", [
    # everyone staying must reach the rendezvous first
    ([M("a", waiting="failure", **S), M("b", **S)], 0, False, True, 1, Step.WAIT),
    ([M("a", waiting="failure", **S), M("b", waiting="failure", **S), M("c", dead=True)], 0, False, True, 1, Step.FORM),
    # below min_workers (2): wait for capacity, then fail
    ([M("a", waiting="failure", **S), M("c", dead=True)], 0, False, True, 5, Step.WAIT),
    ([M("a", waiting="failure", **S), M("c", dead=True)], 1, False, True, 5, Step.FORM),
    ([M("a", waiting="failure", **S), M("c", dead=True)], 0, False, True, 21, Step.FAIL),
    # a leaving member (its node drains) must have committed and be at the rendezvous, or be gone
    ([M("a", waiting="membership", **S), M("b", waiting="membership", **S), M("c", leaving=True, **S)], 0, False, True,
     1, Step.WAIT),
    ([M("a", waiting="membership", **S), M("b", waiting="membership", **S),
      M("c", leaving=True, waiting="membership", **S)], 0, False, True, 1, Step.FORM),
    # every holder of the state is gone and nothing is durable: fail, or, when stopping, stop with nothing to save
    ([M("j1", waiting="failure"), M("j2", waiting="failure"), M("c", dead=True)], 0, False, True, 1, Step.FAIL),
    ([M("j1", waiting="failure"), M("j2", waiting="failure"), M("c", dead=True)], 0, True, True, 1, Step.STOPPED),
    ([M("j1", waiting="start"), M("j2", waiting="start")], 0, False, False, 1, Step.FORM),   # a fresh job
    # a stop during a re-form: the survivors form a ring told to commit and stop; no capacity wait
    ([M("a", waiting="failure", **S), M("c", dead=True)], 0, True, True, 0, Step.FORM_STOP),
    ([M("c", dead=True)], 0, True, True, 0, Step.STOPPED),
    # a stop does not skip the rendezvous: the survivor blocked in a collective is still waited for
    ([M("a", waiting="failure", **S), M("b", **S), M("c", dead=True)], 0, True, True, 0, Step.WAIT),
    # some returned from fn, the rest are lost or at the rendezvous: finished
    ([M("a", finished=True), M("b", waiting="failure", **S), M("c", dead=True)], 0, False, True, 1, Step.FINISH),
])
def test_reform_decision(members, joiners, stop, ever, waited_s, expected):
    decision = decisions.reform_decision(members, joiners, stop, ever, waited_s, LIMITS)
    assert decision.step is expected, decision
    if expected in (Step.FAIL, Step.STOPPED):
        assert decision.message


LV = dict(leaving=True, waiting="membership", has_state=True)   # a leaving holder at the rendezvous
SAVED = DrainView(True, 0.5, final=PersistView(2, True, 1, 3.0, True, True, False))  # the drain's final write landed


H = dict(silent_s=0.2, has_state=True)  # heard within suspect_after_s (1.5 s here), holds the state


@pytest.mark.parametrize("members, joiners, stop, drain, prompt", [
    ([M("a", **H), M("b", **H), M("c", dead=True)], 0, False, None, True),
    ([M("a", waiting="failure", **H), M("b", **H), M("c", dead=True)], 0, False, None, True),  # one asked already
    ([M("a", waiting="failure", **H), M("b", **H)], 0, False, None, False),  # nobody dead: b may be the cause
    ([M("a", **H), M("b", has_state=True, silent_s=1.6), M("c", dead=True)], 0, False, None, False),  # b suspect
    ([M("a", **H), M("b", has_state=True), M("c", dead=True)], 0, False, None, False),  # b never heard
    ([M("a", **H), M("b", finished=True, **H), M("c", dead=True)], 0, False, None, False),  # fn returned on b
    ([M("a", **H), M("b", leaving=True, **H), M("c", dead=True)], 0, False, None, False),  # b's node drains
    ([M("a", **H), M("b", **H), M("c", dead=True)], 0, True, None, False),  # a stop: its own commit
    ([M("a", **H), M("b", **H), M("c", dead=True)], 0, False, DrainView(can_persist=True), False),
    ([M("a", **H), M("c", dead=True)], 0, False, None, False),   # below min_workers: a capacity wait
    ([M("a", **H), M("c", dead=True)], 1, False, None, True),    # a joiner makes two
    ([M("a", silent_s=0.2), M("b", silent_s=0.2), M("c", dead=True)], 0, False, None, False),  # no holder left
    ([M("c", dead=True)], 2, False, None, False),                # no survivor
])
def test_a_loss_is_answered_before_the_survivors_ask_only_when_its_cause_and_outcome_are_known(
        members, joiners, stop, drain, prompt):
    assert decisions.prompt_ring(members, joiners, stop, True, LIMITS, drain) is prompt


@pytest.mark.parametrize("members, joiners, stop, waited_s, checkpoint, expected, says", [
    # a drain of every holder: hand the state to whoever is there (a joiner, or a staying member without state)
    ([M("a", **LV), M("b", **LV)], 2, False, 1, False, Step.HANDOVER, ""),
    ([M("a", **LV), M("b", **LV)], 1, False, 1, False, Step.HANDOVER, ""),          # even below min_workers
    ([M("a", **LV), M("j", waiting="membership")], 0, False, 1, False, Step.HANDOVER, ""),
    # nobody to take it yet: wait while the drain deadline allows
    ([M("a", leave_in_s=20, **LV), M("b", leave_in_s=25, **LV)], 0, False, 1, True, Step.WAIT, ""),
    # the deadline is near: let them go if the drain commit is durable, else fail saying exactly that
    ([M("a", leave_in_s=4, **LV), M("b", leave_in_s=25, **LV)], 0, False, 1, True, Step.RELEASE, "checkpoint"),
    ([M("a", leave_in_s=4, **LV)], 0, False, 1, False, Step.FAIL, "no durable checkpoint of the drain commit"),
    # a drain without a deadline: wait up to elastic_timeout_s (20) for a taker
    ([M("a", **LV)], 0, False, 19, True, Step.WAIT, ""),
    ([M("a", **LV)], 0, False, 21, True, Step.RELEASE, "checkpoint"),
    # a leaver still writing the commit the driver asked for is waited for
    ([M("a", leaving=True, has_state=True), M("b", **LV)], 2, False, 1, False, Step.WAIT, ""),
    # a stop while only leavers hold the state: they commit durably and stop
    ([M("a", **LV), M("b", **LV)], 0, True, 1, False, Step.FORM_STOP, ""),
    # every holder gone, but the state is durable: resume from it in this run once capacity allows
    ([M("j1", waiting="failure"), M("j2", waiting="failure"), M("c", dead=True)], 0, False, 1, True, Step.FORM,
     "checkpoint"),
    ([M("j1", waiting="failure"), M("c", dead=True)], 0, False, 5, True, Step.WAIT, ""),      # below min_workers
    ([M("j1", waiting="failure"), M("c", dead=True)], 0, False, 21, True, Step.FAIL, "run the same script"),
    ([M("c", dead=True)], 2, False, 1, True, Step.FORM, "checkpoint"),   # after a release: the joiners resume
    # staying holders exist: the leavers simply go (no handover)
    ([M("a", **LV), M("b", waiting="membership", has_state=True)], 1, False, 1, False, Step.FORM, ""),
])
def test_drain_and_durable_resume_decisions(members, joiners, stop, waited_s, checkpoint, expected, says):
    # (here "checkpoint" is both: one exists, and it is the drain's final write, which landed)
    decision = decisions.reform_decision(members, joiners, stop, True, waited_s, LIMITS, checkpoint=checkpoint,
                                         drain=SAVED if checkpoint else None, round_id=1)
    assert decision.step is expected, decision
    assert says in decision.message


def test_an_older_checkpoint_is_no_silent_reason_to_let_the_leavers_go():
    # a checkpoint exists, but not of the drain's final write: while a write still fits, the leavers write it (a
    # ring that only writes); near the deadline with no write landing they go, saying that the job trains again
    # what came after the older checkpoint (issue 32: saved means *this* commit was saved)
    leaving = [M("a", leave_in_s=30, **LV)]
    failed = DrainView(True, 0.5, final=PersistView(3, True, 1, 2.0, True, False, True))
    decision = decisions.reform_decision(leaving, 0, False, True, 1, LIMITS, checkpoint=True, drain=failed, round_id=1)
    assert decision.step is Step.PERSIST, decision
    leaving = [M("a", leave_in_s=0.4, **LV)]
    decision = decisions.reform_decision(leaving, 0, False, True, 1, LIMITS, checkpoint=True, drain=failed, round_id=1)
    assert decision.step is Step.RELEASE and not decision.saved and "trains again" in decision.message


@pytest.mark.parametrize("ages, max_failures, window_s, gives_up", [
    ([], 0, 3600, False), ([1], 0, 3600, True), ([1, 2, 3], 3, 3600, False), ([1, 2, 3, 4], 3, 3600, True),
    # failures older than the window no longer count
    ([4000, 3700, 3, 2], 3, 3600, False), ([4000, 30, 3, 2, 1], 3, 3600, True),
    # a job preempted every hour for 30 days, with the defaults (max_failures=10, failure_window_s=3600)
    ([3600.0 * k for k in range(720)], 10, 3600, False),
])
def test_give_up_after_failure(ages, max_failures, window_s, gives_up):
    limits = TrainerConfig(max_failures=max_failures, failure_window_s=window_s).limits
    message = decisions.give_up_after_failure(ages, limits)
    assert (message is not None) == gives_up
    if gives_up:
        assert f"max_failures={max_failures}" in message and f"failure_window_s={window_s}" in message


def test_the_defaults_survive_an_hourly_preemption_forever():
    limits = TrainerConfig().limits
    month = [3600.0 * k for k in range(24 * 30)]   # the ages of a month of hourly preemptions
    assert decisions.give_up_after_failure(month, limits) is None
    assert decisions.give_up_after_failure([60.0 * k for k in range(11)], limits)  # a crash loop still ends it


@pytest.mark.parametrize("remaining, min_workers, staying_holders, persist", [
    (3, 2, 3, False), (1, 2, 1, True),     # below min_workers
    (2, 2, 0, True),                       # nobody staying holds the state: keep it durably, then hand it over
])
def test_persist_before_leaving(remaining, min_workers, staying_holders, persist):
    assert decisions.persist_before_leaving(remaining, min_workers, staying_holders) is persist


@pytest.mark.parametrize("world, joiners, max_workers, pending, stopping, grow", [
    (2, 1, 3, False, False, True), (3, 1, 3, False, False, False), (2, 0, 3, False, False, False),
    (2, 1, 3, True, False, False), (2, 1, 3, False, True, False),
])
def test_should_grow(world, joiners, max_workers, pending, stopping, grow):
    assert decisions.should_grow(world, joiners, max_workers, pending, stopping) is grow


@pytest.mark.parametrize("age, overdue", [(None, False), (14.9, False), (15.1, True)])
def test_stop_overdue(age, overdue):
    assert decisions.stop_overdue(age, LIMITS) is overdue


@pytest.mark.parametrize("ready, min_w, max_w, quiet, start", [
    (1, 2, 3, 10, False), (2, 2, 3, 0.5, False), (2, 2, 3, 2.5, True), (3, 2, 3, 0, True),
    (1, 1, 2, 0.1, False),   # the second worker may be a moment from ready: wait the grace
])
def test_ready_to_start(ready, min_w, max_w, quiet, start):
    assert decisions.ready_to_start(ready, min_w, max_w, quiet, 2.0) is start


L, I, E = StartFailureKind.LOAD, StartFailureKind.INIT, StartFailureKind.RUNTIME_ENV


@pytest.mark.parametrize("kinds, decisive", [
    ([], None),
    ([L], 0),              # a broken import fails alike everywhere: the first ends the run
    ([I], None),           # a constructor error may be a node dying under it: replace the worker
    ([I, I], 1),           # twice: deterministic
    ([E], None), ([E, E], 1),
    ([I, E], None),        # two different bad lucks
    ([I, E, I], 2),
    ([I, L], 1),
])
def test_start_failure_verdict(kinds, decisive):
    assert start_failure_verdict(kinds) == decisive
