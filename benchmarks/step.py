"""Training step throughput: elastic_ring.DistributedOptimizer vs torch DistributedDataParallel, per workload.

Every row trains one workload over gloo in the same processes several ways:
``DDP`` (torch's DistributedDataParallel, default settings except
``broadcast_buffers=False``, since DistributedOptimizer does not sync
BatchNorm buffers either), ``DDP view`` (the same with
``gradient_as_bucket_view=True``), ``ours`` (DistributedOptimizer with its
defaults: gradient bucket views, the 1 MiB first bucket, autotuning, the
step's agreement carried in its last bucket), ``A/A`` (a second, identical
copy of ours: what two equal configurations differ by in this run),
``ours strict`` (``strict_checks=True``: a 48-byte check collective before
every step's buckets), optionally ``ours fixed`` (``--fixed``:
``autotune=False``, 16 MiB buckets), and ``local``, the same model and
optimizer without any communication, which is the floor: ``DDP / local`` is
the most any data-parallel reducer could gain over DDP on that row. All start
from the same weights and see the same data. Blocks of steps alternate between
them (in an order shuffled from block to block) so that machine noise hits all
alike; ours is first warmed up until its autotuner has chosen.

The verdict (``benchmarks/_verdict.py``): the faster of DDP's two
configurations is chosen **once per row**, by its median over all blocks; a
block's ratio is that DDP's median step time / ours; a row's ratio is the
median over blocks (>= 1.0: at least as fast as the faster DDP). The A/A
column's ratio against ours measures the run's own noise; each row says
whether ours is ``ahead``, ``behind``, or ``within A/A`` (inside that band).
Beside the times, two measures that a loaded machine does not move: CPU
seconds per step (``getrusage`` inside every rank process, all its threads,
summed over the ranks) and Python calls per step (``benchmarks/_pycalls.py``,
counted on rank 0 after the timed blocks), with the target ``DDP + 2 per
parameter``. A last table splits the median step into forward, backward (DDP
waits for its allreduces at the end of backward) and ``step()`` (ours waits
for its buckets there).

    python -m benchmarks.step [--rows mlp4x1024@2 mlp4x1024@3 mlp10x2048@2 resnet18@2] [--blocks 15] [--steps 3] [--device cuda] [--ddp-probe] [--fixed] [--no-strict] [--hotpath inline thread] [--timeout-s 600]

A row at world 1 (e.g. ``mlp4x1024@1``) compares with the plain, unwrapped optimizer instead of DDP: the cost of wrapping.

``--device cuda`` runs the same table on ONE GPU: every rank on CUDA device 0, DDP over torch's NCCL
process group, ours over elastic_ring's NCCL backend, both on NCCL's socket transport on loopback
(``elastic_ring.backends.nccl.communicator.shared_gpu_env``; NCCL refuses two ranks of a ring on one GPU otherwise). Each step
ends with ``torch.cuda.synchronize()``; the phase split is then host time (launches), not GPU time.
``--hotpath MODE...`` (CUDA) adds a column per mode, ``hot:inline`` and ``hot:thread``: ours with that NCCL
bucket path (docs/gpu.md; ours without it takes the default path, today's), interleaved with the others.
``--no-strict`` leaves the ``strict`` column out (a shorter run).

``--ddp-probe`` adds a copy: DDP plus one 48-byte MAX allreduce per step, read on the host after
``step()``, which is what our per-step check (alignment and the step's transaction vote) adds to a
step. Its throughput relative to DDP prices the check on that transport.
"""

from __future__ import annotations

import argparse
import datetime
import random
import resource
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

import elastic_ring as er
from benchmarks import _verdict
from benchmarks._launch import run_ranks
from benchmarks._needs import Results, require_nccl
from benchmarks._pycalls import CallCounter
from benchmarks._step_report import print_tables
from benchmarks._workloads import WORKLOADS, Workload, mlp, model_of, resnet18  # noqa: F401  (re-exported)

_model = model_of  # the name other benchmarks import
DEFAULT_ROWS = ["mlp4x1024@2", "mlp4x1024@3", "mlp10x2048@2", "resnet18@2"]
PHASES = ("forward", "backward", "step")
OURS_KINDS = ("ours", "aa", "strict", "fixed", "hot:inline", "hot:thread")


@dataclass(frozen=True)
class Options:
    steps: int = 3
    blocks: int = 15
    fixed: bool = False
    max_warmup: int = 60
    fixed_first: int | None = None
    device: str = "cpu"
    ddp_probe: bool = False
    hotpath: tuple[str, ...] = ()
    count_steps: int = 3
    strict: bool = True
    timeout_s: float = 600.0


def _noop() -> None:
    pass


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank process
    return usage.ru_utime + usage.ru_stime


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


def _calls_per_step(model, opt, data, loss_fn, n, sync) -> float:
    """Python calls of ``n`` steps of one method (after its timed blocks), per step."""
    start = getattr(opt, "batches_seen", 0)
    opt.batches_seen = start + n
    with CallCounter() as counter:
        for i in range(start, start + n):
            x, y = data[i % len(data)]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            sync()
    return counter.calls / n


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


def _methods(workload: Workload, world: int, dev: torch.device, cuda: bool, opts: Options) -> dict:
    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731

    def fresh() -> torch.nn.Module:
        return model_of(workload).to(dev)

    def ours(**kwargs):
        model = fresh()
        return model, er.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), **kwargs)

    ddp = _ddp(fresh(), False, cuda) if world > 1 else fresh()
    ddp_view = _ddp(fresh(), True, cuda) if world > 1 else fresh()
    local = fresh()
    methods = {"ddp": (ddp, sgd(ddp.parameters())), "ddp_view": (ddp_view, sgd(ddp_view.parameters())),
               "ours": ours(), "aa": ours(), "local": (local, sgd(local.parameters()))}
    if opts.strict:
        methods["strict"] = ours(strict_checks=True)
    if opts.fixed:
        methods["fixed"] = ours(autotune=False, first_bucket_bytes=opts.fixed_first)
    for mode in opts.hotpath:
        methods[f"hot:{mode}"] = ours()
        methods[f"hot:{mode}"][1]._er_reducer.bucket_mode = mode
    if opts.ddp_probe and world > 1:
        probed = _ddp(fresh(), False, cuda)
        methods["probe"] = (probed, _Probed(sgd(probed.parameters()), dev))
    return methods


def _bench(name: str, port: int, opts: Options) -> dict:
    workload = WORKLOADS[name]
    rank, world = er.rank(), er.size()
    cuda = opts.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else _noop
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"ddp/{name}/{world}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(workload.batch, *workload.input_shape, generator=g).to(dev),
             torch.randint(0, 10, (workload.batch,), generator=g).to(dev)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss()
    methods = _methods(workload, world, dev, cuda, opts)
    tuned = [k for k in methods if k in OURS_KINDS and k != "fixed"]
    warmup = 0
    while (any(methods[k][1].autotune_result is None for k in tuned) and warmup < opts.max_warmup and world > 1):
        warmup += 1
        for key in tuned:
            _train(*methods[key], data, loss_fn, 1, sync=sync)
    for key in methods:  # the same number of steps on every model, so their parameters can be compared
        _train(*methods[key], data, loss_fn, (2 if key in tuned else warmup + 2), sync=sync)
    keys = list(methods)
    times: dict[str, list[list[float]]] = {k: [] for k in keys}
    cpu = {k: 0.0 for k in keys}
    phases: dict[str, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in keys}
    for block in range(opts.blocks):
        order = list(keys)
        random.Random(block).shuffle(order)  # the same order on every rank; no method always follows another
        for key in order:
            model, opt = methods[key]
            er.barrier()
            before = _cpu_seconds()
            times[key].append(_train(model, opt, data, loss_fn, opts.steps, phases[key], sync=sync))
            cpu[key] += _cpu_seconds() - before
    calls = {}
    for key in keys:
        er.barrier()
        calls[key] = _calls_per_step(*methods[key], data, loss_fn, opts.count_steps, sync)
    baseline = methods["ddp"][0]
    diff = max(max((a - b).abs().max().item() for a, b in zip(baseline.parameters(), methods[k][0].parameters()))
               for k in keys if k in OURS_KINDS)
    dist.destroy_process_group()
    reducer = methods["ours"][1]._er_reducer
    result = methods["ours"][1].autotune_result
    return {
        "times": times,
        "cpu_s_per_step": {k: cpu[k] / (opts.blocks * opts.steps) for k in keys},
        "calls": calls,
        "calls_scope": CallCounter().scope,
        "phases": {k: {p: statistics.median(v) for p, v in ph.items()} for k, ph in phases.items()},
        "max_param_diff": diff,
        "chosen": None if result is None else result.chosen_bytes,
        "tuning": None if result is None else list(zip(result.candidates, result.step_ms)),
        "warmup_steps": warmup,
        "check_wait_ms": reducer.check_wait_s * 1e3 / max(1, reducer._ring_steps),
        "first_delay_ms": reducer.first_bucket_delay_s * 1e3 / max(1, reducer._ring_steps),
    }


def _row(name: str, world: int, opts: Options) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_ranks(_bench, world, name, store.port, opts, backend="nccl" if opts.device == "cuda" else "gloo",
                        collective_timeout_s=opts.timeout_s)
    r0 = results[0]
    times = r0["times"]
    med = statistics.median
    chosen = _verdict.faster_config({"ddp": times["ddp"], "ddp_view": times["ddp_view"]})
    ddp_blocks = times[chosen]

    def ratio_of(key: str) -> float | None:
        return med(_verdict.block_ratios(ddp_blocks, times[key])) if key in times else None

    ratios = _verdict.block_ratios(ddp_blocks, times["ours"])
    aa = _verdict.block_ratios(times["aa"], times["ours"])
    band = _verdict.aa_band(aa)
    ratio = med(ratios)
    flat = lambda blocks_: med([t for b in blocks_ for t in b]) * 1e3  # noqa: E731
    params = list(model_of(WORKLOADS[name]).parameters())
    hot = {key: ratio_of(key) for key in times if key.startswith("hot:")}
    return {"name": name, "world": world, "mib": sum(p.numel() for p in params) * 4 / 2**20, "params": len(params),
            "ddp_chosen": "view" if chosen == "ddp_view" else "default", "ddp_ms": flat(ddp_blocks),
            "ours_ms": flat(times["ours"]), "local_ms": flat(times["local"]),
            "bound": med(_verdict.block_ratios(ddp_blocks, times["local"])),
            "ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios), "blocks": len(ratios),
            "aa_ratio": med(aa), "band": band, "verdict": _verdict.verdict(ratio, band),
            "strict_ratio": ratio_of("strict"), "fixed_ratio": ratio_of("fixed"), "probe_ratio": ratio_of("probe"),
            "hot": {key: (ratio, _verdict.verdict(ratio, band)) for key, ratio in hot.items()},
            "chosen": r0["chosen"], "tuning": r0["tuning"], "warmup": r0["warmup_steps"],
            "diff": max(r["max_param_diff"] for r in results), "phases": r0["phases"],
            "cpu_ms": {k: sum(r["cpu_s_per_step"][k] for r in results) * 1e3 for k in times},
            "calls": r0["calls"], "calls_scope": r0["calls_scope"],
            "check_wait_ms": max(r["check_wait_ms"] for r in results),
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
    parser.add_argument("--hotpath", nargs="+", choices=("inline", "thread"), default=[],
                        help="cuda: also time ours with these NCCL bucket paths (docs/gpu.md)")
    parser.add_argument("--no-strict", action="store_true", help="leave out the strict_checks=True column")
    parser.add_argument("--count-steps", type=int, default=3, help="steps per method whose Python calls are counted")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="the rings' collective_timeout_s: a hung collective fails the row after it")
    args = parser.parse_args()
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be > 0")
    if args.device == "cuda":
        require_nccl(benchmark="benchmarks.step", why="--device cuda (ours over elastic_ring's NCCL)",
                     skip="--device cpu")
    elif args.hotpath:
        parser.error("--hotpath is a path of the NCCL backend: use it with --device cuda")
    if args.steps < 1 or args.blocks < 1 or args.count_steps < 1:
        parser.error("--steps, --blocks and --count-steps must be >= 1")
    specs = []
    for spec in args.rows:
        name, _, world = spec.partition("@")
        if name not in WORKLOADS or not world.isdigit() or int(world) < 1:
            parser.error(f"--rows {spec!r}: use WORKLOAD@WORLD with WORKLOAD one of {', '.join(WORKLOADS)}")
        specs.append((name, int(world)))
    opts = Options(steps=args.steps, blocks=args.blocks, fixed=args.fixed, max_warmup=args.max_warmup,
                   fixed_first=None if args.fixed_first_mib is None else int(args.fixed_first_mib * 2**20),
                   device=args.device, ddp_probe=args.ddp_probe, hotpath=tuple(args.hotpath), count_steps=args.count_steps,
                   strict=not args.no_strict, timeout_s=args.timeout_s)
    rows: list[dict] = []
    for name, world in specs:  # a row that fails prints the tables of the rows before it, then the failure
        with Results("benchmarks.step").part(f"row {name}@{world}",
                                             partial=lambda: print_tables(rows, args, partial=False) if rows else None):
            rows.append(_row(name, world, opts))
        print_tables(rows, args, partial=True)
    print_tables(rows, args, partial=False)


if __name__ == "__main__":
    main()
