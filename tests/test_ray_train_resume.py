"""Losing the whole cluster under Ray Train's fashion-MNIST port: the driver and every process of its Ray are
SIGKILLed mid-epoch, after the first reported checkpoint is durable; the same script, run again, resumes from
``get_checkpoint()`` (the newest reported checkpoint) and trains only what is left.

The script (``tests/scripts/ray_train_resume_job.py``) runs the example's own ``train_func_per_worker`` with
``ScalingConfig(num_workers=(1, 2))`` and ``RunConfig(storage_path, name)`` on its own local Ray in its own temp
dir; the kill finds that Ray's processes by PID (their command lines name the temp dir, and the driver's
descendants), never by name.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from state.checkpoints.lease_file import LOCK_NAME, read_record
from state.checkpoints.reported import ReportedCheckpoints
from state.checkpoints.transport import Location

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ray_train_resume_job.py"
EPOCHS, NAME = 3, "fashion"
TRAIN_SAMPLES = 768  # the script's


def _cmdline(pid: int) -> str:
    try:
        return (pathlib.Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()]


def pids_with(text: str) -> list[int]:
    """PIDs of the processes whose command line contains ``text`` (this Ray instance's own temp dir)."""
    return [pid for pid in _pids() if text in _cmdline(pid)]


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root`` (from each process's parent in /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            stat = (pathlib.Path("/proc") / str(pid) / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = (pathlib.Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def job(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="/tmp/errt")  # short: Ray's socket paths must fit in 107 bytes
    paths = {"storage": str(tmp_path / "storage"), "progress": tmp_path / "progress", "ray": ray_dir}
    yield paths
    leftover = pids_with(ray_dir)  # whatever this test's Rays left behind (both runs' dirs start so), by PID
    kill(leftover)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in leftover) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in (ray_dir, ray_dir + "b"):  # the two runs' Ray session files
        if os.path.isdir(path):
            shutil.rmtree(path)


def command(paths, ray_dir: str) -> list[str]:
    return [sys.executable, str(SCRIPT), paths["storage"], NAME, str(paths["progress"]), ray_dir, str(EPOCHS)]


def progress(path: pathlib.Path) -> list[tuple[int, int]]:
    """(epoch, position) of each of rank 0's step reports so far."""
    if not path.exists():
        return []
    return [(int(e), int(p)) for e, p in (line.split() for line in path.read_text().splitlines() if line.strip())]


def wait_until(what: str, check, proc: subprocess.Popen, log: pathlib.Path, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the script exited ({proc.returncode}) before {what}: {log.read_text()[-6000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not happen within {timeout_s} s")


@pytest.mark.slow  # ~40 s on 2 cores: two local Ray starts and two runs of the script
def test_ray_train_port_resumes_from_get_checkpoint_after_the_whole_cluster_is_sigkilled(job):
    location = os.path.join(job["storage"], NAME)
    manifest = pathlib.Path(location, "reported", "ckpt-000000000001", "MANIFEST.json")
    first_log = job["progress"].with_name("first-run.log")  # a file, not a pipe: a full pipe would block the driver
    with open(first_log, "w") as out:
        first = subprocess.Popen(command(job, job["ray"]), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until("epoch 0's reported checkpoint was durable", manifest.exists, first, first_log)
        # a few steps into epoch 1 (its ring is training; epoch 1 takes ~2.4 s of step delays alone)
        wait_until("epoch 1 was in progress",
                   lambda: any(e == 1 and p >= TRAIN_SAMPLES // 4 for e, p in progress(job["progress"])), first, first_log)
        doomed = sorted(set([first.pid] + descendants(first.pid) + pids_with(job["ray"])))  # driver, GCS, raylet...
        seen_before = {pid: _cmdline(pid) for pid in doomed}
        kill(doomed)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            kill([first.pid])
            first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in doomed if alive(pid)], "every process of the first run's Ray is gone"
    kinds = [c.split("\0")[0] for c in seen_before.values()]
    print(f"killed {len(doomed)} processes: {sorted(set(os.path.basename(k) for k in kinds))}")
    assert any(k.endswith("gcs_server") for k in kinds) and any(k.endswith("raylet") for k in kinds), kinds
    assert sum(k.startswith("ray::") for k in kinds) >= 1, kinds  # the worker actors' processes among them
    assert not [pid for pid in pids_with(job["ray"]) if alive(pid)]

    killed_at = progress(job["progress"])[-1]
    assert killed_at[0] == 1 and 0 < killed_at[1] < TRAIN_SAMPLES, killed_at  # mid-epoch 1
    reported = ReportedCheckpoints(location)
    assert reported.complete() == [1], reported.complete()  # epoch 0's only: epoch 1 never reported
    holder = read_record(Location(location))
    assert holder is not None and holder["pid"] == first.pid and not holder["released"], holder  # died holding it

    job["progress"].unlink()
    started = time.monotonic()
    second = subprocess.run(command(job, job["ray"] + "b"), cwd=ROOT, capture_output=True, text=True, timeout=240)
    wall = time.monotonic() - started
    line = [l for l in second.stdout.splitlines() if l.startswith("RESULT ")]
    assert second.returncode == 0 and line, second.stdout[-2000:] + second.stderr[-4000:]
    result = json.loads(line[0][len("RESULT "):])
    print(f"killed at epoch {killed_at[0]} position {killed_at[1]}; second run {wall:.1f} s, world {result['world']}, "
          f"{result['steps']} steps; lease {result['lease_log']}")

    # resumed from the newest reported checkpoint (epoch 0's): starts at epoch 1, trains epochs 1 and 2 only
    assert result["completed"] and result["resumed_epoch"] == 0 and result["epochs"] == EPOCHS, result
    assert result["step_epochs"] == [1, 2], result["step_epochs"]
    assert [r["epoch"] for r in result["epoch_reports"]] == [1, 2], result["epoch_reports"]
    assert result["seen"] == [float(EPOCHS)] * TRAIN_SAMPLES, "each sample once per epoch, across both runs"
    if result["world"] == 2 and "worker_joined" not in result["events"]:  # the usual case: 2 workers throughout
        assert result["steps"] == (EPOCHS - 1) * TRAIN_SAMPLES // (2 * 16), result["steps"]
    assert result["identical"]

    # Ray Train's Result: the last record, the last epoch's reported checkpoint, and load_checkpoint agree
    assert result["metrics"]["epoch"] == EPOCHS - 1
    assert result["metrics"]["accuracy"] == result["epoch_reports"][-1]["accuracy"]
    assert result["path"] == location
    assert reported.complete() == [1, 2, 3], reported.complete()  # epochs 1 and 2 reported by the second run
    assert result["checkpoint_path"] == os.path.join(location, "reported", "ckpt-000000000003", "files")
    assert result["loaded"]["epoch"] == EPOCHS - 1 and result["loaded"]["hits"] == result["seen"]

    # the lease: the OS released the killed driver's lock, so the second run took the location over at once
    log = result["lease_log"]
    takeover = [r for r in log if r["level"] == "WARNING" and "taking over" in r["message"]]
    assert takeover and f"pid {first.pid}" in takeover[0]["message"] and holder["run_id"] in takeover[0]["message"], log
    holding = [r for r in log if "holding the lease" in r["message"]]
    assert holding and f"generation {holder['generation'] + 1}," in holding[0]["message"], log
    assert LOCK_NAME in holding[0]["message"], log
    assert holding[0]["after_run_s"] < 2.0, log  # no TTL waited out (an object store's successor waits 15 s)
    after = read_record(Location(location))
    assert after["run_id"] != holder["run_id"] and after["generation"] == holder["generation"] + 1, after
    assert after["released"], after  # the second run released it at its end
