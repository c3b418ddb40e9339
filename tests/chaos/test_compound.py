"""Compound faults: each ends with the exact closed-form invariant (or, for a stop, an exit 0 within
seconds, a final checkpoint, and a rerun that resumes exactly).

* SIGTERM to the driver at the same moment as a worker's SIGKILL;
* SIGTERM racing the commit at which a joiner is to join;
* every worker's clock 15 s off (plus or minus): no healthy worker is lost;
* a death during a membership re-form (a joiner is joining);
* one rank dying while the others return from fn.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ray_integration import ElasticTrainer
from tests.chaos import invariant_job
from tests.test_preemption import pids_with

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "compound_job.py"


def kinds(result):
    return [e.kind for e in result.events]


def check_exact(value):
    assert value["exact"], (value["w"], invariant_job.expected_w(value["epochs"]).tolist())
    assert value["identical"] and value["seen"] == [float(value["epochs"])] * invariant_job.N_SAMPLES


def arm(directory: pathlib.Path, *faults: tuple[str, int], min_epochs: int = 0) -> dict:
    (directory / "faults.json").write_text(json.dumps([{"id": i + 1, "kind": k, "rank": r}
                                                       for i, (k, r) in enumerate(faults)]))
    if min_epochs:
        (directory / "stop").touch()  # stop at the first epoch end at or after min_epochs
    return {"chaos_dir": str(directory), "min_epochs": min_epochs, "commit_every": 3, "step_delay_s": 0.03}


# ---------------------------------------------------------------------------------------------- in-process
@pytest.mark.slow  # ~13 s; tests/chaos/test_storm.py::test_long_storm runs every event with clocks 15 s off
def test_clocks_15_s_apart_kill_no_healthy_worker(ray_session, tmp_path):
    config = arm(tmp_path, ("sigkill", 1), min_epochs=5)
    config["clock_skew_s"] = 15.0
    result = ElasticTrainer(min_workers=2, max_workers=3, heartbeat_timeout_s=3, progress=False).run(
        invariant_job.train, config=config)
    check_exact(result.value)
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert len(lost) == 1, [e.detail for e in lost]   # only the SIGKILLed one, never a skewed healthy one
    assert "no heartbeat" not in lost[0].detail["cause"] and "silent" not in lost[0].detail["cause"], lost


def test_a_death_during_a_membership_reform(ray_session, tmp_path):
    # rank 2 dies; its replacement joins at a commit; during that membership re-form rank 1 dies
    config = arm(tmp_path, ("kill_in_join", 1), ("sigkill", 2), min_epochs=6)
    config["stop_when_fired"] = True  # the replacement must join (and rank 1 die in that re-form) before the end
    result = ElasticTrainer(min_workers=1, max_workers=3, heartbeat_timeout_s=3, progress=False).run(
        invariant_job.train, config=config)
    check_exact(result.value)
    assert all((tmp_path / f"fired-{i}").exists() for i in (1, 2))
    k = kinds(result)
    assert k.count("worker_lost") == 2 and "worker_joined" in k, k


def test_one_rank_dies_while_the_others_return(ray_session, tmp_path):
    config = arm(tmp_path, ("kill_at_end", 0), min_epochs=2)
    started = time.monotonic()
    result = ElasticTrainer(min_workers=3, max_workers=3, progress=False).run(invariant_job.train, config=config)
    assert time.monotonic() - started < 60   # not the ~62 s stuck-worker path
    check_exact(result.value)
    assert (tmp_path / "fired-1").exists()
    k = kinds(result)
    assert "finished" in k and "recovered" not in k, k


# ---------------------------------------------------------------------------------------------- real signals
@pytest.fixture
def scenario(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="/tmp/erc")  # short: Ray's socket paths must fit in 107 bytes
    paths = {"ckpt": str(tmp_path / "ckpt"), "chaos": tmp_path / "chaos", "ray": ray_dir}
    paths["chaos"].mkdir()
    yield paths
    for pid in pids_with(ray_dir):  # whatever this test's Ray left behind, by PID, never `ray stop`
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_script(paths, name: str, suffix: str = "", timeout_s: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), name, paths["ckpt"], str(paths["chaos"]), paths["ray"] + suffix],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def stop_then_resume(paths, name: str) -> dict:
    out = run_script(paths, name)
    ended = time.time()
    signaled = float((paths["chaos"] / "signaled").read_text())
    assert out.returncode == 0, out.stderr[-4000:]
    assert ended - signaled < 15, ended - signaled
    assert "SIGTERM received: training stopped at a commit" in out.stderr and "is saved as" in out.stderr, \
        out.stderr[-3000:]
    from state.checkpoints.store import CheckpointStore

    saved, _ = CheckpointStore(paths["ckpt"]).load_latest()
    assert saved["step"] > 0
    (paths["chaos"] / "faults.json").unlink(missing_ok=True)
    again = run_script(paths, "finish", suffix="b")
    line = [line for line in again.stdout.splitlines() if line.startswith("RESULT ")]
    assert again.returncode == 0 and line, again.stdout[-2000:] + again.stderr[-4000:]
    result = json.loads(line[0][len("RESULT "):])
    assert "resumed_from_checkpoint" in result["events"] and result["exact"] and result["identical"], result
    assert result["seen"] == [float(result["epochs"])] * invariant_job.N_SAMPLES
    return result


@pytest.mark.slow  # 38 s; keeps the default suite under 15 minutes on 2 cores (the join race stays in it)
def test_sigterm_and_a_worker_sigkill_at_once_stop_cleanly_and_resume_exactly(scenario):
    stop_then_resume(scenario, "sigterm_sigkill")


@pytest.mark.slow  # 40 s; SIGTERM's clean stop and resume stay in the default suite (tests/test_preemption.py, test_stop.py)
def test_sigterm_racing_a_join_commit_stops_cleanly_and_resumes_exactly(scenario):
    stop_then_resume(scenario, "sigterm_at_join")


@pytest.mark.slow  # ~23 s (CI time); writer errors and SIGTERM each keep their default-suite tests
def test_a_writer_error_then_sigterm_exits_within_seconds_saying_so(scenario):
    out = run_script(scenario, "writer_error")
    ended = time.time()
    signaled = float((scenario["chaos"] / "signaled").read_text())
    assert out.returncode != 0 and ended - signaled < 15, (out.returncode, ended - signaled, out.stderr[-3000:])
    assert "SIGTERM received, but the job could not stop cleanly" in out.stderr, out.stderr[-3000:]
    assert "Flaky cannot be saved" in out.stderr and "newest durable checkpoint" in out.stderr, out.stderr[-3000:]
    from state.checkpoints.store import CheckpointStore

    saved, info = CheckpointStore(scenario["ckpt"], trusted=True).load_latest()  # the previous one, intact
    assert 0 < saved["step"] <= 18, saved["step"]


@pytest.mark.slow  # ~22 s; resuming from the newest checkpoint stays covered by tests/test_trainer_ray.py (a second run)
def test_the_root_dying_while_it_sends_a_resumed_checkpoint_does_not_restart_from_scratch(ray_session, tmp_path):
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    options = dict(min_workers=2, max_workers=3, checkpoint_uri=str(tmp_path / "ckpt"), checkpoint_every_n_commits=1,
                   heartbeat_timeout_s=3, progress=False)
    first = ElasticTrainer(**options).run(invariant_job.train, config=arm(first_dir, min_epochs=3))
    check_exact(first.value)
    assert first.value["epochs"] == 3
    # the next run's root dies while it sends the checkpoint it resumed: the next root resumes it again
    second = ElasticTrainer(**options).run(invariant_job.train,
                                           config=arm(second_dir, ("kill_in_first_sync", 0), min_epochs=1))
    assert (second_dir / "fired-1").exists()
    check_exact(second.value)
    assert second.value["epochs"] == 4, second.value["epochs"]  # epoch 3 on top of the resumed three
    k = kinds(second)
    assert k.count("worker_lost") == 1 and "resumed_from_checkpoint" in k, k
