"""The driver's states decide without acting (issue 31): stepped with a Context made by hand, without Ray or a
pool, each yields the actions the loop must do, in order, and names the next state."""

from __future__ import annotations

import pytest

from ray_integration.config import TrainerConfig
from ray_integration.driver import context as c
from ray_integration.driver.decisions import MemberView as M
from ray_integration.driver.drains import DrainView
from ray_integration.driver.states import (
    COMMIT_OVERDUE_S, START_GRACE_S, Failed, Finished, Reforming, Running, Starting, Stopped,
)
from ray_integration.errors import RunFailed, WorkerError

LIMITS = TrainerConfig(min_workers=2, max_workers=3, stop_timeout_s=30).limits


def ctx(**changes) -> c.Context:
    base = dict(now=100.0, limits=LIMITS, start_timeout_s=120.0, round_id=1, world_size=None, members=(),
                joiners=(), results={}, unreported_losses=(), newly_draining=(), failure_ages_s=(), stop_reason=None,
                stop_age_s=None, abort_reason=None, tampering=None, user_error=None, start_failures=(),
                returned_early=(), ever_had_state=False, checkpoint=None)
    return c.Context(**{**base, **changes})


def drive(state, context, after=None):
    """One step of ``state``: every action is shown ``context`` again, or ``after(action, context)``'s. Returns
    (the actions, the next state)."""
    steps, actions = state.step(context), []
    try:
        action = next(steps)
        while True:
            actions.append(action)
            context = after(action, context) if after else context
            action = steps.send(context)
    except StopIteration as done:
        return actions, done.value


def kinds(actions):
    return [type(a).__name__ + (f":{a.kind}" if isinstance(a, c.AddEvent) else "") for a in actions]


def test_a_stop_before_anything_trained_stops_the_waiting_workers():
    actions, nxt = drive(Starting(), ctx(stop_reason="SIGTERM", stop_age_s=0.1))
    assert actions == [c.StopWaiting("the job stopped before it trained")]
    assert nxt == Stopped("SIGTERM", note="nothing had trained yet")


def test_starting_forms_the_first_ring_once_enough_are_ready():
    starting = Starting()
    actions, nxt = drive(starting, ctx(joiners=("a", "b")))  # min 2 ready, max 3: wait START_GRACE_S for more
    assert kinds(actions) == ["PollDrains", "KillSilent", "RequestCapacity"] and nxt is starting
    assert actions[1] == c.KillSilent(members=False)  # joiners: the heartbeat rule only
    actions, nxt = drive(starting, ctx(now=100.0 + START_GRACE_S, joiners=("a", "b")))
    assert actions[-1] == c.Form((), ("a", "b"), reason="start") and isinstance(nxt, Running)
    actions, nxt = drive(Starting(), ctx(joiners=("a", "b", "c")))  # max_workers ready: at once
    assert actions[-1] == c.Form((), ("a", "b", "c"), reason="start") and isinstance(nxt, Running)


def test_starting_past_its_timeout_fails_with_the_loops_diagnosis():
    starting = Starting()
    drive(starting, ctx(joiners=("a",)))
    actions, nxt = drive(starting, ctx(now=100.0 + 121, joiners=("a",)),
                         after=lambda a, x: ctx(now=x.now, start_diagnosis="only 1 of 2") if isinstance(
                             a, c.DiagnoseStart) else x)
    assert actions[-1] == c.DiagnoseStart(1) and isinstance(nxt, Failed) and str(nxt.error) == "only 1 of 2"


@pytest.mark.parametrize("fatal, expected_event", [
    (dict(abort_reason="a second SIGTERM"), None),
    (dict(tampering="messages lost"), "failed"),
    (dict(start_failures=(c.StartFailure("w1", c.StartFailureKind.LOAD, "No module named x"),)), "failed"),
])
def test_fatal_inputs_end_the_run_in_every_state(fatal, expected_event):
    for state in (Starting(), Running(), Reforming("failure", since=90.0)):
        actions, nxt = drive(state, ctx(**fatal))
        assert kinds(actions) == ([] if expected_event is None else [f"AddEvent:{expected_event}"]), state
        assert nxt.terminal and (isinstance(nxt, Stopped) and nxt.forced if "abort_reason" in fatal else
                                 isinstance(nxt, Failed) and isinstance(nxt.error, RunFailed))


def test_a_worker_that_cannot_load_fn_ends_the_run_with_the_hint():
    _, nxt = drive(Running(), ctx(start_failures=(c.StartFailure("w1", c.StartFailureKind.LOAD, "No module x"),)))
    assert "worker w1 could not start or load fn" in str(nxt.error) and "Hint: if the module that defines fn" in \
        str(nxt.error)
    _, nxt = drive(Running(), ctx(start_failures=(c.StartFailure("w1", c.StartFailureKind.INIT, "boom"),)))
    assert nxt is not None and not nxt.terminal  # one constructor error may be the node's: a second one decides


def test_a_user_error_ends_the_run_with_that_error():
    error = WorkerError("w1", 1, "node1", "host", "Traceback ...")
    actions, nxt = drive(Running(), ctx(user_error=c.UserError("w1", "node1", error)))
    assert actions == [c.event("failed", reason="user error", worker="w1", rank=1, node="node1")]
    assert nxt == Failed(error)


def test_running_asks_for_the_stop_commit_once_then_waits_for_it():
    members = (M("a"), M("b"))
    running = Running()
    actions, nxt = drive(running, ctx(members=members, stop_reason="SIGTERM", stop_age_s=1.0))
    # (drains are still polled: a notice during a stop is recorded; the stop's durable write covers it)
    assert actions == [c.KillSilent(), c.RequestPersist("stop", 30, stop=True), c.PollDrains()] and nxt is running
    actions, nxt = drive(running, ctx(members=members, stop_reason="SIGTERM", stop_age_s=2.0))
    assert actions == [c.KillSilent(), c.PollDrains()] and nxt is running
    _, nxt = drive(running, ctx(members=members, stop_reason="SIGTERM", stop_age_s=31.0))
    assert nxt.forced and "stop_timeout_s=30" in nxt.note


def test_running_decides_after_its_kills_a_lost_member_re_forms():
    alive, dead = (M("a"), M("b")), (M("a"), M("b", dead=True))
    actions, nxt = drive(Running(), ctx(members=alive), after=lambda a, x: ctx(members=dead))
    assert actions == [c.KillSilent()] and isinstance(nxt, Reforming) and nxt.reason == "failure"


def test_running_grows_for_a_joiner_and_warns_when_no_commit_comes():
    running = Running()
    actions, nxt = drive(running, ctx(members=(M("a"), M("b")), joiners=("c",)))
    assert kinds(actions) == ["KillSilent", "PollDrains", "AddEvent:membership_change_requested", "Notify",
                              "RequestCapacity"]
    actions, _ = drive(running, ctx(now=101.0 + COMMIT_OVERDUE_S, members=(M("a"), M("b")), joiners=("c",)))
    assert "AddEvent:commit_overdue" in kinds(actions) and "Notify" not in kinds(actions)


def test_a_drain_that_leaves_too_few_writes_a_probe_at_once_and_trains_on():
    # the final write comes just in time (tests/test_drain_decisions.py); at the notice: a probe, no re-form
    members = (M("a", has_state=True), M("b", has_state=True, leaving=True, leave_in_s=42.04))
    actions, _ = drive(Running(), ctx(members=members, newly_draining=("b",), drain=DrainView(can_persist=True)))
    assert c.RequestPersist("drain", 42.0) in actions and c.Notify() not in actions


def test_reforming_after_a_failure_aborts_reports_counts_and_forms():
    members = (M("a", waiting="failure", has_state=True), M("b", dead=True), M("c", waiting="failure"))
    reforming = Reforming("failure", since=99.0)
    actions, nxt = drive(reforming, ctx(members=members, unreported_losses=("b",), ever_had_state=True,
                                        joiners=("d",)))
    assert kinds(actions) == ["AbortRound", "PollDrains", "KillSilent", "ReportLost", "CountFailure", "Form",
                              "AddEvent:recovered"]
    assert actions[2] == c.KillSilent(failure_age_s=1.0) and actions[3] == c.ReportLost(("b",))
    assert actions[5] == c.Form(("a", "c"), ("d",), reason="failure")
    assert isinstance(nxt, Running)


def test_reforming_after_a_known_loss_answers_the_heard_survivors_before_they_ask():
    members = (M("a", has_state=True, silent_s=0.1), M("b", dead=True), M("c", silent_s=0.1))
    actions, nxt = drive(Reforming("failure", since=99.0), ctx(members=members, unreported_losses=("b",),
                                                                ever_had_state=True))
    assert kinds(actions) == ["AbortRound", "PollDrains", "KillSilent", "ReportLost", "CountFailure", "Form",
                              "AddEvent:recovered"]
    assert actions[5] == c.Form(("a", "c"), (), reason="failure", prompt=True) and isinstance(nxt, Running)
    # a stop on its way: the survivors' requests are waited for (their ring commits durably and stops)
    actions, nxt = drive(Reforming("failure", since=99.0), ctx(members=members, ever_had_state=True,
                                                                stop_reason="SIGTERM", stop_age_s=0.0))
    assert "Form" not in kinds(actions) and isinstance(nxt, Reforming)


def test_a_membership_re_form_that_loses_a_member_waits_for_the_requests_it_sent_no_abort_for():
    members = (M("a", has_state=True, silent_s=0.1), M("b", dead=True), M("c", waiting="membership", silent_s=0.1))
    actions, nxt = drive(Reforming("membership", since=99.0), ctx(members=members, ever_had_state=True))
    assert "AbortRound" not in kinds(actions) and "Form" not in kinds(actions) and isinstance(nxt, Reforming)


def test_a_ring_given_ahead_that_fails_to_form_with_nobody_lost_is_the_same_failure_counted_once():
    waiting = (M("a", waiting="failure", has_state=True), M("c", silent_s=0.1))
    actions, _ = drive(Reforming("failure", since=99.0), ctx(members=waiting, ever_had_state=True, prompt_age_s=31.0))
    assert "CountFailure" not in kinds(actions)
    lost = (M("a", waiting="failure", has_state=True), M("c", dead=True))
    actions, _ = drive(Reforming("failure", since=99.0), ctx(members=lost, ever_had_state=True, prompt_age_s=31.0,
                                                              unreported_losses=("c",)))
    assert "CountFailure" in kinds(actions)  # a new loss
    actions, _ = drive(Reforming("failure", since=99.0), ctx(members=waiting, ever_had_state=True))
    assert "CountFailure" in kinds(actions)  # an ordinary ring's failure
    actions, _ = drive(Reforming("failure", since=99.0), ctx(members=waiting, ever_had_state=True, prompt_age_s=3600.0))
    assert "CountFailure" in kinds(actions)  # a ring given ahead that formed and trained for an hour


def test_reforming_fails_when_failures_exceed_max_failures():
    limits = TrainerConfig(max_failures=1).limits
    reforming = Reforming("failure", since=99.0)
    actions, nxt = drive(reforming, ctx(limits=limits, members=(M("a", waiting="failure"),), failure_ages_s=(5.0, 0.0)))
    assert kinds(actions)[-1] == "CountFailure" and isinstance(nxt, Failed) and "max_failures=1" in str(nxt.error)


def test_finishing_stops_the_waiting_and_returns_the_lowest_finished_ranks_value():
    members = (M("a", finished=True), M("b", finished=True), M("c", waiting="failure"))
    actions, nxt = drive(Running(), ctx(members=members, results={"a": 7, "b": 8}))
    assert actions[-1] == c.StopWorkers(("c",), "the job finished") and nxt == Finished(7)
    _, nxt = drive(Running(), ctx(members=members, results={"a": None, "b": None}, stop_reason="SIGTERM",
                                  stop_age_s=0.0))
    assert nxt == Stopped("SIGTERM")


def test_running_pushes_its_notices_again_while_they_may_be_lost_doubling_the_wait_five_times():
    from ray_integration.driver.pacing import NOTICE_REPEAT_S, NOTICE_REPEATS

    running, members = Running(), (M("a"), M("b"))
    actions, _ = drive(running, ctx(members=members, joiners=("c",)))
    assert "Notify" in kinds(actions)
    at, pushed = 100.0, []
    for tick in range(1, 700):  # every 0.1 s for 70 s
        now = 100.0 + tick / 10
        actions, _ = drive(running, ctx(now=now, members=members, joiners=("c",)))
        if c.RepeatNotices() in actions:
            pushed.append(round(now - at, 1))
            at = now
    assert pushed == [NOTICE_REPEAT_S * 2 ** k for k in range(NOTICE_REPEATS)]  # 2, 4, 8, 16, 32 s apart


def test_a_stop_is_pushed_again_too_even_when_it_came_with_the_ring():
    running = Running(stop_sent=True)  # the stop rode on the ring answers: pushed again are the round's notices
    members = (M("a"), M("b"))
    stop = dict(members=members, stop_reason="SIGTERM", stop_age_s=1.0)
    actions, _ = drive(running, ctx(**stop))
    assert c.RepeatNotices() not in actions
    actions, _ = drive(running, ctx(now=102.0, **stop))
    assert c.RepeatNotices() in actions and c.RequestPersist("stop", 30, stop=True) not in actions


def test_a_stop_request_is_pushed_again():
    members = (M("a"), M("b"))
    running = Running()
    stop = dict(members=members, stop_reason="SIGTERM", stop_age_s=1.0)
    actions, _ = drive(running, ctx(**stop))
    assert c.RequestPersist("stop", 30, stop=True) in actions and c.RepeatNotices() not in actions
    actions, _ = drive(running, ctx(now=102.0, **stop))
    assert c.RepeatNotices() in actions

