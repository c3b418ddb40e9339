"""Horovod scripts with only their import changed: the ``hvd`` compatibility module on real gloo rings, and
the launcher running Horovod's elastic MNIST example (module-level code) on real Ray workers under a SIGKILL."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import elastic_ring as er

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "horovod_unmodified_mnist.py"


def _hvd_calls():
    import ray_integration.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([float(r + 1)])
    out = {
        "average": hvd.allreduce(t).item(),
        "sum": hvd.allreduce(t, average=False).item(),
        "op": hvd.allreduce(t, op=hvd.Max).item(),
        "scaled": hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).item(),
        "grouped": [x.item() for x in hvd.grouped_allreduce([t, t * 10], op=hvd.Sum)],
        "gather": hvd.allgather(torch.tensor([r] * (r + 1))).tolist(),
        "bcast": hvd.broadcast(torch.tensor([r]), 1).item(),
        "object": hvd.broadcast_object({"from": r}, root_rank=1),
        "objects": hvd.allgather_object(r),
        "cross": (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()),
        "built": (hvd.gloo_built(), hvd.mpi_built(), hvd.nccl_built() >= 0),
    }
    inplace = t.clone()
    hvd.allreduce_(inplace, op=hvd.Sum, postscale_factor=2.0)
    out["inplace"] = inplace.item()
    handle = hvd.allreduce_async_(t.clone(), average=False)
    out["async"] = (isinstance(hvd.poll(handle), bool), hvd.synchronize(handle).item())
    out["reducescatter"] = hvd.reducescatter(torch.ones(n, 2) * (r + 1), op=hvd.Sum).tolist()
    out["alltoall"] = hvd.alltoall(torch.tensor([10 * r + j for j in range(n)])).tolist()
    errors = []
    for call in (lambda: hvd.allreduce(t, average=True, op=hvd.Sum),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
                                                  op=hvd.Adasum),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
                                                  num_groups=2),
                 lambda: hvd.allreduce(t, process_set=hvd.ProcessSet)):
        try:
            call()
        except (ValueError, NotImplementedError) as exc:
            errors.append(type(exc).__name__ + ": " + str(exc)[:60])
    out["errors"] = errors
    try:
        hvd.allreduce(torch.ones(r + 1), name="uneven")
    except RuntimeError as exc:  # a Horovod script's except clause
        out["mismatch"] = "uneven" in str(exc)
    hvd.barrier()
    return out


def test_the_hvd_module_keeps_horovods_calls_and_semantics(ring):
    # ranks 0 and 2 on node n0, rank 1 on n1: local ranks 0, 0, 1; cross ranks 0, 1, 0
    results = ring.run(_hvd_calls, node_ids=("n0", "n1", "n0"))
    for r, out in enumerate(results):
        assert out["average"] == 2.0 and out["sum"] == 6.0 and out["op"] == 3.0
        assert out["scaled"] == 6.0             # 0.5 * sum(2 * (r + 1))
        assert out["grouped"] == [6.0, 60.0]
        assert out["gather"] == [0, 1, 1, 2, 2, 2]
        assert out["bcast"] == 1 and out["object"] == {"from": 1} and out["objects"] == [0, 1, 2]
        assert out["inplace"] == 12.0
        assert out["async"] == (True, 6.0)
        assert out["reducescatter"] == [[6.0, 6.0]] and out["alltoall"] == [10 * j + r for j in range(3)]
        assert out["cross"] == [(0, 2, 0, 2, False), (0, 1, 1, 2, False), (1, 2, 0, 1, False)][r]
        assert out["built"] == (True, False, True)
        assert [e.split(":")[0] for e in out["errors"]] == ["ValueError", "NotImplementedError",
                                                            "NotImplementedError", "ValueError"]
        assert "process_set=" in out["errors"][3]  # the class, not an instance: process sets are real
        assert "supersedes average" in out["errors"][0] and "Adasum" in out["errors"][1]
        assert out["mismatch"] is True


def test_hvd_init_without_a_ring_names_the_launcher():
    import ray_integration.horovod as hvd

    if er.is_initialized():
        pytest.skip("this process holds a ring")
    with pytest.raises(er.NotInitializedError, match="python -m ray_integration.launch"):
        hvd.init()


def test_the_launcher_checks_its_arguments_before_starting_anything(tmp_path):
    from ray_integration.launch import parse

    with pytest.raises(SystemExit):
        parse(["-np", "2", "--max-workers", "3", str(SCRIPT)])
    with pytest.raises(SystemExit):
        parse([str(tmp_path / "missing.py")])
    args = parse(["-np", "2", str(SCRIPT), "--epochs", "3", "--lr", "0.1"])
    assert (args.min_workers, args.max_workers, args.args) == (2, 2, ["--epochs", "3", "--lr", "0.1"])
    args = parse(["--max-workers", "4", str(SCRIPT)])
    assert (args.min_workers, args.max_workers, args.worker_errors) == (1, 4, "replace")  # Horovod's elastic mode
    assert parse(["--worker-errors", "fail", str(SCRIPT)]).worker_errors == "fail"
    with pytest.raises(SystemExit):
        parse(["--worker-errors", "retry", str(SCRIPT)])


def test_horovods_elastic_mnist_with_only_its_import_changed_survives_a_sigkill(tmp_path):
    marker = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray_integration.launch", "--min-workers", "1", "--max-workers", "2", "--num-cpus", "4",
         str(SCRIPT), "--epochs", "3", "--lr", "0.05", "--batch-size", "32", "--kill-rank", "1",
         "--kill-marker", str(marker)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the trainer stops and its private Ray instance goes with it
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the launcher did not finish within 240 s\n{stdout[-2000:]}\n{stderr[-4000:]}")
    assert proc.returncode == 0, (stdout[-2000:], stderr[-4000:])
    assert marker.exists()  # rank 1 was SIGKILLed once, mid-epoch
    assert "Test set: Average loss" in stdout, stdout[-3000:]
    accuracy = float(stdout.split("Accuracy: ")[-1].split("%")[0])
    assert accuracy > 50.0, stdout[-3000:]  # it learned (chance: 10 %); 74 % after these 3 short epochs
    summary = [line for line in stderr.splitlines() if line.startswith("launch: finished")]
    # the survivor re-formed and went on (a replacement may join too, if it starts before the short job ends)
    assert summary and "1 workers lost" in summary[0] and "1 recoveries" in summary[0], stderr[-3000:]
