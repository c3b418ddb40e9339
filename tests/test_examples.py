"""The examples run as documented (with fewer steps)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ring_quickstart_runs_and_learns():
    out = subprocess.run([sys.executable, "examples/ring_quickstart.py", "--world", "2", "--steps", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical parameters on every rank" in out.stdout
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 6 and losses[-1] < losses[0] / 2, losses


def test_ray_quickstart_runs_and_learns():
    out = subprocess.run([sys.executable, "examples/quickstart.py", "--workers", "2", "--epochs", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("first reported loss")][0]
    first, last = float(line.split()[3].rstrip(",")), float(line.split()[5])
    assert last < first / 2, line
    assert "event: ring_formed round=1 world=2" in out.stdout
