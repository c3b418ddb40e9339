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
