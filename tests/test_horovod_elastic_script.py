"""Horovod's own elastic integration script (tests/data/elastic_torch_main.py, only its import changed) through the
launcher on real Ray workers, run as Horovod's ``test/integration/elastic_common.py`` runs it, with the schedules
adapted to Ray workers (issue 33).

Horovod's tests start 4 slots on 2 hosts and make the worker of start rank 0 leave at (epoch 1, batch 0), by an
exception or a kill; Horovod blacklists that worker's whole host, so the 2 workers of the other host go on (log
lines: start_rank 0, size 4, rendezvous 1; then start_rank 2, size 2, rendezvous 2). On Ray the lost worker is
replaced instead: with a fixed size (``-np 4``, Horovod's ``test_fault_tolerance_without_scaling``; ``-np 2`` in
the default suite) the survivors
wait for the replacement, and the next rank 0 is the worker that started as rank 1 (start_rank 1, size 4,
rendezvous 2); elastic (``--min-workers 2 --max-workers 4``, ``test_single_rank_failure``) the survivors go on at
3 and the replacement joins later (size 3 at rendezvous 2, or 4 at rendezvous 3). When every worker raises
(``test_all_ranks_failure``) the run fails naming the error and the rank. Each script reads ``HOROVOD_RANK`` and
``HOROVOD_HOSTNAME`` right after ``hvd.init()`` at module level: the launch environment (without it every worker
believes it started as rank 0, and the schedule stops every worker). The launcher runs in this process on the
shared Ray instance (``ray_session``), so each run pays for its workers, not for a Ray start.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from ray_integration import launch

SCRIPT = pathlib.Path(__file__).resolve().parent / "data" / "elastic_torch_main.py"


def _run(tmp_path, capsys, launcher_args: list[str], exit_schedule: dict, exit_mode: str = "exception",
         epochs: int = 3) -> tuple[int, list[dict], str]:
    logfile = tmp_path / f"log-{exit_mode}.txt"
    schedule = {str(tuple(k)): v for k, v in exit_schedule.items()}
    code = launch.main([*launcher_args, str(SCRIPT), "--logfile", str(logfile),
                        "--epochs", str(epochs), "--exit-schedule", json.dumps(schedule), "--exit-mode", exit_mode])
    stderr = capsys.readouterr().err
    lines = [json.loads(line) for line in logfile.read_text().splitlines()] if logfile.exists() else []
    return code, lines, stderr


def _check_first_epoch(first: dict, size: int = 4) -> None:
    assert (first["start_rank"], first["rank"], first["size"], first["rendezvous"]) == (0, 0, size, 1), first
    assert isinstance(first["hostname"], str) and len(first["hostname"]) == 56, first  # a Ray node id (hex)


@pytest.mark.parametrize("workers, exit_mode", [
    (2, "exception"),  # the default suite's: 2 workers start faster than Horovod's 4 slots
    pytest.param(4, "exception", marks=pytest.mark.slow),  # ~30-70 s each on 2 loaded cores
    pytest.param(4, "kill", marks=pytest.mark.slow),
])
def test_fault_tolerance_without_scaling(ray_session, tmp_path, capsys, workers, exit_mode):
    code, lines, stderr = _run(tmp_path, capsys, ["-np", str(workers)], {(1, 0): [0]}, exit_mode)
    assert code == 0, stderr[-4000:]
    assert len(lines) == 3, (lines, stderr[-3000:])
    _check_first_epoch(lines[0], workers)
    for line in lines[1:]:  # the worker that started as rank 1 is rank 0 now; the replacement restored the size
        assert (line["start_rank"], line["rank"], line["size"], line["rendezvous"]) == (1, 0, workers, 2), lines
    assert "1 workers lost" in stderr and "1 recoveries" in stderr, stderr[-3000:]
    lost = [line for line in stderr.splitlines() if line.startswith("launch: lost")]
    assert len(lost) == 1, stderr[-3000:]
    if exit_mode == "exception":  # Horovod's elastic mode: a failed worker, replaced; the launcher names its error
        assert "fn raised on rank 0: RuntimeError: check_rank and exit epoch=1 batch=0 start_rank=0" in lost[0]


@pytest.mark.slow  # ~40 s: two more launcher runs
@pytest.mark.parametrize("exit_mode", ["exception", "kill"])
def test_single_rank_failure(ray_session, tmp_path, capsys, exit_mode):
    code, lines, stderr = _run(tmp_path, capsys, ["--min-workers", "2", "--max-workers", "4"], {(1, 0): [0]},
                               exit_mode)
    assert code == 0, stderr[-4000:]
    assert len(lines) == 3, (lines, stderr[-3000:])
    _check_first_epoch(lines[0])
    for line in lines[1:]:  # the survivors go on at 3; the replacement joins at a later commit (a new rendezvous)
        assert line["start_rank"] == 1 and line["rank"] == 0, lines
        assert (line["size"], line["rendezvous"]) in ((3, 2), (4, 3)), lines
    assert lines[1]["rendezvous"] <= lines[2]["rendezvous"], lines


@pytest.mark.slow  # ~20-30 s; the decision's table and the states (tests/test_worker_errors.py) cover it without Ray
def test_all_ranks_failure(ray_session, tmp_path, capsys):
    code, lines, stderr = _run(tmp_path, capsys, ["-np", "4"], {(1, 0): [0, 1, 2, 3]})
    assert code == 1, stderr[-4000:]
    assert [line["epoch"] for line in lines] == [0], lines  # epoch 0 finished; every worker raised in epoch 1
    failure = next(line for line in stderr.splitlines() if line.startswith("launch: the run failed"))
    assert "every worker of the ring failed (4 of 4" in failure, stderr[-4000:]
    assert "fn raised on rank 0" in stderr and "RuntimeError: check_rank and exit epoch=1 batch=0" in stderr, \
        stderr[-4000:]


@pytest.mark.slow  # ~10 s; the decision's table (tests/test_worker_errors.py) covers "fail" without Ray
def test_worker_errors_fail_ends_the_run_at_the_first_error(ray_session, tmp_path, capsys):
    code, lines, stderr = _run(tmp_path, capsys, ["-np", "2", "--worker-errors", "fail"], {(0, 3): [1]}, epochs=1)
    assert code == 1 and lines == [], (lines, stderr[-3000:])
    failure = next(line for line in stderr.splitlines() if line.startswith("launch: the run failed"))
    assert "WorkerError: fn raised on rank 1" in failure and "every worker" not in failure, stderr[-3000:]
    assert "RuntimeError: check_rank and exit epoch=0 batch=3 start_rank=1 rank=1" in stderr, stderr[-3000:]


def _launch_environment(_config: dict) -> dict:
    import elastic_ring as er

    before = any(k.startswith("HOROVOD_") for k in os.environ)  # nothing before the first ring is known
    rank = er.rank()  # joins the first ring: the variables are set by then
    first = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    return {"rank": rank, "size": er.size(), "env": first, "before": before}


def test_elastic_trainer_workers_get_horovods_launch_environment_at_their_first_ring(ray_session):
    from ray_integration import ElasticTrainer

    result = ElasticTrainer(min_workers=2, max_workers=2).run(_launch_environment_all, {})
    values = result.value
    assert sorted(v["rank"] for v in values) == [0, 1]
    for v in values:
        env = v["env"]
        assert v["before"] is False
        assert env["HOROVOD_RANK"] == str(v["rank"]) and env["HOROVOD_SIZE"] == "2", env
        assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == (str(v["rank"]), "2"), env
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("0", "1"), env
        assert len(env["HOROVOD_HOSTNAME"]) == 56 and env["HOROVOD_ELASTIC"] == "1", env
        assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo", env
        assert int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]) > 0 and env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], env


def _launch_environment_all(_config: dict) -> list:
    import elastic_ring as er

    mine = _launch_environment(_config)
    return er.allgather_object(mine)


def test_horovod_environment_follows_horovods_slot_rules():
    import elastic_ring as er
    from ray_integration.wire.launch_env import horovod_environment

    # 5 ranks on 3 nodes, contiguous per node: n0 holds 0-1, n1 holds 2-3, n2 holds 4
    nodes = ("n0", "n0", "n1", "n1", "n2")
    store = er.StoreAddress("10.0.0.5", 29500)
    expected = {0: ("0", "2", "0", "3"), 1: ("1", "2", "0", "2"), 2: ("0", "2", "1", "3"), 3: ("1", "2", "1", "2"),
                4: ("0", "1", "2", "3")}  # (local rank, local size, cross rank, cross size), as Horovod's SlotInfo
    for rank, (local_rank, local_size, cross_rank, cross_size) in expected.items():
        env = horovod_environment(er.RingSpec(round_id=7, rank=rank, world_size=5, node_ids=nodes, store=store))
        assert env == {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "5", "HOROVOD_LOCAL_RANK": local_rank,
            "HOROVOD_LOCAL_SIZE": local_size, "HOROVOD_CROSS_RANK": cross_rank, "HOROVOD_CROSS_SIZE": cross_size,
            "HOROVOD_HOSTNAME": nodes[rank], "HOROVOD_ELASTIC": "1", "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": "29500"}


def test_the_worker_rendezvous_hands_only_its_first_ring_to_the_launch_environment():
    import elastic_ring as er
    from ray_integration.wire.channel import Channel
    from ray_integration.wire.protocol import DRIVER, DriverKind, Keys
    from ray_integration.worker.mailbox import NOTICE_HANDLERS, Mailbox
    from ray_integration.worker.rendezvous import WorkerRendezvous
    import torch.distributed as dist

    secret = b"launch-env-test-secret-32-bytes!"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = er.StoreAddress("127.0.0.1", server.port)
    keys = Keys("job")
    client = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)  # noqa: E731
    driver = Channel(client(), secret, DRIVER)
    mailbox = Mailbox(Channel(client(), secret, "w1"), keys.worker_inbox("w1"), NOTICE_HANDLERS)
    mailbox.start()
    rendezvous = WorkerRendezvous(Channel(client(), secret, "w1"), mailbox, keys, "w1", secret, silence_s=10)
    seen = []
    rendezvous.on_first_ring = seen.append
    for generation, rank in ((1, 3), (2, 0)):  # a first ring as rank 3, then a re-form that makes it rank 0
        spec = er.RingSpec(round_id=generation, rank=rank, world_size=4, node_ids=("n",) * 4, store=address,
                           auth_key=secret)
        driver.send(keys.worker_inbox("w1"), DriverKind.RING, generation=generation, spec=spec.to_wire())
        assert rendezvous.next_ring("start" if generation == 1 else "failure").rank == rank
    assert [s.rank for s in seen] == [3]  # once, with the first ring's values
    mailbox.close()
