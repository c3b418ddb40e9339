"""The driver's decisions as tables: who is dead or stuck, when a ring is done, re-forms, stops or gives up.
Pure functions of typed observations: no Ray, no clocks."""

import pytest

from ray_integration import decisions
from ray_integration.config import TrainerConfig
from ray_integration.decisions import MemberView as M
from ray_integration.decisions import Outcome, StartFailureKind, Step, start_failure_verdict

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
    cause = decisions.kill_cause(member, LIMITS, failure_age_s)
    assert (cause is None) == (expected is None), cause
    if expected:
        assert expected in cause


def test_stuck_deadline_follows_the_timeouts_so_raising_one_never_kills_survivors_forming_a_ring():
    # a survivor blocked forming a communicator waits connect_timeout_s after its collective timed out
    slow = TrainerConfig(connect_timeout_s=300, collective_timeout_s=60).limits
    assert slow.stuck_after_s > 300 + 60
    assert decisions.kill_cause(M("a", silent_s=0.1), slow, 300 + 60 + 1) is None


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
    # every holder of the state is gone: fail, or, when stopping, stop with nothing to save
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


@pytest.mark.parametrize("failures, max_failures, gives_up", [(0, 0, False), (1, 0, True), (3, 3, False), (4, 3, True)])
def test_give_up_after_failure(failures, max_failures, gives_up):
    message = decisions.give_up_after_failure(failures, max_failures)
    assert (message is not None) == gives_up
    if gives_up:
        assert f"max_failures={max_failures}" in message


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
