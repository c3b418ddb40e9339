"""Durable checkpoints through ElasticTrainer (real Ray): the run holds a lease on its location, so a second
live job there is refused within seconds; every write is an event; checkpoint_uri alone has a default cadence."""

import time

import pytest

from ray_integration import ElasticTrainer
from state import CheckpointError
from tests import ray_jobs
from tests.test_trainer_cluster import run_in_thread


@pytest.mark.slow  # ~11 s; the lease's refusal stays covered by tests/test_checkpoint_lease.py
def test_a_second_live_job_on_the_same_location_is_refused_within_seconds(ray_session, tmp_path):
    uri = str(tmp_path / "ckpt")
    first = ElasticTrainer(min_workers=1, max_workers=1, checkpoint_uri=uri, checkpoint_every_n_commits=2,
                           progress=False)
    thread, box = run_in_thread(first, {"epochs": 6, "step_delay_s": 0.05})
    deadline = time.monotonic() + 60
    while not list((tmp_path / "ckpt").glob("ckpt-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"{uri}.*job-[0-9a-f]{{8}}") as info:
        ElasticTrainer(min_workers=1, max_workers=1, checkpoint_uri=uri, progress=False).run(ray_jobs.train)
    assert time.monotonic() - started < 10, "the lease holder is seen renewing within its TTL"
    assert "is in use by run" in str(info.value) and "own checkpoint_uri" in str(info.value), info.value
    thread.join(120)
    assert "error" not in box, box.get("error")
    result = box["result"]
    written = [e for e in result.events if e.kind == "checkpoint_written"]
    assert written and result.checkpoint_uri == written[-1].detail["uri"], (written, result.checkpoint_uri)
    assert all(e.detail["worker"] and e.detail["seq"] >= 1 for e in written)


def test_checkpoint_uri_alone_uses_the_default_cadence(ray_session, tmp_path):
    trainer = ElasticTrainer(min_workers=1, max_workers=1, checkpoint_uri=str(tmp_path / "ckpt"), progress=False)
    assert trainer.config.checkpoint_cadence == (None, 300.0)
    result = trainer.run(ray_jobs.train, config={"epochs": 1})
    assert result.value["step"] > 0  # (a short job writes nothing before its first 300 s)
