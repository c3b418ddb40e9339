"""Stopping a run: ``ElasticTrainer.stop()`` from another thread, a second stop that abandons, the stop
timeout, stop() before run(), and SIGTERM wired to stop() when run() is not on the main thread. Every
stop returns a :class:`Result` (``stopped=True``); nothing raises ``SystemExit``. Real Ray, real workers."""

import threading
import time

import pytest

from ray_integration import ElasticTrainer
from tests import ray_jobs
from tests.test_preemption import job, sigterm_then_resume  # noqa: F401  (the fixture)

# rank 0 hangs in fn once it is at step 4 to 7 (its heartbeats go on): no commit can come after that. In
# any of the first rounds: a formation that a loaded machine makes fail re-forms the ring in round 2, 3...
HANG_AT_STEP_4 = [(round_id, 0, step, "hang") for round_id in range(1, 6) for step in range(4, 8)]


class Background:
    """``trainer.run(...)`` on a thread that is not the main one; records reports as they arrive."""

    def __init__(self, trainer: ElasticTrainer, config: dict) -> None:
        self.trainer, self.steps = trainer, []
        self.reached = threading.Condition()
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(config,), name="run", daemon=True)
        self.thread.start()

    def _on_report(self, record: dict) -> None:
        with self.reached:
            self.steps.append(record.get("step", 0))
            self.reached.notify_all()

    def _run(self, config: dict) -> None:
        try:
            self.result = self.trainer.run(ray_jobs.train, config=config, on_report=self._on_report)
        except BaseException as exc:  # SystemExit included: the test fails on it below
            self.error = exc

    def wait_for_step(self, step: int, timeout_s: float = 40.0) -> None:
        with self.reached:
            if not self.reached.wait_for(lambda: max(self.steps, default=0) >= step or not self.thread.is_alive(),
                                         timeout_s):
                raise TimeoutError(f"the run did not reach step {step} within {timeout_s} s (steps: {self.steps[-5:]})")
        assert self.thread.is_alive(), (self.error, self.result)

    def wait_for_the_hang(self) -> None:
        """Rank 0 reported step 4 and then commits before it hangs: let it get there, so that a stop asked for
        now cannot be served at that commit."""
        self.wait_for_step(4)
        time.sleep(1.5)
        assert max(self.steps) <= 7 and self.thread.is_alive(), (self.steps[-5:], self.error, self.result)

    def join(self, timeout_s: float):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"run() did not return within {timeout_s} s of the stop"
        assert self.error is None, repr(self.error)
        return self.result


def test_stop_from_another_thread_returns_a_stopped_result_with_the_checkpoint(ray_session, tmp_path, capfd):
    trainer = ElasticTrainer(min_workers=2, max_workers=2, checkpoint_uri=str(tmp_path / "ckpt"),
                             checkpoint_every_n_commits=1000, progress=False)
    run = Background(trainer, {"epochs": 50, "step_delay_s": 0.05})
    run.wait_for_step(6)
    with pytest.raises(RuntimeError, match="already running on this trainer"):
        trainer.run(ray_jobs.train, config={})  # one job per trainer at a time
    asked = time.monotonic()
    trainer.stop("maintenance")  # from the main thread; run() is on another one
    result = run.join(30)
    assert time.monotonic() - asked < 10
    assert result.stopped and not result.completed and not result.forced, result
    assert result.stop_reason == "maintenance" and result.value is None and result.checkpoint_error is None
    from state.checkpoints.store import CheckpointStore

    saved, info = CheckpointStore(str(tmp_path / "ckpt")).load_latest()
    assert result.checkpoint_uri == info["uri"]  # the stop's final commit, written durably (no cadence write was due)
    assert saved["step"] == max(r["step"] for r in result.metrics_history) >= 6
    assert [e.kind for e in result.events if e.kind == "checkpoint_written"], [e.kind for e in result.events]
    err = capfd.readouterr().err
    assert "stop requested (maintenance): training stopped at a commit; the last commit is saved as" in err, err[-2000:]
    assert result.message in err


def test_a_second_stop_abandons_and_returns_a_forced_result(ray_session, tmp_path, capfd):
    trainer = ElasticTrainer(min_workers=2, max_workers=2, checkpoint_uri=str(tmp_path / "ckpt"),
                             checkpoint_every_n_commits=1, progress=False)
    run = Background(trainer, {"epochs": 50, "step_delay_s": 0.05, "faults": HANG_AT_STEP_4})
    run.wait_for_the_hang()
    trainer.stop("SIGTERM")
    run.thread.join(1.5)
    assert run.thread.is_alive()  # it waits for a commit that does not come (rank 0 hangs)
    asked = time.monotonic()
    trainer.stop("SIGTERM")
    result = run.join(20)
    assert time.monotonic() - asked < 8
    assert result.stopped and result.forced and not result.completed, result
    assert result.stop_reason == "SIGTERM" and "abandoned" in result.abandoned, result
    assert "newest durable checkpoint" in result.abandoned and result.checkpoint_uri is not None  # a cadence write
    err = capfd.readouterr().err
    assert "elastic_ring: a second SIGTERM: stopping at once; the workers were killed; training since" in err, err[-2000:]


def test_the_workers_not_reaching_a_commit_within_stop_timeout_s_force_the_stop(ray_session, tmp_path, capfd):
    trainer = ElasticTrainer(min_workers=2, max_workers=2, stop_timeout_s=2, progress=False)
    run = Background(trainer, {"epochs": 50, "step_delay_s": 0.05, "faults": HANG_AT_STEP_4})
    run.wait_for_the_hang()
    trainer.stop()
    result = run.join(20)
    assert result.stopped and result.forced and result.stop_reason == "stop() called", result
    assert result.checkpoint_uri is None and "no checkpoint_uri was set" in result.abandoned, result
    assert "did not reach a commit within stop_timeout_s=2" in result.message
    assert "did not reach a commit within stop_timeout_s=2" in capfd.readouterr().err


def test_stop_before_run_returns_at_once_and_the_next_run_starts_afresh(ray_session, tmp_path):
    trainer = ElasticTrainer(min_workers=2, max_workers=2, progress=False)
    trainer.stop("not now")
    started = time.monotonic()
    result = trainer.run(ray_jobs.train, config={"epochs": 1})
    assert time.monotonic() - started < 2  # nothing started
    assert result.stopped and not result.completed and result.stop_reason == "not now" and not result.events
    again = trainer.run(ray_jobs.train, config={"epochs": 1})  # the stop was consumed by the run it stopped
    assert again.completed and not again.stopped and again.stop_reason is None
    assert again.value["seen"] == [1.0] * ray_jobs.N_SAMPLES


def test_stop_validates_its_reason():
    trainer = ElasticTrainer()
    with pytest.raises(TypeError, match="non-empty string"):
        trainer.stop("")


def test_sigterm_wired_to_stop_while_run_is_on_another_thread(job):  # noqa: F811
    # tests/scripts/resumable_job.py "thread": signal.signal(SIGTERM, lambda *_: trainer.stop("SIGTERM"))
    stopped = sigterm_then_resume(job, "thread", resume=False)  # the resume: test_preemption.py
    assert stopped["stop_reason"] == "SIGTERM"


def test_a_failed_final_checkpoint_flush_is_the_results_checkpoint_error(tmp_path, capsys):
    """A worker whose final flush fails sends a checkpoint_failed event with ``final`` (instead of failing the
    run): the stopped Result carries its error, and the stderr line says the stop was not clean."""
    from types import SimpleNamespace

    from ray_integration.driver.events import EventLog
    from ray_integration.driver.states import Stopped

    events = EventLog()
    events.add("checkpoint_written", 1, 2, uri="file:///x/ckpt-000001")
    events.add("checkpoint_failed", 1, 2, final=True, error="disk full while writing ckpt-000002")
    trainer = ElasticTrainer(checkpoint_uri=str(tmp_path / "ckpt"))
    result = trainer._result(Stopped("SIGTERM"), SimpleNamespace(metrics=[{"step": 4}]), events, "SIGTERM")
    assert result.stopped and not result.completed and not result.forced
    assert result.checkpoint_error == "disk full while writing ckpt-000002"
    assert result.metrics_history == [{"step": 4}] and result.checkpoint_uri == "file:///x/ckpt-000001"
    err = capsys.readouterr().err
    assert "SIGTERM received, but the job could not stop cleanly: the final checkpoint failed: disk full" in err, err
    # a checkpoint written after the failed flush (a drained worker's flush failed, the ring's next write did not)
    events.add("checkpoint_written", 2, 1, uri="file:///x/ckpt-000003")
    later = trainer._result(Stopped("SIGTERM"), SimpleNamespace(metrics=[]), events, "SIGTERM")
    assert later.checkpoint_error is None and "training stopped at a commit" in later.message
