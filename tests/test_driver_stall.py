"""The driver's own process stalls (SIGSTOP for longer than heartbeat_timeout_s, then SIGCONT: a GC pause,
a starved head node). Its workers kept training and heartbeating meanwhile; their silence was the driver's.
No healthy worker is killed, and the job ends exact."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "stall_job.py"


def test_a_stalled_driver_kills_no_healthy_worker(tmp_path):
    progress = tmp_path / "progress"
    ray_dir = tempfile.mkdtemp(prefix="/tmp/ers")  # short: Ray's socket paths must fit in 107 bytes
    config = {"epochs": 10, "step_delay_s": 0.1, "progress_file": str(progress)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), ray_dir, json.dumps(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and step_of(progress) < 3:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGSTOP)   # 8 s: more than two heartbeat timeouts (3 s) of the driver's silence
        stalled_at = step_of(progress)
        time.sleep(8)
        assert step_of(progress) > stalled_at, "the workers kept training while the driver stalled"
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert proc.returncode == 0, out[-3000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert line, out[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    kinds = [e["kind"] for e in result["events"]]
    assert "driver_stalled" in kinds, kinds
    assert "worker_lost" not in kinds and "recovered" not in kinds, result["events"]
    assert result["value"]["identical"] and result["value"]["seen"] == [10.0] * 48


def step_of(progress: pathlib.Path) -> int:
    """Rank 0's last step (0 before the first)."""
    text = progress.read_text().split() if progress.exists() else []
    return int(text[0]) if len(text) == 2 else 0
