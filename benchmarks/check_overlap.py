"""A/B of two DistributedOptimizer settings in the same processes: the check, or the first bucket.

Two copies of the same model and optimizer train in the same processes, in
alternating blocks (MLP 4x1024, batch 64/rank, gloo, 16 MiB buckets).
``--compare check`` (the default) pits

  A = helper     the default: the check's answer is awaited on a helper thread, no
                 bucket is sent before it, backward never blocks on it
  B = no-wait    the verdict is read only in synchronize(), after the buckets were
                 sent (what CUDA does after a ring's first step; on gloo it is NOT
                 safe against mismatches, so it serves here only as the reference
                 of a check that costs nothing before the first bucket)

``--compare first-bucket`` pits A = the 1 MiB early first bucket (default)
against B = no early first bucket (``first_bucket_bytes=0``).

Prints both medians, the median of the per-block ratios A/B (below 1.0: A is
faster) and how long, per step, a ready first bucket of A waited for the
check's answer (skew between ranks plus the round trip).

    python -m benchmarks.check_overlap [--compare check|first-bucket] [--worlds 2 3] [--blocks 20] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import elastic_ring as er
from benchmarks._launch import run_ranks
from benchmarks.step import mlp


def _bench(blocks: int, steps: int, compare: str) -> tuple[float, float, float, float]:
    g = torch.Generator().manual_seed(er.rank())
    data = [(torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]
    setups = {}
    for key in ("A", "B"):
        torch.manual_seed(0)
        model = mlp(4, 1024)
        first = 0 if compare == "first-bucket" and key == "B" else None
        opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                      autotune=False, first_bucket_bytes=first)
        opt._er_reducer.defer_check_on_cpu = compare == "check" and key == "B"
        setups[key] = (model, opt)

    def run(key: str, n: int) -> list[float]:
        model, opt = setups[key]
        out = []
        for i in range(n):
            x, y = data[i % len(data)]
            started = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            out.append(time.perf_counter() - started)
        return out

    for key in setups:
        run(key, 3)
    times: dict[str, list[float]] = {k: [] for k in setups}
    ratios = []
    for _ in range(blocks):
        block = {}
        for key in setups:
            er.barrier()
            block[key] = statistics.median(run(key, steps))
            times[key].append(block[key])
        ratios.append(block["A"] / block["B"])
    reducer = setups["A"][1]._er_reducer
    return (statistics.median(times["A"]) * 1e3, statistics.median(times["B"]) * 1e3,
            statistics.median(ratios), reducer.first_bucket_delay_s * 1e3 / max(1, reducer._ring_steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["check", "first-bucket"], default="check")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    a, b = ("helper", "no-wait") if args.compare == "check" else ("first 1 MiB", "no first")
    print(f"MLP 4x1024, batch 64/rank, gloo, 16 MiB buckets, {args.blocks} alternating blocks of {args.steps} steps; "
          f"A = {a}, B = {b}")
    print(f"{'world':>5} {'A ms':>8} {'B ms':>8} {'A/B':>7} {'A: first bucket waited ms/step':>31}")
    for world in args.worlds:
        ta, tb, ratio, delay = run_ranks(_bench, world, args.blocks, args.steps, args.compare)[0]
        print(f"{world:>5} {ta:>8.1f} {tb:>8.1f} {ratio:>7.3f} {delay:>31.2f}")


if __name__ == "__main__":
    main()
