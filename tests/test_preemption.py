"""Losing the whole cluster: SIGKILL the training script and its Ray, run it again, and it resumes
from the newest durable checkpoint; SIGTERM to the script writes a final checkpoint, ``run()`` returns a
stopped Result, and the script exits with the code it chooses (75: unfinished, retry)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests import ray_jobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "resumable_job.py"
EPOCHS = 3
TOTAL_STEPS = EPOCHS * ray_jobs.N_SAMPLES // (2 * 2)


def pids_with(text: str) -> list[int]:
    """PIDs of the processes whose command line contains ``text`` (this instance's own temp dir)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def job(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="/tmp/erp")  # short: Ray's socket paths must fit in 107 bytes
    paths = {"ckpt": str(tmp_path / "ckpt"), "progress": tmp_path / "progress", "ray": ray_dir}
    yield paths
    for pid in pids_with(ray_dir):  # whatever this test's Ray left behind, by PID, never `ray stop`
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(paths, mode: str = "main") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), paths["ckpt"], str(paths["progress"]), paths["ray"], str(EPOCHS),
                             mode], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(progress: pathlib.Path, step: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = progress.read_text() if progress.exists() else ""  # read once: the job rewrites it in place
        if text.strip():
            current = int(text.split()[0])
            if current >= step:
                return current
        time.sleep(0.05)
    raise TimeoutError(f"the job did not reach step {step}")


def finish(paths) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), paths["ckpt"], str(paths["progress"]), paths["ray"] + "b", str(EPOCHS)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.slow  # ~40 s; CI covers resuming a run in tests/test_trainer_ray.py and tests/test_stop.py
def test_whole_cluster_sigkilled_then_the_same_script_resumes(job):
    proc = start(job)
    killed_at_step = wait_for_step(job["progress"], 14)
    for pid in [proc.pid] + pids_with(job["ray"]):  # the driver, the head, the workers: everything
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    result = finish(job)
    assert result["resumed_uri"] is not None and "resumed_from_checkpoint" in result["events"]
    assert result["step"] == TOTAL_STEPS                      # committed steps add up across both runs
    assert result["seen"] == [float(EPOCHS)] * ray_jobs.N_SAMPLES  # the interrupted epoch: each sample once
    assert result["identical"]
    assert killed_at_step < TOTAL_STEPS


def sigterm_then_resume(job, mode: str, resume: bool = True) -> dict:
    """SIGTERM the script at step 10: it gets a stopped Result, with its final checkpoint and metrics, and exits 75;
    the rerun (if ``resume``) resumes from that checkpoint and finishes exactly."""
    proc = start(job, mode)
    wait_for_step(job["progress"], 10)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, (proc.returncode, stdout[-2000:], stderr[-3000:])  # the script's choice
    assert "SIGTERM received: training stopped at a commit; the last commit is saved as" in stderr, stderr[-3000:]
    line = [l for l in stdout.splitlines() if l.startswith("STOPPED ")]
    assert line, stdout[-2000:]
    stopped = json.loads(line[0][len("STOPPED "):])
    stopped_at = int(job["progress"].read_text().split()[0])
    from state.checkpoints.store import CheckpointStore

    saved, info = CheckpointStore(job["ckpt"]).load_latest()
    assert saved["step"] == stopped_at  # the final commit was written: nothing trained is lost
    assert not stopped["completed"] and not stopped["forced"] and stopped["stop_reason"] == "SIGTERM", stopped
    assert stopped["checkpoint"] == info["uri"] and stopped["checkpoint_error"] is None, (stopped, info)
    assert stopped["metrics"] >= 10 and stopped["last_step"] == stopped_at, stopped
    assert stopped_at < TOTAL_STEPS
    if not resume:
        return stopped
    job["progress"].unlink()
    result = finish(job)
    assert result["resumed_uri"] == info["uri"]
    assert result["step"] == TOTAL_STEPS and result["seen"] == [float(EPOCHS)] * ray_jobs.N_SAMPLES
    return stopped


@pytest.mark.slow  # ~38 s; SIGTERM's final checkpoint and stopped Result stay covered by tests/test_stop.py
def test_sigterm_writes_a_final_checkpoint_and_returns_a_stopped_result(job):
    sigterm_then_resume(job, "main")


def test_the_trainer_holds_its_checkpoint_location_for_lease_ttl_s(tmp_path):
    """The trainer's lease is built with its lease_ttl_s option (on an object store a successor of a run that
    died takes over after that much silence; on a file system the OS frees a dead run's lock at once)."""
    from ray_integration import ElasticTrainer
    from state.checkpoints.lease import read_holder
    from state.checkpoints.transport import Location

    lease = ElasticTrainer(checkpoint_uri=str(tmp_path / "ckpt"), lease_ttl_s=7)._lease("job-ttl")
    try:
        assert lease.held and lease.ttl_s == 7.0 and lease.renew_every_s == 7.0 / 5
        holder = read_holder(Location(lease.uri))
        assert holder is not None and holder["run_id"] == "job-ttl" and holder["ttl_s"] == 7.0, holder
    finally:
        lease.release()
