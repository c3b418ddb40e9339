"""Fused allreduce of a ResNet-50-shaped gradient list vs one flat buffer vs one allreduce per tensor.

Prints, for 2 and 3 processes on gloo, the median time of:
  flat       one allreduce of a single buffer holding all the bytes (the floor)
  optimizer  DistributedOptimizer's reduction of the same 161 gradients (op=Sum, as flat): its
             gradients live in the fusion buckets as views, so this is its bucket allreduces
             plus the per-step cross-rank check, with no pack or unpack copy
  opt-avg    the same with op=Average (the division by the world size is one pass over the
             gradients; compare with flat+div, one flat allreduce and one division)
  copy+flat  by hand: pack the tensors into one buffer, allreduce it, unpack; what fusing
             independent tensors must cost at least, with no fusion logic at all
  fused      elastic_ring.grouped_allreduce_ of the 161 separate tensors (fusion, pack/unpack,
             cross-rank check)
  per-tensor one allreduce per tensor, all launched asynchronously, then waited
and the ratios optimizer/flat (target <= 1.10), opt-avg/flat+div, fused/flat,
fused/copy+flat (our own overhead on top of the copies) and per-tensor/fused.
Methods are interleaved repetition by repetition so machine noise hits all alike.

    python -m benchmarks.allreduce [--reps 15] [--worlds 2 3] [--bucket-mib 16]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from benchmarks._launch import median_ms, run_ranks


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50 (161 tensors, 25.6 M parameters)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def _bench(reps: int, threshold_bytes: int, bucket_bytes: int) -> dict[str, list[float]]:
    comm = runtime.current()
    tensors = [torch.randn(s) for s in resnet50_shapes()]
    flat = torch.randn(sum(t.numel() for t in tensors))
    packed = torch.empty_like(flat)
    views = [chunk.view(t.shape) for chunk, t in zip(packed.split([t.numel() for t in tensors]), tensors)]

    def optimizer_for(op):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in resnet50_shapes()]
        opt = er.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), [(f"p{i}", p) for i, p in enumerate(params)],
                                      op=op, fusion_threshold_bytes=bucket_bytes)
        for p, t in zip(params, tensors):  # gradients as backward leaves them; the first reduction moves
            p.grad = t.clone()             # them into the buckets, after which they are views there
        opt.synchronize()
        return opt

    opt_sum, opt_avg = optimizer_for(er.Sum), optimizer_for(er.Average)

    def run_flat():
        comm.allreduce(flat, er.Sum).wait()

    def run_optimizer():
        opt_sum.synchronize()

    def run_opt_avg():
        opt_avg.synchronize()

    def run_flat_div():
        comm.allreduce(flat, er.Sum).wait()
        flat.div_(comm.size)

    def run_copy_flat():
        torch.cat([t.view(-1) for t in tensors], out=packed)
        comm.allreduce(packed, er.Sum).wait()
        torch._foreach_copy_(tensors, views)

    def run_fused():
        er.grouped_allreduce_(tensors, op=er.Sum, fusion_threshold_bytes=threshold_bytes)

    def run_per_tensor():
        for w in [comm.allreduce(t, er.Sum) for t in tensors]:
            w.wait()

    methods = {"flat": run_flat, "optimizer": run_optimizer, "flat+div": run_flat_div, "opt-avg": run_opt_avg,
               "copy+flat": run_copy_flat, "fused": run_fused, "per-tensor": run_per_tensor}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():  # warm-up
        fn()
    for _ in range(reps):
        for name, fn in methods.items():
            er.barrier()
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--threshold-mib", type=int, default=64, help="grouped_allreduce_ fusion_threshold_bytes in MiB (default 64)")
    parser.add_argument("--bucket-mib", type=float, default=16, help="DistributedOptimizer bucket size in MiB (default 16)")
    args = parser.parse_args()
    shapes = resnet50_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"ResNet-50 gradients: {len(shapes)} tensors, {numel / 1e6:.1f} M float32 ({numel * 4 / 2**20:.0f} MiB); "
          f"gloo on {platform.node()} ({torch.get_num_threads()} threads available), {args.reps} interleaved reps, "
          f"grouped fusion threshold {args.threshold_mib} MiB, optimizer buckets {args.bucket_mib:g} MiB (+1 MiB first)")
    names = ("flat", "optimizer", "flat+div", "opt-avg", "copy+flat", "fused", "per-tensor")
    print(f"{'world':>5} " + " ".join(f"{n + ' ms':>13}" for n in names) + f" {'optimizer/flat':>15} {'opt-avg/flat+div':>17}"
          f" {'fused/flat':>11} {'fused/copy+flat':>16} {'per-tensor/fused':>17}")
    for world in args.worlds:
        times = run_ranks(_bench, world, args.reps, args.threshold_mib << 20, int(args.bucket_mib * 2**20))[0]
        m = {k: median_ms(times[k]) for k in names}
        print(f"{world:>5} " + " ".join(f"{m[n]:13.1f}" for n in names) + f" {m['optimizer'] / m['flat']:15.3f}"
              f" {m['opt-avg'] / m['flat+div']:17.3f} {m['fused'] / m['flat']:11.3f} {m['fused'] / m['copy+flat']:16.3f}"
              f" {m['per-tensor'] / m['fused']:17.2f}")


if __name__ == "__main__":
    main()
