"""A constant global batch through a shrink and a grow: the loss curve of one run with resizes over one without.

    pip install matplotlib   # (in the test extra already)
    python examples/global_batch_curve.py [--out docs/global_batch.png] [--steps-per-epoch 40]

Both runs train the same MLP on the same synthetic regression data with
``ElasticSampler(global_batch_size=64, batch_size=16)``: every optimizer step
averages exactly 64 samples, whatever the world size. The second run loses a
worker (SIGKILL) early in epoch 1 and gets a replacement back at the next step:
3 ranks, then 2, then 3 again. The loop is a plain PyTorch loop (``step()``
after every micro-batch); the optimizer applies once per global step. The
global-batch loss of every step is logged (one allreduce after each apply).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import time

import ray
import torch

import elastic_ring as er
from ray_integration import ElasticTrainer
from state import ElasticSampler, TorchState

G, MICRO = 64, 16


def train(config: dict):
    torch.set_num_threads(1)
    n = config["steps_per_epoch"] * G
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, 16, generator=g)
    ys = torch.tanh(xs @ torch.randn(16, 1, generator=g) / 4) + 0.05 * torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), model.named_parameters())
    sampler = ElasticSampler(n, batch_size=MICRO, global_batch_size=G, seed=1)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)
    kill = tuple(config["kill"]) if config.get("kill") else None

    @er.elastic.run
    def loop(state):
        weighted = torch.zeros(1)
        while state.epoch < config["epochs"]:
            for batch in state.sampler:
                if kill == (er.round_id(), er.rank(), state.sampler.step):
                    os.kill(os.getpid(), signal.SIGKILL)
                idx = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
                loss.backward()
                weighted += loss.detach() * len(batch)
                applied = optimizer.applied_steps
                optimizer.step()
                state.sampler.record_batch()
                if optimizer.applied_steps != applied:  # a global step was applied: log its exact mean loss
                    total = er.allreduce(weighted, op=er.Sum, name="loss for the log")
                    weighted.zero_()
                    if er.rank() == 0:
                        er.report(loss=float(total) / G, step=state.sampler.step, world=er.size())
                time.sleep(config.get("step_delay_s", 0.0))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return {"steps": state.sampler.step}

    return loop(state)


def curve(result) -> dict[int, tuple[float, int]]:
    """step -> (loss, world) from rank 0's reports (the last report of a step wins: a redone step)."""
    return {m["step"]: (m["loss"], m["world"]) for m in result.metrics_history if "step" in m}


def plot(steady: dict, resized: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5), height_ratios=[3, 1])
    for data, label, style in ((steady, "3 workers throughout", dict(color="tab:blue", lw=2.2, alpha=0.5)),
                               (resized, "3 → 2 (SIGKILL) → 3 (replacement joins at the next step)",
                                dict(color="tab:red", lw=1.0))):
        steps = sorted(data)
        top.plot(steps, [data[s][0] for s in steps], label=label, **style)
        bottom.step(steps, [data[s][1] for s in steps], where="post", **style)
    top.set_ylabel("global-batch loss (64 samples)")
    top.set_yscale("log")
    top.legend()
    top.set_title("global_batch_size=64: the same steps with and without resizes")
    bottom.set_ylabel("workers")
    bottom.set_xlabel("optimizer step")
    bottom.set_yticks([1, 2, 3])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="global_batch.png")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--step-delay-s", type=float, default=0.05)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        config = {"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch, "step_delay_s": args.step_delay_s}
        trainer = ElasticTrainer(min_workers=2, max_workers=3, progress=False)
        steady = trainer.run(train, config=config)
        resized = ElasticTrainer(min_workers=2, max_workers=3, progress=False).run(
            train, config={**config, "kill": (1, 1, args.steps_per_epoch + 5)})
    finally:
        ray.shutdown()
    a, b = curve(steady), curve(resized)
    common = sorted(set(a) & set(b))
    gap = max(abs(a[s][0] - b[s][0]) / a[s][0] for s in common)
    print(f"worlds in the resized run: {[e.world_size for e in resized.events if e.kind == 'ring_formed']}")
    print(f"{len(common)} steps in both runs; largest relative loss difference {gap:.2e}")
    plot(a, b, pathlib.Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
