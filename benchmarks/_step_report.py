"""The tables ``benchmarks.step`` prints (its rows are dicts made by ``benchmarks.step._row``)."""

from __future__ import annotations

import statistics

import torch

from benchmarks._workloads import WORKLOADS

PHASES = ("forward", "backward", "step")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _hot(r: dict) -> str:
    """The hot paths' ratios, ``inline/thread`` order (``-`` without them)."""
    return "/".join(f"{ratio:.3f}x" for ratio, _ in r["hot"].values()) or "-"


def print_tables(rows: list[dict], args, partial: bool) -> None:
    if partial:
        r = rows[-1]
        print(f"... {r['name']}@{r['world']}: ratio {r['ratio']:.3f} (blocks {r['ratio_min']:.2f}-{r['ratio_max']:.2f}), "
              f"A/A {r['aa_ratio']:.3f} (band +-{r['band']:.3f}): {r['verdict']}; DDP {r['ddp_chosen']}; "
              f"strict {_x(r['strict_ratio'])}; autotune {r['tuning']}"
              + "".join(f"; {key} {ratio:.3f} ({verdict})" for key, (ratio, verdict) in r["hot"].items())
              + ("" if r["probe_ratio"] is None else f", DDP+probe/DDP thr {r['probe_ratio']:.3f}"), flush=True)
        return
    first = "1 MiB (default)" if args.fixed_first_mib is None else f"{args.fixed_first_mib:g} MiB"
    where = ("gloo (CPU)" if args.device == "cpu" else
             f"NCCL on one GPU ({torch.cuda.get_device_name(0)}; every rank on device 0, socket transport on loopback)")
    print(f"\n{where}, {torch.get_num_threads()} threads available, 1 compute thread per rank, {args.blocks} blocks x "
          f"{args.steps} steps per method, interleaved (in a new order every block); DDP = the faster of "
          f"gradient_as_bucket_view=False/True over the whole row; A/A = a second copy of ours; 'strict' = "
          f"strict_checks=True" + (f"; 'fixed' = autotune off, 16 MiB buckets, first bucket {first}" if args.fixed else "")
          + "".join(f"; 'hot:{mode}' = ours with the NCCL bucket path {mode!r}" for mode in args.hotpath))
    print(f"{'workload':<38} {'world':>5} {'params':>6} {'grads MiB':>9} {'DDP':>7} {'DDP ms':>8} {'ours ms':>8} "
          f"{'ours/DDP':>9} {'blocks':>11} {'A/A':>7} {'band':>6} {'verdict':>10} {'strict':>7} {'fixed':>7} "
          f"{'hot':>15} {'autotuned':>9} {'max|dp|':>8} {'local ms':>8} {'DDP/local':>9}")
    for r in rows:
        chosen = "-" if r["chosen"] is None else f"{r['chosen'] / 2**20:g} MiB"
        print(f"{WORKLOADS[r['name']].label:<38} {r['world']:>5} {r['params']:>6} {r['mib']:>9.1f} {r['ddp_chosen']:>7} "
              f"{r['ddp_ms']:>8.1f} {r['ours_ms']:>8.1f} {r['ratio']:>8.3f}x {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
              f"{r['aa_ratio']:>6.3f}x {r['band']:>6.3f} {r['verdict']:>10} {_x(r['strict_ratio']):>7} "
              f"{_x(r['fixed_ratio']):>7} {_hot(r):>15} {chosen:>9} {r['diff']:>8.1e} {r['local_ms']:>8.1f} "
              f"{r['bound']:>8.3f}x")
    ratios = [r["ratio"] for r in rows]
    print(f"median over rows: {statistics.median(ratios):.3f}x; lowest row {min(ratios):.3f}x; verdicts: "
          + ", ".join(f"{r['name']}@{r['world']} {r['verdict']}" for r in rows))
    print("band: the A/A ratio's distance from 1 or 2 standard errors of its median, whichever is larger; "
          "'ahead'/'behind' only outside it")
    for r in rows:
        for key, (ratio, verdict) in r["hot"].items():
            print(f"{r['name']}@{r['world']}: ours with the bucket path {key[4:]!r} {ratio:.3f}x the faster DDP: {verdict}")
    for r in rows:
        if r["probe_ratio"] is not None:
            print(f"{r['name']}@{r['world']}: DDP plus one 48-byte allreduce per step (the price of our check) runs at "
                  f"{r['probe_ratio']:.3f}x DDP's throughput")
    print("DDP/local: how much faster than DDP a step with no communication at all is (the most any reducer could gain)")
    _print_stable(rows)
    _print_phases(rows)


def _print_stable(rows: list[dict]) -> None:
    scope = rows[0]["calls_scope"] if rows else ""
    print(f"\nper step, measures a loaded machine moves less than the times (Python calls not at all): CPU ms (getrusage in every rank process, summed over "
          f"the ranks) and Python calls (rank 0, {scope}); target: ours <= DDP + 2 per parameter")
    print(f"{'row':<16} {'CPU DDP':>8} {'CPU ours':>8} {'CPU A/A':>8} {'CPU local':>9} {'calls DDP':>9} {'ours':>6} "
          f"{'target':>6} {'met':>4} {'strict':>6} {'local':>6} {'hot':>11}")
    for r in rows:
        ddp_key = "ddp_view" if r["ddp_chosen"] == "view" else "ddp"
        cpu, calls = r["cpu_ms"], r["calls"]
        target = calls[ddp_key] + 2 * r["params"]
        hot = "/".join(f"{calls[k]:.0f}" for k in calls if k.startswith("hot:")) or "-"
        strict = f"{calls['strict']:.0f}" if "strict" in calls else "-"
        print(f"{r['name'] + '@' + str(r['world']):<16} {cpu[ddp_key]:>8.1f} {cpu['ours']:>8.1f} {cpu['aa']:>8.1f} "
              f"{cpu['local']:>9.1f} {calls[ddp_key]:>9.0f} {calls['ours']:>6.0f} {target:>6.0f} "
              f"{'yes' if calls['ours'] <= target else 'no':>4} {strict:>6} {calls['local']:>6.0f} {hot:>11}")


def _print_phases(rows: list[dict]) -> None:
    print("\nmedian phase times (ms): forward / backward / step()  -- DDP waits in backward, ours in step()")
    for r in rows:
        ph = r["phases"]
        keys = [k for k in ("ddp", "ddp_view", "ours", "aa", "strict", "fixed", "hot:inline", "hot:thread", "local")
                if k in ph]
        cells = "   ".join(f"{k}: " + " / ".join(f"{ph[k][p] * 1e3:.1f}" for p in PHASES) for k in keys)
        total = " / ".join(f"{sum(ph[k].values()) * 1e3:.1f}" for k in keys)
        print(f"{r['name']}@{r['world']:<3} {cells}   (sums {total}); "
              f"per step: ready first bucket waited for the check {r['first_delay_ms']:.2f} ms, step() waited for it "
              f"{r['check_wait_ms']:.2f} ms (worst rank); autotune (bytes, ms): {r['tuning']}")
