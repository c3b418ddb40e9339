"""The drop-in ``TorchTrainer`` under a preemption notice of every worker's node, no spare capacity (a review of
issue 32 found it re-forming about ten times a second, re-entering the function hundreds of times, then reporting
the run as completed although the function never returned).

A Ray Train script's state is the checkpoints it reports, so the drop-in does no just-in-time write
(``write_on_notice=False``, set by ``translate_dropin``): the ring trains on until the leavers must go, they go, and
once capacity returns the function is entered again from the newest reported checkpoint."""

from __future__ import annotations

import functools
import os
import tempfile
import time

import pytest

from ray_integration import ElasticTrainer
from ray_integration.train import _dropin
from ray_integration.train._config import translate_dropin
from ray_integration.train.torch._trainer import _worker
from tests.test_trainer_cluster import cluster, drain, run_in_thread  # noqa: F401  (the fixture)


def reporting_fn(config):
    """Reports every step, a checkpoint every 5th; counts its entries; returns its step once told to stop."""
    from ray.train import Checkpoint

    import ray_integration.train as train

    with open(os.path.join(config["dir"], "entries"), "a") as f:
        f.write("x\n")
    checkpoint, step = train.get_checkpoint(), 0
    if checkpoint is not None:
        with open(os.path.join(checkpoint.path, "step")) as f:
            step = int(f.read())
    while not os.path.exists(os.path.join(config["dir"], "stop")):
        time.sleep(0.05)
        step += 1
        if step % 5 == 0:
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "step"), "w") as f:
                    f.write(str(step))
                train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report({"step": step})
    return step


def test_translate_dropin_turns_the_just_in_time_write_off():
    assert translate_dropin()[0]["write_on_notice"] is False
    with pytest.raises(ValueError, match="write_on_notice=1 must be True or False"):
        ElasticTrainer(write_on_notice=1)


@pytest.mark.slow  # ~45 s of a real cluster
def test_a_notice_on_every_node_without_spare_capacity_resumes_from_the_newest_report(cluster, tmp_path):  # noqa: F811
    node = cluster.add_node(num_cpus=2, resources={"slot": 2})
    cluster.wait_for_nodes()
    events: list = []
    options = {**translate_dropin()[0], "checkpoint_uri": str(tmp_path / "run")}
    options.update(min_workers=1, max_workers=2, start_workers=2, resources_per_worker={"slot": 1},
                   cpus_per_worker=1, elastic_timeout_s=60, progress=False)
    trainer = ElasticTrainer(**options)
    fn = functools.partial(_worker, reporting_fn, _dropin.Options(True, 0, 2))
    thread, box = run_in_thread(trainer, {"dir": str(tmp_path)}, fn=fn, on_event=events.append)
    started = time.monotonic()
    while not any(e.kind == "reported_checkpoint_written" for e in events) and time.monotonic() - started < 90:
        time.sleep(0.1)
    before = len(events)
    drain(cluster, node, deadline_s=12)
    time.sleep(11)
    during = [e.kind for e in events[before:]]
    assert "persist_requested" not in during, during          # no write the drop-in cannot answer is asked
    assert during.count("ring_formed") <= 2, during             # no re-form storm
    assert thread.is_alive() and "result" not in box, box       # not "completed": the function never returned
    cluster.remove_node(node, allow_graceful=False)
    cluster.add_node(num_cpus=2, resources={"slot": 2})         # capacity returns after the deadline
    entries = (tmp_path / "entries").read_text().count("x")
    while (tmp_path / "entries").read_text().count("x") == entries and time.monotonic() - started < 150:
        time.sleep(0.2)                                         # entered again, from the newest reported checkpoint
    time.sleep(2)
    (tmp_path / "stop").touch()
    thread.join(90)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    result = box["result"]
    assert result.completed and isinstance(result.value, int) and result.value >= 5
    assert (tmp_path / "entries").read_text().count("x") <= 8   # the first entries, the resume: not hundreds
