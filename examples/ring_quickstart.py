"""Data-parallel training on a ring of local processes, without Ray.

Starts N processes, forms one elastic_ring round over gloo, trains a small MLP
on synthetic data with DistributedOptimizer, then kills nothing and checks
that every rank ends with the same parameters. This is the collective layer
on its own; ElasticTrainer (ray_integration) drives the same calls on Ray.

    python examples/ring_quickstart.py --world 2 --steps 50
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch

import elastic_ring as er
from elastic_ring.core.auth import new_secret
from elastic_ring.ring.store import StoreServer


def train(rank: int, world: int, port: int, secret: bytes, steps: int, queue) -> None:
    torch.set_num_threads(1)
    # 1. join the ring (ElasticTrainer does this for you); the secret authenticates everything the ranks exchange
    er.init(er.RingSpec(round_id=1, rank=rank, world_size=world, node_ids=("localhost",) * world,
                        store=er.StoreAddress("127.0.0.1", port), auth_key=secret))
    torch.manual_seed(rank)  # deliberately different starting weights...
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    # 2. wrap the optimizer
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    # 3. start everyone from rank 0's weights and optimizer state
    er.broadcast_parameters(model, root_rank=0)
    er.broadcast_optimizer_state(optimizer, root_rank=0)

    true_w = torch.linspace(-1, 1, 20)
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own shard of data
    for step in range(steps):
        x = torch.randn(32, 20, generator=g)
        y = (x @ true_w).unsqueeze(1)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()  # gradients were averaged over the ring during backward
        if step % 10 == 0:
            mean_loss = er.allreduce(loss.detach())  # a collective: every rank must call it
            if rank == 0:
                print(f"step {step:3d}  loss {mean_loss.item():.4f}", flush=True)
    weights = er.allgather_object([p.detach() for p in model.parameters()])
    same = all(torch.equal(a, b) for other in weights for a, b in zip(weights[0], other))
    queue.put((rank, loss.item(), same))
    er.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    server = StoreServer("127.0.0.1")  # the rendezvous store, listening on loopback only
    secret = new_secret()  # the job's secret: handed to the ranks out of band (here: process arguments)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=train, args=(r, args.world, server.address.port, secret, args.steps, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):  # collect, but stop at once if a rank dies
        try:
            results.append(queue.get(timeout=1))
        except Exception:  # queue.Empty: check that every rank is still alive
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank(s) {dead} failed; see their traceback above")
    results.sort()
    for p in procs:
        p.join(30)
    assert all(same for _, _, same in results), "ranks diverged"
    print(f"done: {args.world} ranks, {args.steps} steps, final loss {results[0][1]:.4f}, identical parameters on every rank")


if __name__ == "__main__":
    main()
