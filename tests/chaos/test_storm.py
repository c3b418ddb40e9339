"""The chaos suite: a seeded storm of failures and membership changes on a local multi-node
cluster, after which the model must equal its closed-form value exactly on every rank.

CI runs a fast storm (4 spot events: a drain of every holder, a death during a formation, a storage blip, a
driver stall); ``python -m pytest -m slow tests/chaos`` runs a classic one (3 events), the reclaim storm (a
reclaim wave: a loss, then a notice on every node while the ring re-forms; and a notice on every node with no
spare capacity, whose nodes go at the deadline) and the long storms (15 events: every kind once, every worker's
clock 15 s off). Commits happen only at epoch ends; every re-form must redo at most the step in flight, and the
ring that resumes after a notice without spare capacity redoes nothing (its state was written just in time).
"""

import contextlib
import errno
import pathlib
import subprocess
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_integration import ElasticTrainer
from tests.chaos import invariant_job, storm
from tests.conftest import ray_runtime_env
from tests.test_trainer_cluster import FAST_NODE_DEATH, drain, run_in_thread


@pytest.fixture
def slot_cluster():
    if ray.is_initialized():
        ray.shutdown()  # leave the shared local instance; the next test restarts it
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "_system_config": FAST_NODE_DEATH})
    nodes = [c.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(storm.MAX_WORKERS)]
    c.wait_for_nodes()
    ray.init(address=c.address, runtime_env=ray_runtime_env(), log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


@pytest.mark.parametrize("seed,count", [(7, 3)])
def test_schedule_is_a_pure_function_of_the_seed(seed, count):
    assert storm.schedule(seed, count) == storm.schedule(seed, count)


@pytest.mark.parametrize("lines, expected", [
    ([(1, 1), (1, 2), (2, 3)], {2: 0}),                          # nothing redone
    ([(1, 1), (1, 2), (1, 3), (2, 3)], {2: 1}),                   # the step in flight on the survivors
    ([(1, 5), (1, 6), (2, 5), (2, 6), (2, 7), (3, 8)], {2: 2, 3: 0}),  # a rollback of two steps, then none
])
def test_steps_redone(lines, expected):
    assert storm.steps_redone(lines) == expected


def test_the_fast_storms_keep_their_schedules():
    assert [e.kind for e in storm.schedule(405, 4, kinds=storm.CLASSIC_KINDS)] == [
        "drain_all", "kill_in_formation", "storage_blip", "driver_stall"]
    assert [e.kind for e in storm.schedule(607, 3, kinds=storm.CLASSIC_KINDS)] == [
        "kill_in_sync", "node_removed", "node_added"]


@pytest.mark.parametrize("lines, expected", [
    # noticed at 100, the nodes went at 112: trained until 109.5; the ring that resumed began at step 21
    ([(1, 10, 99.0), (1, 11, 101.0), (1, 20, 109.5), (3, 21, 130.0), (3, 22, 130.1)], {"trained_s": 9.5, "redone": 0}),
    ([(1, 11, 101.0), (1, 20, 109.5), (3, 19, 130.0), (3, 20, 130.1)], {"trained_s": 9.5, "redone": 2}),
    ([(1, 10, 99.0)], {"trained_s": 0.0, "redone": None}),       # nothing after it (yet)
])
def test_notice_outcomes(lines, expected):
    assert storm.notice_outcomes([(100.0, 112.0)], lines) == [expected]


def test_schedule_keeps_capacity_and_covers_every_kind():
    for seed in range(20):
        events = storm.schedule(seed, len(storm.ALL_KINDS))
        assert {e.kind for e in events} == set(storm.ALL_KINDS), seed
        capacity = storm.MAX_WORKERS
        for e in events:
            capacity += {"node_removed": -1, "node_drained": -1, "node_added": 1}.get(e.kind, 0)
            assert storm.MIN_CAPACITY <= capacity <= storm.MAX_WORKERS
            assert e.rank != e.helper_rank and (e.kind != "kill_in_sync" or e.rank == 0)


@contextlib.contextmanager
def small_file_system(path: pathlib.Path, size_mb: int = 16):
    """A real file system of ``size_mb`` at ``path`` (a tmpfs mount; the suite runs as root in its sandbox),
    and ``blip(seconds)``: fill it to ENOSPC, wait, free it."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:  # (CI and this sandbox run as root; elsewhere the storage blip cannot be made)
        pytest.skip(f"a storage blip needs a real small file system: mount failed: {mounted.stderr.strip()}")

    def blip(seconds: float) -> None:
        ballast = path / "ballast"
        with open(ballast, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        time.sleep(seconds)
        ballast.unlink()

    try:
        yield blip
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def run_storm(slot_cluster, tmp_path, seed: int, count: int, time_bound_s: float, clock_skew_s: float = 0.0,
              kinds: tuple[str, ...] = storm.ALL_KINDS, events: list | None = None):
    events = events if events is not None else storm.schedule(seed, count, kinds=kinds)
    if any(e.kind == "storage_blip" for e in events):
        with small_file_system(tmp_path / "ckpt") as blip:
            return _run_storm(slot_cluster, tmp_path, events, seed, time_bound_s, clock_skew_s, blip)
    return _run_storm(slot_cluster, tmp_path, events, seed, time_bound_s, clock_skew_s, None)


def _run_storm(slot_cluster, tmp_path, events, seed, time_bound_s, clock_skew_s, blip):
    cluster, nodes = slot_cluster
    controller = storm.StormController(cluster, nodes, str(tmp_path), drain, blip=blip)
    checkpoints = {}
    if blip or any(e.kind == "notice_no_spare" for e in events):  # (a notice with no spare capacity needs a location)
        checkpoints = dict(checkpoint_uri=str(tmp_path / "ckpt"), checkpoint_every_n_commits=1 if blip else 1000)
    trainer = ElasticTrainer(min_workers=2, max_workers=storm.MAX_WORKERS, resources_per_worker={"slot": 1},
                             cpus_per_worker=1, heartbeat_timeout_s=3, max_failures=50, progress=False, **checkpoints)
    started = time.monotonic()
    thread, box = run_in_thread(trainer, {"chaos_dir": str(tmp_path), "clock_skew_s": clock_skew_s},
                                fn=invariant_job.train, on_report=controller.on_report, on_event=controller.on_event)
    storm_error = None
    try:
        controller.run(events, thread.is_alive)
    except TimeoutError as exc:
        storm_error = exc
    finally:
        (tmp_path / "stop").touch()
        thread.join(120)
    elapsed = time.monotonic() - started
    assert not thread.is_alive() and "error" not in box, (box.get("error"), controller.log)
    result = box["result"]
    if storm_error is not None:
        pytest.fail(f"{storm_error}\nevents: " + "\n".join(f"{e.kind} r{e.round_id} w{e.world_size} {e.detail}"
                                                           for e in result.events))
    value, kinds = result.value, [e.kind for e in result.events]
    # the exact invariant, on every rank of the final ring
    assert value["exact"], (value["w"], invariant_job.expected_w(value["epochs"]).tolist(), controller.log)
    assert value["identical"] and value["seen"] == [float(value["epochs"])] * invariant_job.N_SAMPLES
    # every event is in the record
    assert kinds.count("worker_lost") == storm.expected_losses(events), (
        [f"r{e.round_id} {e.detail}" for e in result.events if e.kind == "worker_lost"], kinds, controller.log)
    assert kinds.count("node_draining") == controller.drained, kinds
    assert kinds.count("driver_stalled") >= sum(e.kind == "driver_stall" for e in events), kinds
    if any(e.kind == "storage_blip" for e in events):   # the blip is retried or an event, never the end of the run
        written = [e.detail for e in result.events if e.kind == "checkpoint_written"]
        assert written and (any(w.get("attempts", 1) > 1 for w in written) or "checkpoint_failed" in kinds), kinds
    assert kinds.count("worker_joined") >= sum(e.kind == "node_added" for e in events), kinds
    recoveries = [e.detail["seconds"] for e in result.events if e.kind == "recovered"]
    assert elapsed < time_bound_s, (elapsed, controller.log)
    # commits only at epoch ends, yet every failure loses at most the step in flight
    lines = storm.read_step_logs(str(tmp_path), with_time=True)
    redone = storm.steps_redone([(r, s) for r, s, _ in lines])
    assert redone and max(redone.values()) <= 1, (redone, controller.log)
    notices = storm.notice_outcomes(controller.notices, lines)
    assert all(n["redone"] == 0 for n in notices), (notices, controller.log)  # written just in time: nothing redone
    assert kinds.count("drain_released") >= len(notices), kinds
    print(f"storm seed={seed}: {len(events)} events {[e.kind for e in events]}, {kinds.count('worker_lost')} "
          f"workers lost, {len(recoveries)} recoveries, max recovery {max(recoveries, default=0):.3f} s, "
          f"{value['epochs']} epochs, invariant exact on {value['world']} ranks, {elapsed:.0f} s, "
          f"steps redone per re-form {sorted(redone.values())} (commits only at epoch ends)"
          + "".join(f"; a {storm.NOTICE_S} s notice without spare capacity: trained {n['trained_s']} s of it, "
                    f"{n['redone']} steps redone after the resume" for n in notices))
    return result


def test_fast_storm(slot_cluster, tmp_path):
    run_storm(slot_cluster, tmp_path, seed=607, count=3, time_bound_s=150,   # kill_in_sync, node_removed, node_added
              kinds=storm.CLASSIC_KINDS)


@pytest.mark.slow  # ~70 s; each of its events has its own default test (tests/test_spot_drains.py, test_compound.py,
# test_storage_faults.py, test_driver_stall.py), and test_fast_storm keeps a storm in the default suite
def test_fast_spot_storm(slot_cluster, tmp_path):
    # a drain of every holder, a death during a formation, a storage blip, a driver stall
    run_storm(slot_cluster, tmp_path, seed=405, count=4, time_bound_s=180, kinds=storm.CLASSIC_KINDS)


@pytest.mark.slow  # ~2 min
def test_reclaim_storm(slot_cluster, tmp_path):
    """A reclaim wave (a worker lost, then a notice on every node while the ring re-forms; fresh nodes come), then
    a notice on every node with no spare capacity (nodes removed at the deadline; capacity returns after it)."""
    events = [storm.StormEvent("reclaim_wave", rank=1, helper_rank=2, gap_steps=5),
              storm.StormEvent("notice_no_spare", rank=0, helper_rank=1, gap_steps=5)]
    run_storm(slot_cluster, tmp_path, seed=0, count=2, time_bound_s=300, events=events)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2])
def test_long_storm(slot_cluster, tmp_path, seed):
    # every kind once (the reclaim events too), with every worker's clock 15 s off (plus or minus): no healthy
    # worker may be lost to it
    run_storm(slot_cluster, tmp_path, seed=seed, count=len(storm.ALL_KINDS), time_bound_s=500, clock_skew_s=15.0)
