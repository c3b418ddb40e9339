"""The examples run as documented (with fewer steps)."""

import json
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


def test_digits_reaches_the_stated_accuracy():
    out = subprocess.run([sys.executable, "examples/digits.py", "--workers", "2", "--epochs", "12"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("test accuracy")][0]
    assert float(line.split()[2]) >= 0.95 and "target reached" in out.stdout, line


def test_elastic_demo_loses_a_worker_gains_a_node_and_draws_it(tmp_path):
    png, trace = tmp_path / "demo.png", tmp_path / "timeline.json"
    out = subprocess.run([sys.executable, "examples/elastic_demo.py", "--kill-at-step", "100", "--out", str(png),
                          "--timeline", str(trace)], cwd=ROOT, capture_output=True, text=True, timeout=175)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "world sizes: 2 -> 1 -> 2 -> 3" in out.stdout, out.stdout[-3000:]
    for kind in ("worker_lost", "recovered", "worker_joined", "resized"):
        assert f"event: {kind} " in out.stdout, kind
    assert "target reached" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"allreduce", "pack", "commit", "sync", "reform", "worker_lost", "worker_joined"} <= names
