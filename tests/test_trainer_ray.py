"""ElasticTrainer on a real local Ray instance: training, a SIGKILLed worker, a joiner, a SIGSTOPped
worker, a user exception, and bad settings. Every run checks the exact invariant: each sample seen
once per epoch in committed work, identical parameters on all ranks, the expected committed steps."""

import json
import time

import pytest

from ray_integration import ElasticTrainer, RunFailed, WorkerError
from tests import ray_jobs


def kinds(result):
    return [e.kind for e in result.events]


def check_invariant(result, epochs):
    assert result.value["identical"], "ranks of the final ring must hold identical parameters"
    assert result.value["seen"] == [float(epochs)] * ray_jobs.N_SAMPLES, "every sample once per epoch"


def test_training_reports_metrics_and_events(ray_session):
    result = ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(ray_jobs.train, config={"epochs": 2})
    check_invariant(result, 2)
    assert result.value["step"] == 2 * ray_jobs.N_SAMPLES // (2 * 2)
    assert kinds(result) == ["ring_formed", "finished"]
    assert result.metrics["step"] == result.value["step"] and result.metrics["world_size"] == 2
    assert result.checkpoint is None and result.checkpoint_uri is None and result.path is None


@pytest.mark.slow  # ~20 s; a SIGKILL and a replacement's join stay covered, with stronger checks, by tests/test_join_at_step.py
def test_sigkilled_worker_survivors_recover_and_a_replacement_joins(ray_session, tmp_path):
    timeline_path = tmp_path / "timeline.json"
    result = ElasticTrainer(min_workers=2, max_workers=3, progress=False, timeline_path=str(timeline_path)).run(
        ray_jobs.train, config={"epochs": 6, "faults": [(1, 2, 3, "kill")], "step_delay_s": 0.15})
    check_invariant(result, 6)
    k = kinds(result)
    assert k[:4] == ["ring_formed", "worker_lost", "ring_formed", "recovered"], k
    recovered = [e for e in result.events if e.kind == "recovered"][0]
    assert recovered.world_size == 2 and recovered.detail["seconds"] < 1.0
    # the replacement was started in the background and joined at a commit, without a rollback
    assert "worker_joined" in k and "resized" in k, k
    check_timeline(timeline_path, result)


def check_timeline(path, result):
    """The Chrome trace is valid JSON with every worker's fusion, collective, state and membership
    events, identity in their args, and the driver's membership history."""
    trace = json.loads(path.read_text())["traceEvents"]
    workers = {e["pid"] for e in trace if e["pid"] != 0 and e["ph"] != "M"}
    assert len(workers) >= 4, workers  # three first members and the replacement
    names = {(e["cat"], e["name"]) for e in trace if e["ph"] != "M"}
    for expected in [("fusion", "pack"), ("fusion", "unpack"), ("collective", "allreduce"),
                     ("collective", "broadcast"), ("state", "commit"), ("state", "sync"), ("state", "sync_decision"),
                     ("membership", "reform"), ("membership", "collective_failed"),
                     ("membership", "membership_changed"), ("membership", "worker_lost"),
                     ("membership", "worker_joined"), ("membership", "ring_formed")]:
        assert expected in names, (expected, sorted(names))
    # after the failure the survivors either go on from a whole live state or roll back (and restore)
    modes = {e["args"]["mode"] for e in trace if e["name"] == "sync_decision"}
    assert modes & {"live", "rollback"}, modes
    assert ("rollback" in modes) == (("state", "restore") in names), (modes, sorted(names))
    for e in trace:
        assert {"name", "ph", "pid"} <= set(e) and (e["ph"] == "M" or isinstance(e["ts"], float)), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and {"rank", "world", "round"} <= set(e["args"]), e
    commits = [e for e in trace if e["name"] == "commit"]
    assert max(e["args"]["step"] for e in commits) == result.value["step"]
    labels = [e["args"]["name"] for e in trace if e["name"] == "process_name"]
    assert labels[0] == "driver (membership)" and all("ranks" in label for label in labels[1:]), labels
    assert result.value["world"] == 3


def test_sigstopped_worker_is_declared_dead_after_the_heartbeat_timeout(ray_session):
    started = time.monotonic()
    result = ElasticTrainer(min_workers=1, max_workers=2, heartbeat_timeout_s=2.0, collective_timeout_s=30,
                            progress=False).run(
        ray_jobs.train, config={"epochs": 2, "faults": [(1, 1, 3, "stop")], "step_delay_s": 0.05})
    check_invariant(result, 2)
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert lost and "no heartbeat" in lost[0].detail["cause"]
    assert time.monotonic() - started < 60
    # the survivors' ring is aborted at once (not after Ray's graceful kill of the stopped process)
    recovered = [e for e in result.events if e.kind == "recovered"]
    assert recovered and recovered[0].detail["seconds"] < 1.5, recovered


def test_a_worker_that_loses_its_rendezvous_is_a_lost_worker_not_the_end_of_the_job(ray_session):
    result = ElasticTrainer(min_workers=1, max_workers=2, progress=False).run(
        ray_jobs.train, config={"epochs": 3, "faults": [(1, 1, 3, "rendezvous")], "step_delay_s": 0.05,
                                "slow_below_size": 2})  # the lone survivor steps slowly until replaced
    check_invariant(result, 3)
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert lost and "left the job" in lost[0].detail["cause"] and "injected" in lost[0].detail["cause"], lost
    assert "recovered" in kinds(result) and "worker_joined" in kinds(result), kinds(result)  # replaced


def test_a_failed_final_checkpoint_is_recorded_in_the_result_not_a_failed_run(ray_session, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    result = ElasticTrainer(min_workers=2, max_workers=2, checkpoint_uri=f"slowfile://{ckpt}",
                            checkpoint_every_n_commits=1, progress=False).run(
        ray_jobs.train, config={"epochs": 2, "refuse_writes_in": str(ckpt)})
    check_invariant(result, 2)                      # the training is not undone by its last write failing
    assert result.completed and result.checkpoint_error, result
    assert "Permission denied" in result.checkpoint_error
    final = [e for e in result.events if e.kind == "checkpoint_failed" and e.detail.get("final")]
    assert final, kinds(result)
    assert result.checkpoint_uri is not None        # the newest complete checkpoint, from before


def test_user_exception_ends_the_run_with_rank_node_and_traceback(ray_session):
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(
            ray_jobs.train, config={"raise_at_step": 3, "raise_rank": 1})
    assert time.monotonic() - started < 60
    err = info.value
    assert err.rank == 1 and err.node_id
    assert "ValueError: user bug at step 3" in err.remote_traceback and "ray_jobs.py" in err.remote_traceback


def test_gpus_on_a_cluster_without_gpus_fail_fast(ray_session):
    with pytest.raises(ValueError, match="has no GPUs; set use_gpu=False"):
        ElasticTrainer(use_gpu=True).run(ray_jobs.train)


def test_impossible_resources_fail_after_start_timeout_with_advice(ray_session):
    with pytest.raises(RunFailed, match=r"only 0 of min_workers=1 workers started within start_timeout_s=3: 1 worker "
                                        r"actor\(s\) are still waiting for resources the cluster lacks: unicorn "
                                        r"\(each worker needs 1; the cluster has 0, 0 free\)"):
        ElasticTrainer(min_workers=1, max_workers=1, resources_per_worker={"unicorn": 1}, start_timeout_s=3,
                       progress=False).run(ray_jobs.train)


def test_max_failures_exceeded_ends_the_run(ray_session):
    with pytest.raises(RunFailed, match=r"1 failures within failure_window_s=3600 exceed max_failures=0"):
        ElasticTrainer(min_workers=1, max_workers=2, max_failures=0, progress=False).run(
            ray_jobs.train, config={"faults": [(1, 1, 3, "kill")]})


def test_checkpoint_uri_persists_and_a_second_run_resumes(ray_session, tmp_path):
    uri = str(tmp_path / "ckpt")
    options = dict(min_workers=2, max_workers=2, checkpoint_uri=uri, checkpoint_every_n_commits=4, progress=False)
    first = ElasticTrainer(**options).run(ray_jobs.train, config={"epochs": 2})
    assert first.checkpoint_uri is not None and first.checkpoint_uri.startswith("file://") and "ckpt-" in first.checkpoint_uri
    assert first.value["resumed_from"] is None
    # same script again (e.g. after the cluster was lost): it resumes from the newest checkpoint
    second = ElasticTrainer(**options).run(ray_jobs.train, config={"epochs": 3})
    assert second.value["resumed_from"]["uri"] == first.checkpoint_uri
    resumed = [e for e in second.events if e.kind == "resumed_from_checkpoint"]
    assert len(resumed) == 1 and resumed[0].detail["uri"] == first.checkpoint_uri and resumed[0].round_id == 1
    assert resumed[0].detail["step"] > 0 and resumed[0].detail["epoch"] in (1, 2)
    # epochs 0-1 came from the checkpoint; only epoch 2 was trained now, each sample once more
    check_invariant(second, 3)
    assert second.value["step"] == 3 * ray_jobs.N_SAMPLES // (2 * 2)
