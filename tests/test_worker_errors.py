"""A worker whose fn raises (issue 33): ``TrainerConfig.worker_errors``. ``"fail"`` (ElasticTrainer's default)
ends the run with that error; ``"replace"`` (the launcher's default) is Horovod's elastic mode: a failed worker,
dropped and replaced while the others go on, the run failing when every member of the ring failed. The pure
decision as a table, and the driver's states stepped by hand (no Ray); the launcher runs it for real in
tests/test_horovod_elastic_script.py."""

from __future__ import annotations

import pytest

from ray_integration.config import TrainerConfig
from ray_integration.driver import context as c
from ray_integration.driver.decisions import ErrorDecision, ErrorStep, worker_error_decision
from ray_integration.driver.decisions import MemberView as M
from ray_integration.driver.states import Failed, Reforming, Running, Starting
from ray_integration.errors import WorkerError
from tests.test_driver_states import ctx, drive, kinds

MEMBERS = [M("a"), M("b"), M("c")]


@pytest.mark.parametrize("policy, raised, members, dropped, expected", [
    ("fail", [], MEMBERS, set(), ErrorDecision(ErrorStep.NONE)),
    ("replace", [], MEMBERS, set(), ErrorDecision(ErrorStep.NONE)),
    # "fail": the first error ends the run, whatever the others do
    ("fail", ["b", "a"], MEMBERS, set(), ErrorDecision(ErrorStep.FAIL, worker="b")),
    # "replace": the members that raised are dropped (replaced), in rank order; the others go on
    ("replace", ["b"], MEMBERS, set(), ErrorDecision(ErrorStep.DROP, workers=("b",))),
    ("replace", ["c", "a"], MEMBERS, set(), ErrorDecision(ErrorStep.DROP, workers=("a", "c"))),
    ("replace", ["c"], [M("a"), M("b", dead=True), M("c")], {"b"}, ErrorDecision(ErrorStep.DROP, workers=("c",))),
    # ... until every member failed (raised now, dropped before, or lost): the lowest rank that raised is named
    ("replace", ["a", "b", "c"], MEMBERS, set(), ErrorDecision(ErrorStep.FAIL, worker="a", all_failed=True)),
    ("replace", ["c"], [M("a", dead=True), M("b", dead=True), M("c")], {"b"},
     ErrorDecision(ErrorStep.FAIL, worker="b", all_failed=True)),
    ("replace", ["c"], [M("a", dead=True), M("b", dead=True), M("c")], set(),   # a and b killed, c raised
     ErrorDecision(ErrorStep.FAIL, worker="c", all_failed=True)),
    # a member that returned from fn did not fail: the one that raised is dropped, the job finishes
    ("replace", ["b"], [M("a", finished=True), M("b")], set(), ErrorDecision(ErrorStep.DROP, workers=("b",))),
    # a worker that raised before it joined any ring: its script cannot start, a replacement would fail alike
    ("replace", ["z"], MEMBERS, set(), ErrorDecision(ErrorStep.FAIL, worker="z")),
    ("replace", ["z"], [], set(), ErrorDecision(ErrorStep.FAIL, worker="z")),
])
def test_worker_error_decision(policy, raised, members, dropped, expected):
    assert worker_error_decision(policy, raised, members, dropped) == expected


def test_worker_errors_is_checked_and_reaches_the_limits():
    assert TrainerConfig().limits.worker_errors == "fail"
    assert TrainerConfig(worker_errors="replace").limits.worker_errors == "replace"
    with pytest.raises(ValueError, match="worker_errors='restart' is unknown; use 'fail'"):
        TrainerConfig(worker_errors="restart")


def _error(worker: str, rank: int) -> c.UserError:
    return c.UserError(worker, "node1", WorkerError(worker, rank, "node1", "host",
                                                   f"Traceback ...\nRuntimeError: boom on {rank}\n"))


REPLACE = TrainerConfig(min_workers=2, max_workers=3, worker_errors="replace").limits


def test_replace_drops_a_member_that_raised_and_the_ring_re_forms_without_it():
    b = _error("b", 1)
    members = (M("a"), M("b", finished=True), M("c"))
    after = lambda action, x: ctx(limits=REPLACE, members=(M("a"), M("b", dead=True, finished=True), M("c")),
                                  dropped={"b": b}) if isinstance(action, c.DropRaised) else x
    actions, nxt = drive(Running(), ctx(limits=REPLACE, members=members, raised=(b,), user_error=b), after=after)
    assert actions[:2] == [c.DropRaised(("b",)), c.KillSilent()]
    assert isinstance(nxt, Reforming) and nxt.reason == "failure"


def test_replace_fails_naming_the_first_error_when_every_member_failed():
    a, b, c_ = _error("a", 0), _error("b", 1), _error("c", 2)
    members = (M("a", dead=True, finished=True), M("b", dead=True, finished=True), M("c", finished=True))
    for state in (Running(), Reforming("failure", since=90.0)):
        actions, nxt = drive(state, ctx(limits=REPLACE, members=members, raised=(c_,), user_error=c_,
                                        dropped={"a": a, "b": b}))
        assert kinds(actions) == ["AddEvent:failed"]
        assert actions[0].detail["reason"] == "every worker of the ring failed" and actions[0].detail["rank"] == 0
        assert isinstance(nxt, Failed) and isinstance(nxt.error, WorkerError) and nxt.error.rank == 0
        text = str(nxt.error)
        assert "every worker of the ring failed (3 of 3" in text and "on rank 0" in text and "boom on 0" in text


def test_replace_still_fails_at_once_for_a_worker_that_raised_before_any_ring():
    z = _error("z", None)
    actions, nxt = drive(Starting(), ctx(limits=REPLACE, joiners=("a",), raised=(z,), user_error=z))
    assert kinds(actions) == ["AddEvent:failed"] and nxt == Failed(z.error)


def test_fail_keeps_ending_the_run_with_the_first_error():
    b = _error("b", 1)
    actions, nxt = drive(Running(), ctx(members=(M("a"), M("b", finished=True)), raised=(b,), user_error=b))
    assert actions == [c.event("failed", reason="user error", worker="b", rank=1, node="node1")]
    assert nxt == Failed(b.error)


def test_giving_up_after_max_failures_names_the_last_error_of_a_dropped_worker():
    limits = TrainerConfig(max_failures=1, worker_errors="replace").limits
    b = _error("b", 1)
    _, nxt = drive(Reforming("failure", since=99.0), ctx(limits=limits, members=(M("a", waiting="failure"),),
                                                         failure_ages_s=(5.0, 0.0), dropped={"b": b}))
    assert isinstance(nxt, Failed) and "max_failures=1" in str(nxt.error)
    assert str(nxt.error).endswith("the last worker lost to an error: fn raised on rank 1: RuntimeError: boom on 1")


def test_the_exception_fn_raised_travels_as_cause_when_it_pickles_and_is_left_out_when_not():
    """``WorkerError.cause`` (what Ray Train's ``worker_failures`` shows): the exception itself through Ray's
    pickling; one that cannot be pickled (it holds a lock), or whose class cannot be rebuilt where the error is
    unpickled (a library only the workers have), is left out: the error's own trip never fails."""
    import pickle
    import threading

    from ray_integration.errors import _rebuild_worker_error

    raised = KeyError("missing column 'label'")
    error = pickle.loads(pickle.dumps(WorkerError("w1", 1, "node1", "host", "Traceback ...", cause=raised)))
    assert type(error.cause) is KeyError and error.cause.args == raised.args and error.rank == 1

    class HoldsALock(Exception):
        def __init__(self) -> None:
            super().__init__("held")
            self.lock = threading.Lock()

    error = pickle.loads(pickle.dumps(WorkerError("w1", 1, "node1", "host", "Traceback ...", cause=HoldsALock())))
    assert error.cause is None and "Traceback ..." in str(error) and error.rank == 1
    # bytes whose class the driver cannot import (a library only the workers have): what the driver's unpickling meets
    import sys
    import types

    import ray.cloudpickle

    only_on_workers = types.ModuleType("only_on_the_workers")
    only_on_workers.LibError = type("LibError", (Exception,), {"__module__": "only_on_the_workers"})
    sys.modules["only_on_the_workers"] = only_on_workers
    try:
        blob = ray.cloudpickle.dumps(only_on_workers.LibError("kernel failed"))
    finally:
        del sys.modules["only_on_the_workers"]
    with pytest.raises(ModuleNotFoundError):
        ray.cloudpickle.loads(blob)
    gone = _rebuild_worker_error("w1", 1, "node1", "host", "Traceback ...", "fn raised", blob)
    assert gone.cause is None and gone.remote_traceback == "Traceback ..."
    # the run-ending error of worker_errors="replace" keeps the first error's cause
    from ray_integration.driver.states import _every_worker_failed

    assert _every_worker_failed(WorkerError("w1", 1, "n", "h", "tb", cause=raised), 3).cause is raised
