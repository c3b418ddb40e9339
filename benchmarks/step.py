"""Training step throughput: elastic_ring.DistributedOptimizer vs torch DistributedDataParallel, per workload.

Every row trains one workload over gloo in the same processes several ways:
``DDP`` (torch's DistributedDataParallel, default settings except
``broadcast_buffers=False``, since DistributedOptimizer does not sync
BatchNorm buffers either), ``DDP view`` (the same with
``gradient_as_bucket_view=True``), ``ours`` (DistributedOptimizer with its
defaults: gradient bucket views, the 1 MiB first bucket, autotuning, the
step's agreement carried in its last bucket), ``ours strict`` (the same with
``strict_checks=True``: a 48-byte check collective before every step's
buckets), optionally ``ours fixed`` (``--fixed``: ``autotune=False``, 16 MiB
buckets), and ``local``, the same model and optimizer without any
communication, which is the floor: ``DDP / local`` is the most any
data-parallel reducer could gain over DDP on that row. All start from the
same weights and see the same data. Blocks of steps alternate between them so
that machine noise hits all alike; ours is first warmed up until its
autotuner has chosen. For each block the throughput ratio is the *faster*
DDP's median step time (the better of the two configurations in that block)
/ ours; a row's ratio is the median over blocks (>= 1.0: at least as fast as
the faster DDP). A second table splits the median step into forward,
backward (DDP waits for its allreduces at the end of backward) and
``step()`` (ours waits for its buckets there), which is what explains a row.

    python -m benchmarks.step [--rows mlp4x1024@2 mlp4x1024@3 mlp10x2048@2 resnet18@2] [--blocks 15] [--steps 3] [--device cuda] [--ddp-probe] [--fixed]

A row at world 1 (e.g. ``mlp4x1024@1``) compares with the plain, unwrapped optimizer instead of DDP: the cost of wrapping.

``--device cuda`` runs the same table on ONE GPU: every rank on CUDA device 0, DDP over torch's NCCL
process group, ours over elastic_ring's NCCL backend, both on NCCL's socket transport on loopback
(``elastic_ring.backends.nccl.communicator.shared_gpu_env``; NCCL refuses two ranks of a ring on one GPU otherwise). Each step
ends with ``torch.cuda.synchronize()``; the phase split is then host time (launches), not GPU time.

``--ddp-probe`` adds a fifth copy: DDP plus one 48-byte MAX allreduce per step, read on the host after
``step()``, which is what our per-step check (alignment and the step's transaction vote) adds to a
step. Its throughput relative to DDP prices the check on that transport.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import elastic_ring as er
from benchmarks._launch import run_ranks
from benchmarks._needs import Results, require_nccl


def mlp(depth: int, width: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


class _Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(width: int) -> torch.nn.Module:
    """ResNet-18 for 32x32 inputs (CIFAR layout: 3x3 stem, no max-pool), ``width`` channels in its first stage."""
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
    cin = width
    for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, 10))


@dataclass(frozen=True)
class Workload:
    label: str
    make: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]
    batch: int


WORKLOADS = {
    "mlp4x1024": Workload("MLP 4x1024", lambda: mlp(4, 1024), (1024,), 64),
    "mlp10x2048": Workload("MLP 10x2048", lambda: mlp(10, 2048), (2048,), 64),
    # 62 small parameters, little compute: the step is mostly per-parameter overhead (hooks, launches)
    "mlp30x64": Workload("MLP 30x64 (62 params, overhead-bound)", lambda: mlp(30, 64), (64,), 32),
    "resnet18": Workload("ResNet-18-like (width 32), 32x32", lambda: resnet18(32), (3, 32, 32), 32),
}
DEFAULT_ROWS = ["mlp4x1024@2", "mlp4x1024@3", "mlp10x2048@2", "resnet18@2"]
PHASES = ("forward", "backward", "step")


def _model(workload: Workload) -> torch.nn.Module:
    torch.manual_seed(0)
    return workload.make()


def _noop() -> None:
    pass


def _train(model, opt, data, loss_fn, n, phases=None, sync=_noop):
    """``n`` steps; batches continue where this model's previous call stopped (``opt.batches_seen``).
    ``sync`` ends each step (``torch.cuda.synchronize`` on a GPU, so that a step's time includes its kernels)."""
    times = []
    start = getattr(opt, "batches_seen", 0)
    opt.batches_seen = start + n
    for i in range(start, start + n):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        if phases is not None:
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(seconds)
    return times


class _Probed:
    """An optimizer wrapper for ``--ddp-probe``: DDP plus what our per-step check adds, one 48-byte MAX
    allreduce per step, launched as the step starts and read on the host after ``step()``."""

    def __init__(self, opt: torch.optim.Optimizer, device: torch.device) -> None:
        self.opt, self.probe, self.work = opt, torch.zeros(6, dtype=torch.int64, device=device), None

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        self.work = dist.all_reduce(self.probe, op=dist.ReduceOp.MAX, async_op=True)

    def step(self) -> None:
        self.opt.step()
        self.work.wait()
        self.probe.tolist()


def _ddp(model: torch.nn.Module, bucket_view: bool, cuda: bool) -> torch.nn.Module:
    with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers; False keeps its meaning here
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=bucket_view,
                                                         device_ids=[0] if cuda else None)


def _bench(name: str, steps: int, blocks: int, port: int, fixed: bool, max_warmup: int, fixed_first: int | None,
           device: str = "cpu", ddp_probe: bool = False) -> dict:
    workload = WORKLOADS[name]
    rank, world = er.rank(), er.size()
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else _noop
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"ddp/{name}/{world}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(workload.batch, *workload.input_shape, generator=g).to(dev),
             torch.randint(0, 10, (workload.batch,), generator=g).to(dev)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss()
    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731

    baseline = _model(workload).to(dev)
    ddp = _ddp(baseline, False, cuda) if world > 1 else baseline
    ddp_view = _ddp(_model(workload).to(dev), True, cuda) if world > 1 else _model(workload).to(dev)
    ours_model, strict_model, fixed_model, local_model = (_model(workload).to(dev) for _ in range(4))
    methods = {
        "ddp": (ddp, sgd(ddp.parameters())),
        "ddp_view": (ddp_view, sgd(ddp_view.parameters())),
        "ours": (ours_model, er.DistributedOptimizer(sgd(ours_model.parameters()), ours_model.named_parameters())),
        "strict": (strict_model, er.DistributedOptimizer(sgd(strict_model.parameters()), strict_model.named_parameters(),
                                                         strict_checks=True)),
        "local": (local_model, sgd(local_model.parameters())),
    }
    if fixed:
        methods["fixed"] = (fixed_model, er.DistributedOptimizer(sgd(fixed_model.parameters()), fixed_model.named_parameters(),
                                                                 autotune=False, first_bucket_bytes=fixed_first))
    if ddp_probe and world > 1:
        probed = _ddp(_model(workload).to(dev), False, cuda)
        methods["probe"] = (probed, _Probed(sgd(probed.parameters()), dev))
    ours_opt, strict_opt = methods["ours"][1], methods["strict"][1]
    warmup = 0
    while (ours_opt.autotune_result is None or strict_opt.autotune_result is None) and warmup < max_warmup and world > 1:
        warmup += len(_train(*methods["ours"], data, loss_fn, 1, sync=sync))
        _train(*methods["strict"], data, loss_fn, 1, sync=sync)
    _train(*methods["ours"], data, loss_fn, 2, sync=sync)
    _train(*methods["strict"], data, loss_fn, 2, sync=sync)
    for key in [k for k in methods if k not in ("ours", "strict")]:  # the same number of steps on every model, so their parameters can be compared
        _train(*methods[key], data, loss_fn, warmup + 2, sync=sync)
    times: dict[str, list[list[float]]] = {k: [] for k in methods}
    phases: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in methods}
    for _ in range(blocks):
        for key, (model, opt) in methods.items():
            er.barrier()
            times[key].append(_train(model, opt, data, loss_fn, steps, phases[key], sync=sync))
    diff = max(max((a - b).abs().max().item() for a, b in zip(baseline.parameters(), m.parameters()))
               for m in (ours_model, strict_model) + ((fixed_model,) if fixed else ()))
    dist.destroy_process_group()
    result = ours_opt.autotune_result
    return {
        "times": times,
        "phases": {k: {p: statistics.median(v) for p, v in ph.items()} for k, ph in phases.items()},
        "max_param_diff": diff,
        "chosen": None if result is None else result.chosen_bytes,
        "tuning": None if result is None else list(zip(result.candidates, result.step_ms)),
        "warmup_steps": warmup,
        "check_wait_ms": ours_opt._er_reducer.check_wait_s * 1e3 / max(1, ours_opt._er_reducer._ring_steps),
        "first_delay_ms": ours_opt._er_reducer.first_bucket_delay_s * 1e3 / max(1, ours_opt._er_reducer._ring_steps),
    }


def _row(name: str, world: int, steps: int, blocks: int, fixed: bool, max_warmup: int, fixed_first: int | None,
         device: str = "cpu", ddp_probe: bool = False) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_ranks(_bench, world, name, steps, blocks, store.port, fixed, max_warmup, fixed_first, device,
                        ddp_probe, backend="nccl" if device == "cuda" else "gloo")
    r0 = results[0]
    med = statistics.median
    # per block, the faster of DDP's two configurations is the baseline
    ddp_blocks = [min(a, b, key=med) for a, b in zip(r0["times"]["ddp"], r0["times"]["ddp_view"])]
    ours_blocks, strict_blocks, local_blocks = (r0["times"][k] for k in ("ours", "strict", "local"))
    per_block = lambda mine: [med(d) / med(o) for d, o in zip(ddp_blocks, mine)]  # noqa: E731
    ratios, strict_ratios, bound = per_block(ours_blocks), per_block(strict_blocks), per_block(local_blocks)
    view_faster = sum(med(b) < med(a) for a, b in zip(r0["times"]["ddp"], r0["times"]["ddp_view"]))
    fixed_blocks = r0["times"].get("fixed")
    flat = lambda blocks_: statistics.median([t for b in blocks_ for t in b]) * 1e3  # noqa: E731
    params = sum(p.numel() for p in _model(WORKLOADS[name]).parameters())
    probe = r0["times"].get("probe")
    probe_ratio = None if probe is None else statistics.median(
        [statistics.median(d) / statistics.median(p) for d, p in zip(ddp_blocks, probe)])
    return {"probe_ratio": probe_ratio, "name": name, "world": world, "mib": params * 4 / 2**20, "ddp_ms": flat(ddp_blocks), "ours_ms": flat(ours_blocks),
            "local_ms": flat(local_blocks), "bound": statistics.median(bound),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "view_faster": view_faster, "blocks": len(ratios),
            "ratio_max": max(ratios), "strict_ratio": med(strict_ratios),
            "fixed_ratio": None if fixed_blocks is None else med(per_block(fixed_blocks)), "chosen": r0["chosen"],
            "tuning": r0["tuning"], "warmup": r0["warmup_steps"], "diff": max(r["max_param_diff"] for r in results),
            "phases": r0["phases"], "check_wait_ms": max(r["check_wait_ms"] for r in results),
            "first_delay_ms": max(r["first_delay_ms"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="WORKLOAD@WORLD, workloads: " + ", ".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--blocks", type=int, default=15, help="blocks per method, alternating")
    parser.add_argument("--max-warmup", type=int, default=60, help="most steps to wait for the autotuner before measuring")
    parser.add_argument("--fixed", action="store_true", help="also time ours with autotune off (16 MiB buckets)")
    parser.add_argument("--fixed-first-mib", type=float, default=None,
                        help="first_bucket_bytes of the 'ours fixed' column in MiB (default: the library's, 1 MiB; 0: none)")
    parser.add_argument("--ddp-probe", action="store_true",
                        help="also time DDP plus one 48-byte allreduce per step (what our per-step check adds)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every rank on GPU 0, NCCL on both sides (socket transport on loopback)")
    args = parser.parse_args()
    if args.device == "cuda":
        require_nccl(benchmark="benchmarks.step", why="--device cuda (ours over elastic_ring's NCCL)",
                     skip="--device cpu")
    specs = []
    for spec in args.rows:
        name, _, world = spec.partition("@")
        if name not in WORKLOADS or not world.isdigit() or int(world) < 1:
            parser.error(f"--rows {spec!r}: use WORKLOAD@WORLD with WORKLOAD one of {', '.join(WORKLOADS)}")
        specs.append((name, int(world)))
    rows = []
    fixed_first = None if args.fixed_first_mib is None else int(args.fixed_first_mib * 2**20)
    for name, world in specs:  # a row that fails prints the tables of the rows before it, then the failure
        with Results("benchmarks.step").part(f"row {name}@{world}",
                                             partial=lambda: print_tables(rows, args, partial=False) if rows else None):
            rows.append(_row(name, world, args.steps, args.blocks, args.fixed, args.max_warmup, fixed_first,
                             args.device, args.ddp_probe))
        print_tables(rows, args, partial=True)
    print_tables(rows, args, partial=False)


def print_tables(rows: list[dict], args, partial: bool) -> None:
    if partial:
        r = rows[-1]
        print(f"... {r['name']}@{r['world']}: ratio {r['ratio']:.3f} (blocks {r['ratio_min']:.2f}-{r['ratio_max']:.2f}), "
              f"strict {r['strict_ratio']:.3f}, autotune {r['tuning']}"
              + ("" if r["probe_ratio"] is None else f", DDP+probe/DDP thr {r['probe_ratio']:.3f}"), flush=True)
        return
    first = "1 MiB (default)" if args.fixed_first_mib is None else f"{args.fixed_first_mib:g} MiB"
    where = ("gloo (CPU)" if args.device == "cpu" else
             f"NCCL on one GPU ({torch.cuda.get_device_name(0)}; every rank on device 0, socket transport on loopback)")
    print(f"\n{where}, {torch.get_num_threads()} threads available, 1 compute thread per rank, {args.blocks} blocks x "
          f"{args.steps} steps per method, interleaved; DDP = the faster of gradient_as_bucket_view=False/True in each "
          f"block; 'strict' = strict_checks=True" + (f"; 'fixed' = autotune off, 16 MiB buckets, first bucket {first}" if args.fixed else ""))
    print(f"{'workload':<34} {'world':>5} {'grads MiB':>9} {'DDP ms':>8} {'ours ms':>8} {'ours/DDP thr':>12} "
          f"{'blocks':>11} {'strict':>7} {'fixed':>7} {'view won':>8} {'autotuned':>9} {'max|dp|':>8} {'local ms':>8} {'DDP/local':>9}")
    for r in rows:
        chosen = "-" if r["chosen"] is None else f"{r['chosen'] / 2**20:g} MiB"
        fixed = "-" if r["fixed_ratio"] is None else f"{r['fixed_ratio']:.3f}x"
        print(f"{WORKLOADS[r['name']].label:<34} {r['world']:>5} {r['mib']:>9.1f} {r['ddp_ms']:>8.1f} {r['ours_ms']:>8.1f} "
              f"{r['ratio']:>11.3f}x {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} {r['strict_ratio']:>6.3f}x {fixed:>7} "
              f"{r['view_faster']:>3}/{r['blocks']:<4} {chosen:>9} {r['diff']:>8.1e} {r['local_ms']:>8.1f} {r['bound']:>8.3f}x")
    ratios = [r["ratio"] for r in rows]
    print(f"median over rows: {statistics.median(ratios):.3f}x; lowest row {min(ratios):.3f}x")
    for r in rows:
        if r["probe_ratio"] is not None:
            print(f"{r['name']}@{r['world']}: DDP plus one 48-byte allreduce per step (the price of our check) runs at "
                  f"{r['probe_ratio']:.3f}x DDP's throughput")
    print("DDP/local: how much faster than DDP a step with no communication at all is (the most any reducer could gain)")
    print("\nmedian phase times (ms): forward / backward / step()  -- DDP waits in backward, ours in step()")
    for r in rows:
        ph = r["phases"]
        keys = [k for k in ("ddp", "ddp_view", "ours", "strict", "fixed", "local") if k in ph]
        cells = "   ".join(f"{k}: " + " / ".join(f"{ph[k][p] * 1e3:.1f}" for p in PHASES) for k in keys)
        total = " / ".join(f"{sum(ph[k].values()) * 1e3:.1f}" for k in keys)
        print(f"{r['name']}@{r['world']:<3} {cells}   (sums {total}); "
              f"per step: ready first bucket waited for the check {r['first_delay_ms']:.2f} ms, step() waited for it {r['check_wait_ms']:.2f} ms (worst rank); autotune (bytes, ms): {r['tuning']}")


if __name__ == "__main__":
    main()
