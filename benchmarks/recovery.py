"""Recovery time: a SIGKILLed worker, ours vs Ray Train's TorchTrainer, on one host and on many.

For each of ``--runs`` runs, 3 gloo CPU workers train a small MLP; rank 2 SIGKILLs itself at step 20
after writing the time. We measure:

  recovery  seconds from the kill to the survivors' first completed step in the new ring
  redone    steps completed before the kill that the new ring trained again (ours commit only at
            epoch ends by default, --commit-every N commits every N steps; Ray Train checkpoints
            every step)
  join      seconds the survivors pause when the replacement worker joins (the gap between the
            last step of the old ring and the first of the new one, minus one median step)

for ElasticTrainer on one Ray node ("one host") and on a ray.cluster_utils.Cluster with one worker
slot per node ("many hosts"), and the recovery of Ray Train's TorchTrainer (v2, restarting its
worker group from the last checkpoint) on one node as the reference. Prints medians and worst cases.

    python -m benchmarks.recovery [--runs 5] [--skip-ray-train]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import tempfile
import time

import ray
import torch

import elastic_ring as er
from ray_integration import ElasticTrainer
from state import ElasticSampler, TorchState

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
KILL_STEP, VICTIM_RANK, SAMPLES, BATCH = 20, 2, 4096, 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 64, generator=g), torch.randn(SAMPLES, 1, generator=g)


def ours_train(config: dict):
    torch.set_num_threads(1)
    xs, ys = _data()
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    sampler = ElasticSampler(SAMPLES, batch_size=BATCH, seed=0)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)

    @er.elastic.run
    def loop(state):
        while state.epoch < config["epochs"]:
            for batch in state.sampler:
                if er.round_id() == 1 and er.rank() == VICTIM_RANK and state.step == KILL_STEP:
                    pathlib.Path(config["kill_file"]).write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                idx = torch.tensor(batch, dtype=torch.long)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
                opt.step()
                state.sampler.record_batch()
                state.step += 1
                er.report(step=state.step)
                if config["commit_every"] and state.step % config["commit_every"] == 0:
                    state.commit()
                time.sleep(config["step_delay_s"])
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.step

    return loop(state)


def ray_train_loop(config: dict):
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    xs, ys = _data()
    model = ray.train.torch.prepare_model(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    log = pathlib.Path(config["log_file"])
    for step in range(start, config["steps"]):
        if rank == VICTIM_RANK and step == KILL_STEP and not pathlib.Path(config["kill_file"]).exists():
            pathlib.Path(config["kill_file"]).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        lo = (step * world + rank) * BATCH % SAMPLES
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[lo:lo + BATCH]), ys[lo:lo + BATCH]).backward()
        opt.step()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                           os.path.join(d, "state.pt"))
            ray.train.report({"step": step + 1}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:
            with log.open("a") as f:
                f.write(f"{time.time()} {step + 1} {checkpoint is not None}\n")
        time.sleep(config["step_delay_s"])


def measure_ours(step_delay_s: float, commit_every: int, trainer_kwargs: dict) -> tuple[float, int, float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        result = ElasticTrainer(min_workers=2, max_workers=3, progress=False, **trainer_kwargs).run(
            ours_train, config={"epochs": 3, "kill_file": kill_file, "step_delay_s": step_delay_s,
                                "commit_every": commit_every})
        killed_at = float(pathlib.Path(kill_file).read_text())
    by_round: dict[int, list[tuple[float, int]]] = {}
    for m in result.metrics:
        by_round.setdefault(m["round"], []).append((m["time"], m["step"]))
    recovery = min(t for t, _ in by_round[2]) - killed_at
    redone = max(s for _, s in by_round[1]) - (min(s for _, s in by_round[2]) - 1)
    join = None
    if 3 in by_round:
        times = sorted(t for entries in by_round.values() for t, _ in entries)
        typical = statistics.median(b - a for a, b in zip(times, times[1:]))
        join = min(t for t, _ in by_round[3]) - max(t for t, _ in by_round[2]) - typical
    return recovery, redone, join


def measure_ray_train(step_delay_s: float) -> tuple[float, int]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = {"steps": KILL_STEP + 15, "kill_file": os.path.join(tmp, "killed"),
                  "log_file": os.path.join(tmp, "log"), "step_delay_s": step_delay_s}
        TorchTrainer(ray_train_loop, train_loop_config=config,
                     scaling_config=ScalingConfig(num_workers=3, use_gpu=False),
                     run_config=RunConfig(storage_path=tmp, name="bench", failure_config=FailureConfig(max_failures=1)),
                     ).fit()
        killed_at = float(pathlib.Path(config["kill_file"]).read_text())
        lines = [line.split() for line in pathlib.Path(config["log_file"]).read_text().splitlines()]
    before = [int(step) for _, step, resumed in lines if resumed == "False"]
    after = [(float(t), int(step)) for t, step, resumed in lines if resumed == "True"]
    return min(t for t, _ in after) - killed_at, max(before) - (min(s for _, s in after) - 1)


def summary(name: str, values: list[float]) -> str:
    return f"{name:<40} median {statistics.median(values):7.3f} s   worst {max(values):7.3f} s   (n={len(values)})"


def redone_summary(name: str, values: list[int]) -> str:
    return f"{name:<40} median {statistics.median(values):7.1f}     worst {max(values):7d}     (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--step-delay-s", type=float, default=0.01)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument("--commit-every", type=int, default=0, help="ours: commit every N steps (0: at epoch ends)")
    parser.add_argument("--skip-many-hosts", action="store_true")
    args = parser.parse_args()
    env = {"env_vars": {"PYTHONPATH": ROOT}}
    lines = []

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env=env)
    one = [measure_ours(args.step_delay_s, args.commit_every, {}) for _ in range(args.runs)]
    lines.append(summary("ours, one host: recovery", [r for r, _, _ in one]))
    lines.append(redone_summary("ours, one host: steps redone", [d for _, d, _ in one]))
    lines.append(summary("ours, one host: join pause", [j for _, _, j in one if j is not None]))
    if not args.skip_ray_train:
        theirs = [measure_ray_train(args.step_delay_s) for _ in range(args.runs)]
        lines.append(summary("Ray Train TorchTrainer: recovery", [r for r, _ in theirs]))
        lines.append(redone_summary("Ray Train TorchTrainer: steps redone", [d for _, d in theirs]))
    ray.shutdown()
    if args.skip_many_hosts:
        print(f"3 gloo CPU workers, one SIGKILLed at step {KILL_STEP}; {args.runs} runs each; ours commit "
              f"{'every %d steps' % args.commit_every if args.commit_every else 'only at epoch ends'}")
        print("\n".join(lines))
        return

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(4):
        cluster.add_node(num_cpus=1, resources={"slot": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
    many = [measure_ours(args.step_delay_s, args.commit_every, {"resources_per_worker": {"slot": 1}})
            for _ in range(args.runs)]
    lines.append(summary("ours, many hosts: recovery", [r for r, _, _ in many]))
    lines.append(redone_summary("ours, many hosts: steps redone", [d for _, d, _ in many]))
    lines.append(summary("ours, many hosts: join pause", [j for _, _, j in many if j is not None]))
    ray.shutdown()
    cluster.shutdown()
    print(f"3 gloo CPU workers, one SIGKILLed at step {KILL_STEP}; {args.runs} runs each; ours commit "
          f"{'every %d steps' % args.commit_every if args.commit_every else 'only at epoch ends'}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
