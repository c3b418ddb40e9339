"""Losing the whole cluster: SIGKILL the training script and its Ray, run it again, and it resumes
from the newest durable checkpoint; SIGTERM to the script writes a final checkpoint and exits cleanly."""

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


def start(paths) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), paths["ckpt"], str(paths["progress"]), paths["ray"], str(EPOCHS)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(progress: pathlib.Path, step: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if progress.exists() and progress.read_text().strip():
            current = int(progress.read_text().split()[0])
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


def test_sigterm_writes_a_final_checkpoint_and_exits_cleanly(job):
    proc = start(job)
    wait_for_step(job["progress"], 10)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received: training stopped at a commit; the last commit is saved as" in stderr
    stopped_at = int(job["progress"].read_text().split()[0])
    from state import CheckpointStore

    saved, _ = CheckpointStore(job["ckpt"]).load_latest()
    assert saved["step"] == stopped_at  # the final commit was written: nothing trained is lost
    job["progress"].unlink()
    result = finish(job)
    assert result["resumed_uri"] is not None
    assert result["step"] == TOTAL_STEPS and result["seen"] == [float(EPOCHS)] * ray_jobs.N_SAMPLES
    assert stopped_at < TOTAL_STEPS
