"""Heartbeats aggregated per node on a real local Ray instance (``ElasticTrainer(heartbeats="node")``): three workers
on one node, one of which forwards the node's heartbeats; SIGSTOPped or SIGKILLed, it alone is lost, its node-mates
are never declared silent, and the job recovers with the exact invariant."""

import glob
import os
import shutil
import tempfile
import time

import pytest

from ray_integration import ElasticTrainer
from tests import ray_jobs
from tests.test_trainer_ray import check_invariant


@pytest.mark.parametrize("kind", ["stop_forwarder",  # (~15 s each; a SIGKILLed leader is also covered without Ray,
                                  pytest.param("kill_forwarder", marks=pytest.mark.slow)])  # test_node_beats.py)
def test_the_node_survives_the_loss_of_its_forwarding_worker(ray_session, tmp_path, kind):
    note = tmp_path / "forwarder"
    started = time.monotonic()
    result = ElasticTrainer(min_workers=2, max_workers=3, heartbeats="node", heartbeat_timeout_s=3.0,
                            collective_timeout_s=30, progress=False).run(
        ray_jobs.train, config={"epochs": 2, "faults": [(1, -1, 8, kind)], "step_delay_s": 0.1,
                                "forwarder_file": str(note)})
    check_invariant(result, 2)
    forwarder = note.read_text()
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert [e.detail["worker"] for e in lost] == [forwarder], [e.detail for e in lost]  # it alone
    if kind == "stop_forwarder":
        assert "no heartbeat" in lost[0].detail["cause"], lost[0].detail
    kinds = [e.kind for e in result.events]
    assert "recovered" in kinds and "messages_lost" not in kinds, kinds  # nobody's heartbeats went missing
    assert time.monotonic() - started < 60
    # A SIGSTOPped forwarder holds the node's lock until Ray kills it, after its node-mates left: its directory
    # stays until the next job's worker on this host sweeps it an hour later (NodeBeats.LEFT_BEHIND_S); not here
    for left in glob.glob(os.path.join(tempfile.gettempdir(), f"elastic_ring-{os.getuid()}", "*", "*", f"{forwarder}.beat")):
        shutil.rmtree(os.path.dirname(os.path.dirname(left)), ignore_errors=True)
