"""What authentication costs: per training step, and per re-form of the ring.

Nothing on a training step's data path is authenticated (gradient buckets and the per-step check are
tensors); what a step may add is rank 0's ``er.report`` record, sealed (HMAC-SHA256 over its JSON)
and pushed to the driver's queue. A re-form reads and writes the gloo rendezvous through the
authenticated store. Both are measured against the same work without authentication, interleaved in
the same processes:

  step      DistributedOptimizer steps of an MLP; every step also seals a report record and pushes
            it to a store queue, vs the same steps without the report
  re-form   forming a gloo ring of N ranks through AuthenticatedStore vs through the raw store

    python -m benchmarks.auth_cost [--world 3] [--width 1024] [--depth 4] [--blocks 8] [--reforms 15]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.backends.gloo import GlooCommunicator
from elastic_ring.core.auth import AuthenticatedStore, seal_json
from benchmarks._launch import median_ms, run_ranks
from benchmarks.step import mlp


def _bench(width: int, depth: int, blocks: int, reforms: int, port: int) -> dict[str, list[float]]:
    rank, world = er.rank(), er.size()
    secret = runtime.current().auth_key
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=60))
    model = mlp(depth, width)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    out: dict[str, list[float]] = {"plain": [], "sealed": [], "reform_raw": [], "reform_auth": []}

    def step(report: bool) -> float:
        started = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if report and rank == 0:  # what the worker runtime does for rank 0's er.report
            record = {"time": time.time(), "rank": 0, "round": 1, "world_size": world, "step": 1, "loss": loss.item()}
            raw.queue_push("bench/driver", seal_json(secret, "bench/driver", {"from": "w", "n": 1, "k": "report",
                                                                             "record": record}))
        return time.perf_counter() - started

    for _ in range(3):
        step(False), step(True)
    for _ in range(blocks):
        for _ in range(5):
            out["plain"].append(step(False))
        for _ in range(5):
            out["sealed"].append(step(True))
    for i in range(reforms):
        for kind in ("reform_raw", "reform_auth"):
            store = raw if kind == "reform_raw" else AuthenticatedStore(raw, secret)
            spec = er.RingSpec(round_id=1000 + 2 * i + (kind == "reform_auth"), rank=rank, world_size=world,
                               node_ids=("localhost",) * world, store=er.StoreAddress("127.0.0.1", port),
                               job_id="authbench", auth_key=secret)
            started = time.perf_counter()
            comm = GlooCommunicator(spec, store)
            comm.barrier()
            out[kind].append(time.perf_counter() - started)
            comm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--reforms", type=int, default=15)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_ranks(_bench, args.world, args.width, args.depth, args.blocks, args.reforms, store.port)
    r0 = results[0]
    secret = b"k" * 32
    record = {"from": "w", "n": 1, "k": "report", "record": {"time": time.time(), "rank": 0, "round": 1,
                                                              "world_size": args.world, "step": 1, "loss": 0.5}}
    seal_us = []
    for _ in range(20):
        started = time.perf_counter()
        for _ in range(500):
            seal_json(secret, "bench/driver", record)
        seal_us.append((time.perf_counter() - started) / 500 * 1e6)
    plain, sealed = median_ms(r0["plain"]), median_ms(r0["sealed"])
    raw = statistics.median(max(r[k][i] for r in results) for k in ["reform_raw"] for i in range(args.reforms)) * 1e3
    auth = statistics.median(max(r[k][i] for r in results) for k in ["reform_auth"] for i in range(args.reforms)) * 1e3
    print(f"{args.world} ranks, MLP {args.depth}x{args.width}, gloo; {args.blocks}x5 steps each, interleaved; "
          f"{args.reforms} re-forms each, interleaved")
    print(f"step (rank 0): plain {plain:.2f} ms, with a sealed report {sealed:.2f} ms: authentication costs "
          f"{100 * (sealed - plain) / plain:+.2f} % of step time (noise: the seal itself takes "
          f"{statistics.median(seal_us):.1f} us, {100 * statistics.median(seal_us) / 1e3 / plain:.3f} % of a step)")
    print(f"re-form (slowest rank): raw store {raw:.2f} ms, authenticated store {auth:.2f} ms: ratio {auth / raw:.3f}")


if __name__ == "__main__":
    main()
