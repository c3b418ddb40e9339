"""Bad input, each with a clear error (or a clear event), nothing hanging and nothing lost.

Covered elsewhere (and listed in the README's reliability section): mismatched tensors
(test_mismatch), different models (test_optimizer), fn raising on one rank, max_failures,
invalid options (test_trainer_ray, test_trainer_config), unwritable, corrupt and foreign
checkpoints (test_checkpoint)."""

import errno

import pytest

from ray_integration import ElasticTrainer, WorkerError
from ray_integration.driver import states as driver_mod
from state import CheckpointError
from state.checkpoints.store import CheckpointStore
from tests import ray_jobs
from tests.chaos import bad_jobs


def test_unpicklable_return_value_names_the_type_and_the_fix(ray_session):
    with pytest.raises(WorkerError, match=r"fn returned a dict that cannot be pickled .*return plain data"):
        ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(bad_jobs.returns_unpicklable)


def test_commit_on_only_some_ranks_is_a_clear_error_on_every_rank(ray_session):
    with pytest.raises(WorkerError, match="State.commit") as info:
        ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(bad_jobs.commits_on_rank0_only)
    assert "allreduce" in str(info.value)  # names what the other rank called instead


@pytest.mark.slow  # ~14 s; the commit_overdue decision and its advice stay covered by tests/test_driver_states.py
def test_fn_that_never_commits_finishes_and_is_told_to_commit(ray_session, monkeypatch):
    monkeypatch.setattr(driver_mod, "COMMIT_OVERDUE_S", 1.0)
    result = ElasticTrainer(min_workers=1, max_workers=3, progress=False).run(
        bad_jobs.never_commits, config={"steps": 100, "kill_rank": 1, "kill_step": 5, "step_delay_s": 0.08})
    kinds = [e.kind for e in result.events]
    assert "commit_overdue" in kinds, kinds   # joiners waited: the ring never reached a commit
    overdue = [e for e in result.events if e.kind == "commit_overdue"][0]
    assert "call state.commit()" in overdue.detail["advice"]
    if "worker_lost" in kinds:  # rank 1 existed in round 1: rolled back to the start (the only sync)
        assert "recovered" in kinds
    assert result.value["step"] == 100


def test_worker_stuck_in_user_code_is_killed_after_collective_timeout(ray_session):
    result = ElasticTrainer(min_workers=2, max_workers=2, collective_timeout_s=2, connect_timeout_s=3,
                            progress=False).run(
        ray_jobs.train, config={"epochs": 2, "faults": [(1, 1, 4, "hang")], "step_delay_s": 0.02})
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert len(lost) == 1 and "stuck in user code" in lost[0].detail["cause"], lost
    assert "collective_timeout_s=2" in lost[0].detail["cause"]
    assert result.value["identical"] and result.value["seen"] == [2.0] * ray_jobs.N_SAMPLES


def test_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save({"step": 1})
    real_open = store.fs.open

    def full_open(path, mode="rb", **kwargs):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(store.fs, "open", full_open)
    with pytest.raises(CheckpointError, match=r"No space left on device.*checkpoint 1 is still the newest.*Free space"):
        store.save({"step": 2})
    monkeypatch.undo()
    tree, _ = CheckpointStore(str(tmp_path / "ckpt")).load_latest()
    assert tree == {"step": 1}


def test_the_ring_forms_on_first_use_before_the_elastic_loop(ray_session):
    result = ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(bad_jobs.uses_the_ring_before_the_loop)
    assert result.value == {"rank_before": 0, "size_before": 2, "total": 2.0, "world": 2}


def test_a_failure_before_the_elastic_loop_says_only_the_loop_recovers(ray_session):
    with pytest.raises(WorkerError, match=r"a collective failed outside @er.elastic.run .*move the training loop"):
        ElasticTrainer(min_workers=2, max_workers=2, collective_timeout_s=5, progress=False).run(
            bad_jobs.uses_the_ring_before_the_loop, config={"kill_rank": 1})
