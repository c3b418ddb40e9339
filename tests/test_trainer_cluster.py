"""ElasticTrainer on a multi-node Ray cluster (ray.cluster_utils.Cluster, one worker slot per node):
a whole node removed mid-run, a node added (the world grows back to max), and falling below
min_workers: back when capacity returns, a clear error when it does not."""

import pathlib
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_integration import ElasticTrainer, RunFailed
from tests import ray_jobs
from tests.conftest import ray_runtime_env


#: Ray declares a removed node dead after 3 missed 1 s health checks instead of the default 5 x 3 s.
#: Until then it may place a replacement actor on the dead node (measured: a replacement started
#: 12 s after a new node arrived with the defaults, at once with these settings).
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture
def cluster():
    if ray.is_initialized():
        ray.shutdown()  # leave the shared local instance; the next test restarts it
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "_system_config": FAST_NODE_DEATH})
    ray.init(address=c.address, runtime_env=ray_runtime_env(), log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def add_slot_node(cluster):
    return cluster.add_node(num_cpus=1, resources={"slot": 1})


def run_in_thread(trainer, config, fn=ray_jobs.train, **run_options):
    """``trainer.run(fn, config, **run_options)`` on a thread; its result or error lands in the returned box."""
    box = {}

    def target():
        try:
            box["result"] = trainer.run(fn, config=config, **run_options)
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for_step(progress: pathlib.Path, step: int, timeout_s: float = 60, world: int | None = None) -> tuple[int, int]:
    """Until rank 0 reports a step >= ``step`` (at world size ``world``, if given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if progress.exists():
            text = progress.read_text().split()
            if len(text) == 2 and int(text[0]) >= step and (world is None or int(text[1]) == world):
                return int(text[0]), int(text[1])
        time.sleep(0.05)
    raise TimeoutError(f"training did not reach step {step} (world {world}) within {timeout_s} s")


@pytest.mark.slow  # CI covers node removal and addition in tests/chaos (the fast storm)
def test_node_removed_then_node_added(cluster, tmp_path):
    nodes = [add_slot_node(cluster) for _ in range(3)]
    cluster.wait_for_nodes()
    progress = tmp_path / "progress"
    trainer = ElasticTrainer(min_workers=2, max_workers=3, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                             heartbeat_timeout_s=5, progress=False)
    thread, box = run_in_thread(trainer, {"epochs": 12, "step_delay_s": 0.1, "progress_file": str(progress)})
    wait_for_step(progress, 3)
    cluster.remove_node(nodes[2], allow_graceful=False)       # a whole node goes away
    wait_for_step(progress, 4, world=2)                        # the survivors train on
    add_slot_node(cluster)                                     # capacity returns
    thread.join(180)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    result = box["result"]
    kinds = [e.kind for e in result.events]
    assert "worker_lost" in kinds and "recovered" in kinds and "worker_joined" in kinds, kinds
    assert result.value["world"] == 3
    assert result.value["identical"] and result.value["seen"] == [12.0] * ray_jobs.N_SAMPLES


@pytest.mark.slow  # ~19 s; failing without capacity stays covered by tests/test_drain_decisions.py (its table)
def test_below_min_workers_waits_for_capacity_then_fails_clearly(cluster, tmp_path):
    nodes = [add_slot_node(cluster) for _ in range(2)]
    cluster.wait_for_nodes()
    progress = tmp_path / "progress"
    trainer = ElasticTrainer(min_workers=2, max_workers=2, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                             heartbeat_timeout_s=5, elastic_timeout_s=4, progress=False)
    thread, box = run_in_thread(trainer, {"epochs": 50, "step_delay_s": 0.05, "progress_file": str(progress)})
    wait_for_step(progress, 3)
    cluster.remove_node(nodes[1], allow_graceful=False)
    thread.join(120)
    assert not thread.is_alive()
    assert isinstance(box.get("error"), RunFailed)
    assert "below min_workers=2" in str(box["error"]) and "elastic_timeout_s=4" in str(box["error"])


@pytest.mark.slow  # ~24 s; nodes removed and added stay covered by tests/chaos/test_storm.py::test_fast_storm
def test_below_min_workers_and_back_when_a_node_arrives_in_time(cluster, tmp_path):
    nodes = [add_slot_node(cluster) for _ in range(2)]
    cluster.wait_for_nodes()
    progress = tmp_path / "progress"
    trainer = ElasticTrainer(min_workers=2, max_workers=2, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                             heartbeat_timeout_s=5, elastic_timeout_s=60, progress=False)
    thread, box = run_in_thread(trainer, {"epochs": 4, "step_delay_s": 0.05, "progress_file": str(progress)})
    wait_for_step(progress, 3)
    cluster.remove_node(nodes[1], allow_graceful=False)   # 1 worker left: below min_workers=2
    time.sleep(2)
    add_slot_node(cluster)                                 # capacity comes back within elastic_timeout_s
    thread.join(180)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    result = box["result"]
    kinds = [e.kind for e in result.events]
    assert "worker_lost" in kinds and "worker_joined" in kinds, kinds
    assert result.value["world"] == 2
    assert result.value["identical"] and result.value["seen"] == [4.0] * ray_jobs.N_SAMPLES


def drain(cluster, node, deadline_s: int) -> None:
    """What autoscaler v2 does on a preemption notice (and `ray drain-node --reason=...PREEMPTION`)."""
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(address=cluster.address)
    accepted, message = client.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                          "spot instance preempted (test)", int(time.time() * 1000) + deadline_s * 1000)
    assert accepted, message


@pytest.mark.slow  # ~16 s; a drained node's workers leaving stays covered by tests/test_spot_drains.py (the handover)
def test_draining_node_leaves_at_a_commit_without_rollback(cluster, tmp_path):
    nodes = [add_slot_node(cluster) for _ in range(3)]
    cluster.wait_for_nodes()
    progress = tmp_path / "progress"
    trainer = ElasticTrainer(min_workers=2, max_workers=3, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                             progress=False)
    thread, box = run_in_thread(trainer, {"epochs": 6, "step_delay_s": 0.05, "progress_file": str(progress)})
    wait_for_step(progress, 3)
    drain(cluster, nodes[2], deadline_s=20)
    _, world = wait_for_step(progress, 40)
    assert world == 2
    cluster.remove_node(nodes[2], allow_graceful=False)   # the node goes at its deadline
    thread.join(120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    result = box["result"]
    kinds = [e.kind for e in result.events]
    assert "node_draining" in kinds and "resized" in kinds, kinds
    assert "worker_lost" not in kinds and "recovered" not in kinds, kinds   # nobody failed: zero rollback
    assert result.value["identical"] and result.value["seen"] == [6.0] * ray_jobs.N_SAMPLES


@pytest.mark.slow  # ~22 s; a drain below min_workers writing first stays covered by tests/test_reclaim_ray.py (short notice)
def test_drain_below_min_workers_persists_a_checkpoint_first(cluster, tmp_path):
    nodes = [add_slot_node(cluster) for _ in range(2)]
    cluster.wait_for_nodes()
    progress, ckpt = tmp_path / "progress", str(tmp_path / "ckpt")
    trainer = ElasticTrainer(min_workers=2, max_workers=2, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                             checkpoint_uri=ckpt, checkpoint_every_n_commits=1000, elastic_timeout_s=3, progress=False)
    thread, box = run_in_thread(trainer, {"epochs": 50, "step_delay_s": 0.05, "progress_file": str(progress)})
    step, _ = wait_for_step(progress, 5)
    drain(cluster, nodes[1], deadline_s=10)  # the ring trains on through the notice until its final write
    thread.join(120)
    assert not thread.is_alive()
    assert isinstance(box.get("error"), RunFailed) and "below min_workers=2" in str(box["error"])
    from state.checkpoints.store import CheckpointStore

    saved, info = CheckpointStore(ckpt).load_latest()
    assert saved["step"] >= step   # the drain commit was written durably before the ring shrank
