"""Ray Data input throughput: our exactly-once shard vs a plain Ray Train run, measured in the same run.

The same dataset (``--rows`` rows of ``x`` (64 float32) and ``y``, in ``--blocks`` blocks, built by
``ray.data.range(...).map_batches(...)`` and materialized once) and the same MLP, trained by
``--workers`` CPU workers for ``--epochs`` epochs with ``--batch`` rows per worker and step:

  ours, dataset order   ElasticTrainer(datasets={"train": ds}), get_dataset_shard("train", shuffle=False),
                        shard.iter_torch_batches(batch_size=B), er.DistributedOptimizer, TorchState
  ours, shuffled        the same with the default per-epoch order (blocks shuffled, rows within each)
  Ray Train             TorchTrainer(datasets={"train": ds}), ray.train.get_dataset_shard("train")
                        .iter_torch_batches(batch_size=B), prepare_model (DDP), dataset order

Each run reports the ring's training throughput (rows of all ranks / the slowest rank's time) over the
epochs after the first (the first warms up: process start, imports, the first block reads). The
configurations alternate run by run; each run is printed as measured, the medians and the ratios to Ray
Train last (a run that fails prints the medians of the runs before it, then the failure, and exits 1).

    python -m benchmarks.ray_data [--runs 3] [--workers 2] [--rows 65536] [--blocks 16] [--batch 128] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
DIM = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def _features(batch: dict) -> dict:
    import numpy as np

    ids = batch["id"]
    rng = np.random.default_rng(int(ids[0]) if len(ids) else 0)
    return {"x": rng.standard_normal((len(ids), DIM)).astype(np.float32),
            "y": rng.standard_normal((len(ids), 1)).astype(np.float32)}


def _epoch(batches, model, optimizer) -> tuple[int, float]:
    """Train one epoch over ``batches``: (rows, seconds)."""
    rows, started = 0, time.perf_counter()
    for batch in batches:
        x, y = batch["x"], batch["y"]
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean() if len(x) else x.new_zeros(()) + 0 * sum(p.sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        rows += len(x)
    return rows, time.perf_counter() - started


def ours(config: dict) -> list[float]:
    import elastic_ring as er
    from ray_integration import data
    from state import TorchState

    torch.set_num_threads(1)
    model = _model()
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    shard = data.get_dataset_shard("train", shuffle=config["shuffle"], batch_size=config["batch"])
    state = TorchState(model=model, optimizer=optimizer, sampler=shard, epoch=0)
    rates: list[float] = []

    @er.elastic.run
    def loop(state):
        while state.epoch < config["epochs"]:
            rows, seconds = _epoch(shard.iter_torch_batches(batch_size=config["batch"]), model, optimizer)
            total = er.allreduce(torch.tensor([float(rows)]), op=er.Sum, name="rows").item()
            slowest = er.allreduce(torch.tensor([seconds]), op=er.Max, name="seconds").item()
            rates.append(total / slowest)
            state.epoch += 1
            shard.set_epoch(state.epoch)
            state.commit()
        return rates

    return loop(state)


def ray_train(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = ray.train.torch.prepare_model(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = ray.train.get_dataset_shard("train")
    rates = []
    for _ in range(config["epochs"]):
        rows, seconds = _epoch(shard.iter_torch_batches(batch_size=config["batch"]), model, optimizer)
        total, slowest = torch.tensor([float(rows)]), torch.tensor([seconds])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rates.append(total.item() / slowest.item())
    if ray.train.get_context().get_world_rank() == 0:  # (Ray Train v2's result has no metrics without a checkpoint)
        pathlib.Path(config["out"]).write_text(json.dumps(rates))
    ray.train.report({"epochs": len(rates)})


def measure_ours(ds, args, shuffle: bool) -> float:
    from ray_integration import ElasticTrainer

    config = {"epochs": args.epochs, "batch": args.batch, "shuffle": shuffle}
    result = ElasticTrainer(min_workers=args.workers, max_workers=args.workers, progress=False,
                            datasets={"train": ds}).run(ours, config)
    return statistics.median(result.value[1:])


def measure_ray_train(ds, args, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = pathlib.Path(storage) / f"rates-{time.time_ns()}.json"
    TorchTrainer(ray_train, train_loop_config={"epochs": args.epochs, "batch": args.batch, "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
                 run_config=RunConfig(storage_path=storage, name=out.stem), datasets={"train": ds}).fit()
    return statistics.median(json.loads(out.read_text())[1:])


def check_ready(parser: argparse.ArgumentParser, args) -> None:
    """Fail before running anything when something the benchmark needs is missing."""
    from benchmarks._needs import INSTALL, require

    for module, why in (("ray.data", "the dataset and both readers"), ("ray.train.torch", "the Ray Train baseline"),
                        ("ray_integration.data", "our shard")):
        require(module, benchmark="ray_data", why=why, install=INSTALL["ray.train"].replace("train", "train,data"))
    if args.epochs < 2:
        parser.exit(2, f"ray_data: --epochs {args.epochs}: the first epoch is a warm-up; give at least 2\n")
    if args.rows < args.workers * args.batch:
        parser.exit(2, f"ray_data: --rows {args.rows} is less than one step (--workers x --batch = "
                       f"{args.workers * args.batch})\n")


def summary(results: dict[str, list[float]]) -> None:
    """The medians of what was measured, as ratios to Ray Train's when it was measured."""
    theirs = statistics.median(results["Ray Train"]) if results.get("Ray Train") else None
    for name, rates in results.items():
        if not rates:
            continue
        median = statistics.median(rates)
        ratio = f"{median / theirs:.2f}x Ray Train" if theirs else "Ray Train not measured"
        print(f"{name:<22} median {median:10.0f} rows/s  ({ratio})  runs {', '.join(f'{r:.0f}' for r in rates)}",
              flush=True)


def measure_all(runs: int, measures: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """``runs`` rounds of every configuration, alternating; a failure prints the summary of the runs before it
    (``Results.part``) and exits 1."""
    from benchmarks._needs import Results

    log = Results("benchmarks.ray_data")
    results: dict[str, list[float]] = {name: [] for name in measures}
    for run in range(runs):
        for name, measure in measures.items():
            with log.part(f"run {run + 1} of {name!r}", partial=lambda: summary(results)):
                rate = measure()
            results[name].append(rate)
            log.add(f"run {run + 1}: {name:<20} {rate:10.0f} rows/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    check_ready(parser, args)

    import tempfile

    import ray
    import ray.data

    ray.init(address="local", num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.range(args.rows, override_num_blocks=args.blocks).map_batches(_features).materialize()
        print(f"dataset: {args.rows} rows x {DIM} float32 in {ds.num_blocks()} blocks; {args.workers} workers, "
              f"batch {args.batch}, {args.epochs} epochs (the first is a warm-up); {args.runs} runs", flush=True)
        with tempfile.TemporaryDirectory() as storage:
            results = measure_all(args.runs, {
                "ours, dataset order": lambda: measure_ours(ds, args, shuffle=False),
                "ours, shuffled": lambda: measure_ours(ds, args, shuffle=True),
                "Ray Train": lambda: measure_ray_train(ds, args, storage),
            })
        summary(results)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
