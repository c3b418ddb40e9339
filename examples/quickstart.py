"""Elastic training on a local Ray instance: 2-3 CPU workers, synthetic data, under a minute.

    python examples/quickstart.py [--workers 3] [--epochs 3]

The training function is an ordinary PyTorch loop with five elastic_ring lines
(marked ER). Kill a worker process while it runs (for example,
`kill -9 <pid of a RingWorker>`): the others re-form the ring in a fraction of a
second and carry on from their live state (at most the step in flight is
redone, even though the loop allreduces its loss every step); a replacement
joins at the next step.
"""

from __future__ import annotations

import argparse
import sys

import ray
import torch

import elastic_ring as er
from ray_integration import ElasticTrainer
from state import ElasticSampler, TorchState


def train(config: dict):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(2048, 20, generator=g)
    ys = xs @ torch.linspace(-1, 1, 20) + 0.1 * torch.randn(2048, generator=g)
    dataset = torch.utils.data.TensorDataset(xs, ys.unsqueeze(1))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]),  # ER
                                        model.named_parameters())
    sampler = ElasticSampler(dataset, batch_size=32, seed=0)                                    # ER
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, loss=None)   # ER

    @er.elastic.run                                                                             # ER
    def loop(state):
        while state.epoch < config["epochs"]:
            for x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch()
                state.loss = float(er.allreduce(loss.detach()))  # every step, for the log: safe
                er.report(loss=state.loss, epoch=state.epoch, step=state.sampler.step)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()                                                                      # ER
        return {"final_loss": state.loss, "steps": state.sampler.step}  # the last logged loss

    return loop(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    # a new local Ray instance, even if a cluster runs on this machine (on a cluster: ray.init(address="auto"))
    ray.init(address="local", num_cpus=max(4, args.workers), include_dashboard=False)
    trainer = ElasticTrainer(min_workers=1, max_workers=args.workers)
    result = trainer.run(train, config={"lr": 0.05, "epochs": args.epochs})
    if not result.completed:  # stopped (SIGTERM) before fn returned: a job runner should run it again
        sys.exit(75)
    print(f"result: {result.value}")
    print(f"first reported loss {result.metrics_history[0]['loss']:.4f}, last {result.metrics['loss']:.4f}")
    for event in result.events:
        print(f"event: {event.kind} round={event.round_id} world={event.world_size} {event.detail}")


if __name__ == "__main__":
    main()
