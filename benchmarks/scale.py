"""How forming a ring, re-forming it, and recovering from a lost worker cost as the world grows.

Part 1 (plain processes, no Ray): ``world`` processes form a gloo ring with
``er.init`` (round 1: a fresh process's first ring, store connection
included), then re-form it ``--reforms`` times in the same processes (each
``er.init`` aborts the previous round's communicator and forms the next, which
is what survivors do after a failure or a membership change). Each time is
measured from the moment the store releases every process (as a driver does
when it hands out a ring) until the last rank has formed, followed by one
barrier on the new ring. Prints the medians per world size, the least-
squares slope in milliseconds per rank, and the fitted exponent ``k`` of
``re-form ≈ c · world^k`` (log-log least squares over the worlds of 8 ranks and
more, where the fixed costs no longer dominate; all worlds when fewer are given).
``--pairs eager lazy`` forms each world's rings both ways in the same run, one
mode after the other (``ELASTIC_RING_GLOO_LAZY``: gloo's full mesh at
construction, or pairs connected at first use; docs/performance.md), and prints
their ratio. The ranks are processes forked from a forkserver that preloaded
torch (each costs a few MiB, so 64 fit on this VM); a fresh rank's first store
connection may stall 5 s on this VM's reverse DNS (docs/performance.md), which
only the first ring can show.

Part 2 (Ray, ``ElasticTrainer``): ``world`` workers train a small MLP; one
SIGKILLs itself at step 20. Recovery is the time from the kill to the
survivors' first completed step in the new ring (as benchmarks/recovery.py).

Both are drawn into ``--png`` (default docs/scale.png; the numbers go to the
same name with ``.json``, and ``--replot JSON`` redraws). On this 2-core machine
every process shares two cores, so large worlds measure CPU contention as
much as the protocol: read the slope as an upper bound.

    python -m benchmarks.scale [--worlds 2 4 8 16 32] [--reforms 3] [--recovery-worlds 2 4 6 8] [--skip-recovery]
                               [--pairs eager lazy] [--no-png]

``--backend nccl`` runs part 1 only, with every rank on GPU 0 (NCCL's socket transport on loopback,
``elastic_ring.backends.nccl.communicator.shared_gpu_env``), and prints the table without drawing: one GPU time-slices its
ranks, so read it as what forming and aborting NCCL communicators costs, not as a multi-GPU figure.

Drawing needs matplotlib (``pip install -e '.[examples]'``), ``--backend nccl`` CUDA and libnccl
(``.[gpu]``): both are checked before anything runs. Results are printed as measured; if part 2
fails, part 1's numbers and the recovery measured so far are printed as JSON with the failure (exit
status 1; ``--png`` and its JSON are left as they were).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pathlib
import signal
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import elastic_ring as er
from benchmarks._launch import backend_fields, new_secret, ring_spec
from benchmarks._needs import INSTALL, Results, require, require_nccl

ROOT = pathlib.Path(__file__).resolve().parents[1]
KILL_STEP = 20


# ---------------------------------------------------------------- part 1: form and re-form

def _member(rank: int, world: int, port: int, secret: bytes | None, rounds: int, queue, backend: str,
            pairs: str | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra = backend_fields(backend, rank)
    torch.set_num_threads(1)
    if pairs is not None:  # the same switch as ELASTIC_RING_GLOO_LAZY, read when a ring forms
        from elastic_ring.core import constants

        constants.GLOO_LAZY_PAIRS = pairs == "lazy"
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        formed = []
        for r in range(rounds):
            store.add(f"ready/{r}", 1)
            store.wait([f"go/{r}"])
            er.init(ring_spec(secret, round_id=r + 1, rank=rank, world_size=world, node_ids=("localhost",) * world,
                              store=er.StoreAddress("127.0.0.1", port), job_id=f"scale-{world}", **extra))
            formed.append(time.time())
            er.barrier()
            store.add(f"done/{r}", 1)
        er.shutdown()
        queue.put((rank, formed, None))
    except Exception as exc:  # handed to the parent, which raises it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _counter(store: dist.TCPStore, key: str) -> int:
    return int(store.add(key, 0))


def _wait_count(store: dist.TCPStore, key: str, n: int, deadline: float, what: str) -> None:
    while _counter(store, key) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: only {_counter(store, key)} of {n} processes within the deadline")
        time.sleep(0.001)


def _context() -> "mp.context.BaseContext":
    """A forkserver that imported torch and elastic_ring once: its children share those pages (64 spawned ranks
    would each import torch, ~150 MiB and seconds of CPU apiece on this 2-core VM)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a rank waiting for the release warns every second
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "elastic_ring", __name__])
    return ctx


def form_times(world: int, reforms: int, timeout_s: float = 600.0, backend: str = "gloo",
               pairs: str | None = None) -> tuple[float, list[float]]:
    """Seconds to form the first ring of ``world`` fresh processes, and each re-form after it. ``pairs``:
    ``"eager"`` or ``"lazy"`` gloo pairs (None: the default of the code under test)."""
    ctx = _context() if backend == "gloo" else mp.get_context("spawn")  # NCCL: no CUDA state before the fork
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    rounds = reforms + 1
    secret = new_secret()
    procs = [ctx.Process(target=_member, args=(r, world, store.port, secret, rounds, queue, backend, pairs),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    released = []
    try:
        for r in range(rounds):
            _wait_count(store, f"ready/{r}", world, deadline, f"world {world} round {r + 1}: ready")
            released.append(time.time())
            store.set(f"go/{r}", "1")
            _wait_count(store, f"done/{r}", world, deadline, f"world {world} round {r + 1}: formed")
        replies = [queue.get(timeout=max(1.0, deadline - time.monotonic())) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {rank}: {err}" for rank, _, err in replies if err]
    if errors:
        raise RuntimeError(f"world {world}: " + "; ".join(errors))
    last = [max(formed[r] for _, formed, _ in replies) for r in range(rounds)]
    times = [t - go for t, go in zip(last, released)]
    return times[0], times[1:]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; returns (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


#: The exponent is fitted over worlds of at least this many ranks (below, fixed costs flatten the curve).
EXPONENT_FROM = 8


def power_fit(xs: list[float], ys: list[float], start: float = EXPONENT_FROM) -> tuple[float, float, list[float]]:
    """``y ≈ c · x^k`` by least squares on logarithms, over the points with ``x >= start`` (all points when
    fewer than two are); returns (c, k, the xs used). Every y must be positive."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"power_fit needs two or more (x, y) points, got {len(xs)} xs and {len(ys)} ys")
    if any(x <= 0 for x in xs) or any(y <= 0 for y in ys):
        raise ValueError("power_fit needs positive xs and ys (it fits their logarithms)")
    chosen = [(x, y) for x, y in zip(xs, ys) if x >= start]
    if len({x for x, _ in chosen}) < 2:
        chosen = list(zip(xs, ys))
    if len({x for x, _ in chosen}) < 2:
        raise ValueError("power_fit needs two or more distinct xs")
    a, k = fit([math.log(x) for x, _ in chosen], [math.log(y) for _, y in chosen])
    return math.exp(a), k, [x for x, _ in chosen]


def curve(name: str, worlds: list[int], times: list[float]) -> str:
    """One line: the linear slope and the fitted exponent of ``times`` against ``worlds``."""
    _, slope = fit(worlds, times)
    c, k, used = power_fit(worlds, times)
    return (f"{name}: {slope * 1e3:.1f} ms/rank (least squares), exponent {k:.2f} "
            f"(≈ {c * 1e3:.3g} ms · ranks^{k:.2f}, fitted on {used[0]}–{used[-1]} ranks)")


# ---------------------------------------------------------------- part 2: recovery with Ray

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def recovery_job(config: dict):
    from state import ElasticSampler, TorchState

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g)
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    state = TorchState(model=model, optimizer=opt, sampler=ElasticSampler(4096, batch_size=16, seed=0), step=0)

    @er.elastic.run
    def loop(state):
        for batch in state.sampler:
            if er.round_id() == 1 and er.rank() == er.size() - 1 and state.step == KILL_STEP:
                pathlib.Path(config["kill_file"]).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step >= config["steps"]:
                break
            idx = torch.tensor(batch, dtype=torch.long)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
            state.sampler.record_batch()
            state.step += 1
            er.report(step=state.step)
            state.commit()
            time.sleep(config["step_delay_s"])
        return state.step

    return loop(state)


def recovery_time(world: int, step_delay_s: float) -> tuple[float, float | None]:
    """(kill to the survivors' first step in the new ring, the driver's own 'recovered' seconds)."""
    from ray_integration import ElasticTrainer

    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        result = ElasticTrainer(min_workers=max(1, world - 1), max_workers=world, progress=False).run(
            recovery_job, config={"kill_file": kill_file, "step_delay_s": step_delay_s, "steps": KILL_STEP + 30})
        killed_at = float(pathlib.Path(kill_file).read_text())
    after = [m["time"] for m in result.metrics_history if m["round"] is not None and m["round"] > 1]
    recovered = [e.detail.get("seconds") for e in result.events if e.kind == "recovered"]
    return min(after) - killed_at, (recovered[0] if recovered else None)


# ---------------------------------------------------------------- main

def draw(path: pathlib.Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds, first, reform = data["worlds"], data["first"], data["reform"]
    recovery = {int(k): v for k, v in data.get("recovery", {}).items()}
    a, b = fit(worlds, reform)
    panels = 2 if recovery else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 3.9), squeeze=False)
    ax = axes[0][0]
    ax.plot(worlds, first, "o-", color="tab:blue", label="first ring (fresh processes)")
    ax.plot(worlds, reform, "s-", color="tab:orange", label="re-form (median of 3)")
    shown = [w for w in worlds if a + b * w > 0]  # the axis is logarithmic: draw the fit where it is positive
    ax.plot(shown, [a + b * w for w in shown], ":", color="tab:orange", lw=1,
            label=f"re-form fit: {a * 1e3:.0f} ms + {b * 1e3:.1f} ms/rank")
    ax.set(xlabel="ranks (processes on one 2-core VM)", ylabel="seconds (log)", title="gloo ring formation, no Ray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.legend(fontsize=8)
    if recovery:
        rx = sorted(recovery)
        ra, rb = fit(rx, [recovery[w] for w in rx])
        ax2 = axes[0][1]
        ax2.plot(rx, [recovery[w] for w in rx], "o-", color="tab:green", label="kill → first step in the new ring")
        ax2.plot(rx, [ra + rb * w for w in rx], ":", color="tab:green", lw=1, label=f"fit: {rb * 1e3:.0f} ms/worker")
        ax2.set(xlabel="Ray workers (one SIGKILLed)", ylabel="seconds", title="recovery, ElasticTrainer")
        ax2.set_ylim(bottom=0)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--reforms", type=int, default=3)
    parser.add_argument("--recovery-worlds", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--step-delay-s", type=float, default=0.02)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--png", default=str(ROOT / "docs" / "scale.png"))
    parser.add_argument("--replot", metavar="JSON", help="only redraw --png from the numbers a previous run saved")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: part 1 only, every rank on GPU 0; prints, does not draw")
    parser.add_argument("--pairs", nargs="+", choices=("eager", "lazy"),
                        help="gloo pairs to measure, one mode after the other for each world (default: the code's)")
    parser.add_argument("--no-png", action="store_true", help="print only: do not draw --png or write its JSON")
    args = parser.parse_args()
    if args.backend == "nccl":
        require_nccl(benchmark="benchmarks.scale", why="--backend nccl", skip="--backend gloo")
    elif not args.no_png:
        require("matplotlib", benchmark="benchmarks.scale", why=f"drawing {args.png}", install=INSTALL["matplotlib"])
    if args.replot:
        draw(pathlib.Path(args.png), json.loads(pathlib.Path(args.replot).read_text()))
        print(f"wrote {args.png}")
        return
    if any(w < 2 for w in args.worlds + args.recovery_worlds):
        parser.error("world sizes must be >= 2")

    modes: list[str | None] = list(args.pairs) if args.pairs and args.backend == "gloo" else [None]
    first: dict[str | None, list[float]] = {m: [] for m in modes}
    reform: dict[str | None, list[float]] = {m: [] for m in modes}
    print(f"load average {os.getloadavg()[0]:.1f} before part 1", flush=True)
    print(f"{'ranks':>5} {'pairs':>7} {'first ring s':>13} {'re-form s (median)':>19}  re-forms", flush=True)
    for world in args.worlds:
        for mode in modes:
            f, rs = form_times(world, args.reforms, backend=args.backend, pairs=mode)
            first[mode].append(f)
            reform[mode].append(statistics.median(rs))
            print(f"{world:>5} {mode or 'default':>7} {f:>13.3f} {reform[mode][-1]:>19.4f}  "
                  f"{' '.join(f'{r:.4f}' for r in rs)}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} after part 1", flush=True)
    for mode in modes:
        label = f" ({mode} pairs)" if mode else ""
        print(curve(f"re-form{label}", args.worlds, reform[mode]), flush=True)
        print(curve(f"first ring{label}", args.worlds, first[mode]), flush=True)
    if len(modes) == 2:
        a, b = modes
        print(f"re-form {a}/{b} at {args.worlds[-1]} ranks: {reform[a][-1] / reform[b][-1]:.1f}x", flush=True)
    shown = modes[-1]

    if args.backend == "nccl":
        print(f"NCCL on one GPU ({torch.cuda.get_device_name(0)}), every rank on device 0; not drawn")
        return
    recovery: dict[int, float] = {}
    data = {"worlds": args.worlds, "first": first[shown], "reform": reform[shown], "recovery": recovery}
    saved = pathlib.Path(args.png).with_suffix(".json")

    def measured() -> None:  # printed, not saved: a partial run must not replace the last whole one's JSON
        print(json.dumps(data))

    if not args.skip_recovery:
        import ray

        with Results("benchmarks.scale").part("part 2 (recovery)", partial=measured):
            ray.init(num_cpus=max(args.recovery_worlds) + 2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
            try:
                print(f"\n{'workers':>7} {'recovery s':>11} {'driver recovered s':>19}", flush=True)
                for world in args.recovery_worlds:
                    seconds, reported = recovery_time(world, args.step_delay_s)
                    recovery[world] = seconds
                    print(f"{world:>7} {seconds:>11.3f} {'-' if reported is None else f'{reported:.3f}':>19}",
                          flush=True)
            finally:
                ray.shutdown()
        a, b = fit(list(recovery), list(recovery.values()))
        print(f"recovery slope: {b * 1e3:.1f} ms/worker (intercept {a:.3f} s)")
    if args.no_png:
        return
    saved.write_text(json.dumps(data, indent=1))
    draw(pathlib.Path(args.png), data)
    print(f"wrote {args.png} and {saved}")


if __name__ == "__main__":
    main()
