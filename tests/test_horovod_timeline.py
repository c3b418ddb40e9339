"""``hvd.start_timeline(path)`` / ``hvd.stop_timeline()`` on a real gloo ring: rank 0 writes a Chrome-trace JSON
(array format) file of what ran between the calls, as it goes; a second start switches files; a SIGKILLed rank 0
leaves a loadable trace."""

from __future__ import annotations

import json
import pathlib
import time

import torch

from elastic_ring.core import timeline
import ray_integration.horovod as hvd


def _record(first: str, second: str):
    hvd.init()
    before = timeline.is_enabled()
    hvd.start_timeline(first, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.broadcast(torch.ones(2), root_rank=1)
    hvd.start_timeline(second)  # Horovod: resuming with a different file
    hvd.allgather(torch.ones(1))
    hvd.stop_timeline()
    stopped_us = time.time() * 1e6
    hvd.allreduce(torch.ones(3))  # after the stop: not recorded
    hvd.stop_timeline()  # a second stop does nothing
    errors = []
    for bad in (3, "/no/such/dir/t.json"):
        try:
            hvd.start_timeline(bad)
        except ValueError as exc:
            errors.append(str(exc)[:40])
    return before, timeline.is_enabled(), errors, stopped_us


def _events(path: pathlib.Path) -> list[dict]:
    body = json.loads(path.read_text())  # a stopped trace is plain JSON: Chrome's JSON Array Format
    assert isinstance(body, list)
    return [e for e in body if e.get("ph") != "M"]


def test_start_and_stop_timeline_write_rank_0s_collectives_as_a_chrome_trace(ring, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    results = ring.run(_record, str(first), str(second), world_size=2, timeout_s=60)
    for before, after, errors, _ in results:
        assert before is False and after is False  # turned on for the recording only
        assert len(errors) == 2
    one, two = _events(first), _events(second)
    names_one = {e["name"] for e in one if e.get("cat") == "collective"}
    names_two = {e["name"] for e in two if e.get("cat") == "collective"}
    assert any("allreduce" in n for n in names_one) and any("broadcast" in n for n in names_one), names_one
    assert not any("broadcast" in n for n in names_two) and any("allgather" in n for n in names_two), names_two
    assert two and max(e["ts"] for e in two) <= results[0][3]  # nothing after the stop
    assert all(e["args"]["rank"] == 0 for e in one + two if "rank" in e.get("args", {}))  # rank 0's file
    begins = [e for e in one if e["ph"] == "b"]
    assert begins and all(any(x["ph"] == "e" and x["id"] == b["id"] for x in one) for b in begins)


def _record_while_the_job_records(path: str):
    hvd.init()
    timeline.enable()  # as ElasticTrainer(timeline_path=...) does
    timeline.drain()
    try:
        hvd.start_timeline(path)
        hvd.allreduce(torch.ones(3), name="shared")
        hvd.stop_timeline()
        still_on = timeline.is_enabled()
        job_events, _ = timeline.drain()
    finally:
        timeline.disable()
    return still_on, sum(1 for e in job_events if e.get("cat") == "collective")


def test_the_jobs_own_timeline_keeps_every_event_while_hvd_records(ring, tmp_path):
    path = tmp_path / "shared.json"
    results = ring.run(_record_while_the_job_records, str(path), world_size=2, timeout_s=60)
    for still_on, collectives in results:
        assert still_on and collectives >= 2  # the job's buffer still got them (begin and end at least)
    recorded = [e for e in _events(path) if e.get("cat") == "collective"]
    assert len(recorded) == results[0][1]  # rank 0's file: the same collective events as its buffer


def _killed_while_recording(path: str):
    import os

    hvd.init()
    hvd.start_timeline(path)
    for i in range(5):
        hvd.allreduce(torch.ones(3), name=f"before_kill.{i}")
    if hvd.rank() == 0:
        time.sleep(1.5)  # longer than FLUSH_S: the writer thread has appended them
        os._exit(1)  # as a SIGKILL: no stop_timeline(), no cleanup
    return "done"


def test_a_killed_rank_0_leaves_the_events_recorded_before_its_last_moments(ring, tmp_path):
    path = tmp_path / "killed.json"
    results = ring.start(_killed_while_recording, str(path), world_size=2).results(timeout_s=60,
                                                                                  raise_errors=False)
    assert results[1] == "done"
    text = path.read_text()
    assert not text.rstrip().endswith("]")  # never stopped: the array's closing bracket is missing, as the
    body = json.loads(text + "\n]")        # format allows (viewers load it); closed here to read it
    begins = [e for e in body if e.get("cat") == "collective" and e.get("ph") == "b" and "allreduce" in e["name"]]
    assert len(begins) >= 5, body  # the five allreduces (and their checks), written before the kill
