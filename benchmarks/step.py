"""Training step throughput: elastic_ring.DistributedOptimizer vs torch DistributedDataParallel.

Both train the same MLP on the same data over gloo with the same world size,
in the same processes: DDP uses the default process group, elastic_ring its
own ring. Blocks of steps alternate between the two so that machine noise hits
both alike. Prints the median step time of each and the throughput ratio
DDP-time / ours (>= 1.0 means at least as fast as DDP). With ``--world 1`` the
baseline is the plain, unwrapped torch optimizer instead of DDP, which shows
what wrapping costs when there is nobody to talk to.

    python -m benchmarks.step [--world 2] [--width 1024] [--depth 4] [--batch 64] [--steps 20] [--blocks 4]
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

import elastic_ring as er
from benchmarks._launch import median_ms, run_ranks


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def _bench(width: int, depth: int, batch: int, steps: int, blocks: int, port: int, bucket_bytes: int | None) -> dict[str, list[float]]:
    rank, world = er.rank(), er.size()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp/", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss()

    baseline = make_model(width, depth)
    ddp_model = torch.nn.parallel.DistributedDataParallel(baseline) if world > 1 else baseline
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    our_model = make_model(width, depth)
    kwargs = {} if bucket_bytes is None else {"fusion_threshold_bytes": bucket_bytes}
    our_opt = er.DistributedOptimizer(torch.optim.SGD(our_model.parameters(), lr=0.01, momentum=0.9),
                                      our_model.named_parameters(), **kwargs)

    def train(model, opt, n):
        times = []
        for i in range(n):
            x, y = data[i % len(data)]
            started = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - started)
        return times

    results: dict[str, list[float]] = {"ddp": [], "elastic_ring": []}
    train(ddp_model, ddp_opt, 3)
    train(our_model, our_opt, 3)
    for _ in range(blocks):
        er.barrier()
        results["ddp"] += train(ddp_model, ddp_opt, steps)
        er.barrier()
        results["elastic_ring"] += train(our_model, our_opt, steps)
    # same data, same start: both must have learned the same parameters
    diff = max((a - b).abs().max().item() for a, b in zip(baseline.parameters(), our_model.parameters()))
    results["max_param_diff"] = [diff]
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--bucket-mib", type=float, default=None, help="DistributedOptimizer fusion_threshold_bytes in MiB (default: the library's)")
    args = parser.parse_args()
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    bucket = None if args.bucket_mib is None else int(args.bucket_mib * 2**20)
    results = run_ranks(_bench, args.world, args.width, args.depth, args.batch, args.steps, args.blocks, store.port, bucket)
    ddp, ours = median_ms(results[0]["ddp"]), median_ms(results[0]["elastic_ring"])
    print(f"MLP {args.depth}x{args.width} ({params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB of gradients), "
          f"batch {args.batch}/rank, world {args.world}, gloo, {args.blocks}x{args.steps} steps each, interleaved, "
          f"optimizer buckets {'default' if bucket is None else f'{args.bucket_mib} MiB'}")
    base = "DDP" if args.world > 1 else "plain optimizer"
    print(f"median step: {base} {ddp:.1f} ms, elastic_ring {ours:.1f} ms; "
          f"throughput ratio ({base} time / ours) {ddp / ours:.3f}")
    print(f"max |param difference| after identical training: {max(r['max_param_diff'][0] for r in results):.2e}")


if __name__ == "__main__":
    main()
