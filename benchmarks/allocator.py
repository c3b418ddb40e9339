"""Minor page faults and step time with glibc's default allocator settings and with elastic_ring.core.allocator.tune().

mallopt settings are process-wide and cannot be undone, so each setting gets its own ring of processes. In
each ring DDP (its default configuration and with ``gradient_as_bucket_view=True``) and ours
(``DistributedOptimizer`` with ``autotune=False``, 16 MiB buckets) train the same workload in alternating
blocks; each block's step times and minor page faults (``getrusage``) are recorded. Printed per row and
setting: faults per step for each method, median step times, and ours against the faster DDP.

    python -m benchmarks.allocator [--rows mlp4x1024@2 mlp10x2048@2 resnet18@2] [--blocks 9] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import resource
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import elastic_ring as er
from elastic_ring.core import allocator
from benchmarks._launch import run_ranks
from benchmarks.step import WORKLOADS, _model  # noqa: F401


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _bench(name: str, tuned: bool, steps: int, blocks: int, port: int) -> dict:
    applied = allocator.tune() if tuned else False
    workload = WORKLOADS[name]
    rank, world = er.rank(), er.size()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"alloc/{name}/{tuned}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(workload.batch, *workload.input_shape, generator=g),
             torch.randint(0, 10, (workload.batch,), generator=g)) for _ in range(4)]
    loss_fn = torch.nn.CrossEntropyLoss()
    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    methods = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for key, view in (("ddp", False), ("ddp_view", True)):
            model = torch.nn.parallel.DistributedDataParallel(_model(workload), broadcast_buffers=False,
                                                              gradient_as_bucket_view=view)
            methods[key] = (model, sgd(model.parameters()))
    ours = _model(workload)
    methods["ours"] = (ours, er.DistributedOptimizer(sgd(ours.parameters()), ours.named_parameters(), autotune=False))
    times = {k: [] for k in methods}
    faults = {k: [] for k in methods}
    for block in range(blocks + 1):
        for key, (model, opt) in methods.items():
            er.barrier()
            f0, block_times = _faults(), []
            for i in range(steps):
                x, y = data[i % len(data)]
                t0 = time.perf_counter()
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                block_times.append(time.perf_counter() - t0)
            if block:  # the first block warms up every method
                faults[key].append((_faults() - f0) / steps)
                times[key].append(statistics.median(block_times))
    dist.destroy_process_group()
    return {"applied": applied, "faults": {k: statistics.median(v) for k, v in faults.items()},
            "times": times}


def _row(name: str, world: int, tuned: bool, steps: int, blocks: int) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    r0 = run_ranks(_bench, world, name, tuned, steps, blocks, store.port)[0]
    ms = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    ratios = [min(d, v) / o for d, v, o in zip(r0["times"]["ddp"], r0["times"]["ddp_view"], r0["times"]["ours"])]
    return {"applied": r0["applied"], "faults": r0["faults"], "ms": ms, "ratio": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["mlp4x1024@2", "mlp10x2048@2", "resnet18@2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=9)
    args = parser.parse_args()
    print(f"{'workload':<26} {'world':>5} {'allocator':>10} {'faults/step: DDP':>17} {'DDP view':>9} {'ours':>8} "
          f"{'ms: DDP':>8} {'DDP view':>9} {'ours':>8} {'ours vs faster DDP':>19}")
    for spec in args.rows:
        name, world = spec.split("@")
        for tuned in (False, True):
            r = _row(name, int(world), tuned, args.steps, args.blocks)
            label = "tuned" if tuned else "default"
            if tuned and not r["applied"]:
                label = "refused"
            f, ms = r["faults"], r["ms"]
            print(f"{WORKLOADS[name].label:<26} {world:>5} {label:>10} {f['ddp']:>17.0f} {f['ddp_view']:>9.0f} "
                  f"{f['ours']:>8.0f} {ms['ddp']:>8.2f} {ms['ddp_view']:>9.2f} {ms['ours']:>8.2f} {r['ratio']:>18.3f}x",
                  flush=True)


if __name__ == "__main__":
    main()
