"""The examples run as documented (with fewer steps)."""

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: A Python warning printed by the warnings module ("path.py:12: UserWarning: ..."), wherever it
#: came from (a worker's lines arrive prefixed with "(RingWorker pid=...)").
PYTHON_WARNING = re.compile(r"\b[A-Z]\w*Warning\b")
#: A line that elastic_ring's loggers printed at WARNING or above (no handler configured: Python's
#: last-resort handler prints the bare message, which starts with the process's identity).
OUR_LOG_LINE = re.compile(r"(^|\)(\x1b\[0m)? )\[(rank \d+/\d+ round \d+|no ring)")


def own_warnings(stderr: str) -> list[str]:
    """The stderr lines that are Python warnings (an example must run without any) or warnings of
    elastic_ring's loggers. Ray's own log lines ("2026-01-01 12:00:00,000 WARNING worker.py:123 --
    ...") are allowed: they are Ray's to fix, and say nothing about our code."""
    return [line for line in stderr.splitlines() if PYTHON_WARNING.search(line) or OUR_LOG_LINE.search(line)]


def test_own_warnings_finds_worker_and_driver_warnings_only():
    stderr = "\n".join([
        "2026-11-22 12:27:44,486\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled",
        "2026-11-22 12:27:51,504\tINFO worker.py:2038 -- Started a local Ray instance.",
        "[elastic_ring round 1] step 5 epoch 0 loss 4.812 world 2",
        "\x1b[36m(RingWorker pid=29678)\x1b[0m /x/examples/quickstart.py:55: UserWarning: Converting a tensor",
        "/x/examples/digits.py:3: DeprecationWarning: old",
        "\x1b[36m(RingWorker pid=1)\x1b[0m [rank 0/2 round 1 step 5] commit_overdue: call state.commit()",
    ])
    assert [line.split("/x/examples/")[-1].split("] ")[-1] for line in own_warnings(stderr)] == [
        "quickstart.py:55: UserWarning: Converting a tensor", "digits.py:3: DeprecationWarning: old",
        "commit_overdue: call state.commit()"]


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
    assert own_warnings(out.stderr) == [], out.stderr[-3000:]


def _quickstart_losing_a_rank_at_its_last_loss_allreduce(host, port, job):
    import elastic_ring as er
    from elastic_ring.core import progress
    from examples import quickstart
    from tests.local_rendezvous import StoreRendezvous

    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=[2]))
    allreduce = er.allreduce

    def allreduce_or_die(tensor, *args, **kwargs):
        if er.rank() == 2 and progress.current().get("samples", 0) >= 2048:  # the epoch's last step is applied
            os.kill(os.getpid(), signal.SIGKILL)
        return allreduce(tensor, *args, **kwargs)

    er.allreduce = allreduce_or_die
    try:
        return quickstart.train({"lr": 0.05, "epochs": 1})
    finally:
        er.allreduce = allreduce


def test_quickstart_survivors_with_nothing_left_to_train_return_the_last_logged_loss(ring):
    """A rank dies at the loss allreduce of the very last step: the survivors re-enter the loop with the
    epoch done, train nothing, and still return a result (the last logged loss, kept in the state)."""
    job = f"qs-{uuid.uuid4().hex[:6]}"
    results = ring.start(_quickstart_losing_a_rank_at_its_last_loss_allreduce, "127.0.0.1", ring.address.port,
                         job).results(timeout_s=120, raise_errors=False)
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == 2, results
    for value in survivors:
        assert value["steps"] == survivors[0]["steps"] > 0 and math.isfinite(value["final_loss"]), survivors


@pytest.mark.slow  # ~12 s: keeps the default suite under CI's 15 minutes; the quickstart runs by default
def test_digits_reaches_the_stated_accuracy():
    out = subprocess.run([sys.executable, "examples/digits.py", "--workers", "2", "--epochs", "12"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("test accuracy")][0]
    assert float(line.split()[2]) >= 0.95 and "target reached" in out.stdout, line


@pytest.mark.slow  # ~56 s (a multi-node cluster and a plot); the other examples run in the default suite
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


@pytest.mark.slow  # ~13 s: keeps the default suite under CI's 15 minutes
def test_tensorboard_example_streams_metrics_and_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "runs"
    # two workers from the start (with min_workers=1 a slow second worker would join later)
    out = subprocess.run([sys.executable, "examples/tensorboard_metrics.py", "--workers", "2", "--min-workers", "2",
                          "--epochs", "1", "--logdir", str(logdir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert own_warnings(out.stderr) == [], out.stderr[-3000:]
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    loss = events.Scalars("metrics/loss")
    # 2048 samples, batch 32 per rank, 2 ranks: 32 steps; the quickstart reports every step
    assert [s.step for s in loss] == list(range(1, 33)), loss
    assert loss[-1].value < loss[0].value / 2, [s.value for s in loss]
    assert {s.value for s in events.Scalars("membership/world_size")} == {2.0}
    assert [s.value for s in events.Scalars("membership/ring_formed")] == [1.0]
    assert [s.value for s in events.Scalars("membership/finished")] == [1.0]
    texts = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("events/text_summary")]
    assert texts[0].startswith("`ring_formed` round 1, world 2: reason=start") and "`finished`" in texts[-1], texts
    assert f"wrote 32 metric values and 2 events to {logdir}" in out.stdout
