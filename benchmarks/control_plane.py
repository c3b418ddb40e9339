"""The control plane at N workers: the real driver and the real store against N simulated workers.

    python -m benchmarks.control_plane [--workers 16 64] [--steady-s 4] [--profile DIR]
    python -m benchmarks.control_plane --workers 32 128 512 1024 [--sim-procs P]   (P processes host the simulated workers)
    python -m benchmarks.control_plane --workers 32 128 512 --heartbeats worker   (or node; default auto)
    python -m benchmarks.control_plane --costs 32 128 512 1024   (the driver's pieces, one process)
    python -m benchmarks.control_plane --burst 128 512 1024   (a loss's re-form by the driver alone)
    python -m benchmarks.control_plane --ray-calls 127 511 1023   (a notice to every member: Ray calls vs the store)

Prints one line per N::

    workers=N driver_cpu_per_s=… loss_to_spec_s=… store_ops_per_reform=… notice_to_all_s=… heartbeat_lag_s=… … heartbeats=…

then, over the Ns, the exponent of each figure (``figure ≈ c · N^k``, log-log least squares): above 1 grows
faster than the workers.

**Real** (imported and run unchanged): the driver's loop, states, decisions and ring formation
(``ray_integration.driver.loop.Driver.run``), the pool's records and message handling (``WorkerPool.apply``,
``answer``, ``stop``, ``inbox_backlog``) and its notices (``notify``, ``tell_preemption``, ``abort_round``: sealed
pushes into each worker's queue, as in a job since 2026-11-28), the mailroom and the old rounds' key cleanup as ``ElasticTrainer`` wires
them (``on_tick``), the inbox thread and the acknowledgements of waiting workers (``wire.channel.Inbox``,
``mailroom.Acknowledger``), the workers' per-node heartbeats (``worker.node_beats.NodeBeats``, real files, with
``--heartbeats node``), sealed messages (``wire.channel.Channel``), the store server
(``elastic_ring.ring.store.StoreServer``, libuv, in the driver's process as in a job), ``RingSpec`` encoding and the
workers' validation of it, the formation's arrival barrier (``arrival.announce_arrival``) and a lazy gloo ring's
address keys. **Simulated**: Ray (actor creation, completions, kills, probes, the drain list:
:mod:`benchmarks._control_pool`), and the workers (:mod:`benchmarks._control_workers`: heartbeats at the real
cadence, ring requests, rank 0's reports at ``--report-hz``, a receiving thread per worker that reads its queue as
a worker's mailbox thread does, the formation's store traffic; no ``fn``, no gloo sockets), hosted by a few processes (each worker
has its own receiving connection; one connection per process sends). Connections open in parallel before any clock
starts (a new connection may stall 5 s on this VM's reverse DNS).

The scenario, per N (8 workers per node, Ray-sized node ids): the first ring; a steady state; ``--losses`` times
the loss of the last rank (Ray reports its actor dead and the survivors ask for a ring at that instant, as their
collective fails) and the join of its replacement, each from a ring at rest (every worker heard within two
intervals); a node draining (Ray's drain list) and its replacements joining. The simulated workers' processes run
at ``--sim-nice`` (default 10) below the driver's: in a job they run on other machines; at 0 they starve the
driver's process on this VM's 2 cores, at 19 they starve themselves during a re-form at 1,024.

* ``driver_cpu_per_s``: the driver process's CPU seconds per second in the steady state (loop, inbox and store
  server threads; the scenario's own threads left out); ``loop_cpu_per_s`` the loop thread's share,
  ``inbox_cpu_per_s`` the inbox thread's (the rest: the store server's thread, Ray's watcher).
* ``loss_to_spec_s``: from the loss to the last survivor's ring answer pushed to its queue (the median over the
  losses, ``loss_to_spec_max_s`` the slowest; the figures below and ``join_to_spec_s`` are medians too). Since
  2026-11-28 the driver answers the survivors of a loss whose cause it knows before they ask
  (``decisions.prompt_ring``): ``loss_to_aborted_s`` until its re-form step had pushed the abort to every survivor
  (its ``worker_lost`` event), ``answered_ahead`` survivors were answered so (the others' requests came first);
  ``requests_sent_s`` (until the last survivor sent its ring request: the simulated workers' side, on the shared
  cores) and ``loss_to_requests_s`` (until the driver applied it: the inbox's backlog included) are the requests'
  trip that the answers no longer wait for.
* ``store_ops_per_reform`` / ``store_bytes_per_reform``: every store operation (and key and value bytes) of that
  re-form, from the loss until every survivor went through the formation's store traffic, driver and workers,
  heartbeats and reports left out.
* ``notice_to_all_s``: from Ray marking the node draining to the last member receiving the driver's notice (the
  driver polls the drain list every 0.2 s); its parts ``drain_seen_s`` (until the driver's poll saw it) and
  ``seen_to_notified_s`` (until the driver pushed its last notice); the rest is the simulated workers' receiving.
* ``heartbeat_lag_s``: median, and ``heartbeat_lag_p99_s``, from a worker sending a heartbeat (or a node's
  forwarder sending its ``node_hb``) to the driver's loop applying it, in the steady state.
* ``steps_per_s`` and ``ms_per_step``: how often the loop stepped its state in the steady state, and the median
  CPU time of one step; ``msgs_per_s``: heartbeat messages (``hb`` and ``node_hb``) and reports applied per second.
* also: ``start_to_spec_s`` (the first ring), ``join_to_spec_s`` (from the loss's replacement starting, once the
  loss's re-form was measured, to its ring answer), ``drain_to_spec_s`` (from the drain to the ring without the
  node; the replacements are held back).

The machine is shared: read the exponents and ratios, and the load average printed with each line.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import statistics

from benchmarks._control_scenario import FIELDS, PER_NODE, RESERVE


def format_line(n: int, figures: dict[str, float]) -> str:
    parts = [f"workers={n}"]
    for name in FIELDS:
        value = figures.get(name)
        if value is None:
            continue
        parts.append(f"{name}={value:.0f}" if name.startswith("store_") else f"{name}={value:.4g}")
    return " ".join(parts)


def parse_line(line: str) -> tuple[int, dict[str, float]]:
    """The N and the figures of a :func:`format_line` line."""
    fields = dict(part.split("=", 1) for part in line.split())
    if "workers" not in fields:
        raise ValueError(f"not a control_plane result line: {line!r}")
    fields.pop("heartbeats", None)  # (worker | node: the mode measured)
    return int(fields.pop("workers")), {k: float(v) for k, v in fields.items()}


def exponent(ns: list[int], values: list[float]) -> float | None:
    """k of ``value ≈ c · n^k`` (least squares on logarithms); None without two positive points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v is not None and v > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


# ---------------------------------------------------------------- main
def run_one(n: int, opts: dict) -> dict:
    """One N in a fresh driver process (its CPU is the driver's alone)."""
    from benchmarks._control_scenario import driver_main

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=driver_main, args=(n, opts, out))
    proc.start()
    try:
        result = out.get(timeout=opts["timeout_s"])
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if "error" in result:
        raise RuntimeError(f"workers={n}: {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steady-s", type=float, default=4.0, help="length of the steady state measured")
    parser.add_argument("--interval-s", type=float, default=0.5, help="heartbeat interval (the default's)")
    parser.add_argument("--report-hz", type=float, default=10.0, help="rank 0's er.report records per second")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                        help="the driver's silence deadline (the default's); a driver that falls behind its inbox by "
                             "more than this kills healthy workers")
    parser.add_argument("--heartbeats", choices=("auto", "worker", "node"), default="auto",
                        help="ElasticTrainer(heartbeats=...): one message per worker, or per node of 8 forwarded by "
                             "one of its workers through real files (auto: as the product decides at each N)")
    parser.add_argument("--losses", type=int, default=3,
                        help="losses of a rank (each followed by its replacement's join) per N; the loss and join "
                             "figures are their medians (and loss_to_spec_max_s the slowest)")
    parser.add_argument("--sim-nice", type=int, default=10,
                        help="the simulated workers' processes' niceness: in a job the workers run on other machines "
                             "than the driver; 0 makes them compete with the driver for this machine's cores")
    parser.add_argument("--sim-procs", type=int, default=0,
                        help="processes hosting the simulated workers (default 0: one per 128 workers, 2 to 8); each "
                             "worker's receiving thread shares its process's GIL with the others there")
    parser.add_argument("--profile", metavar="DIR", help="cProfile the driver's loop thread; dump DIR/driver-N.prof")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the most one N may take")
    parser.add_argument("--costs", type=int, nargs="+", metavar="N",
                        help="only measure what each piece of the driver's work costs at these N, in one process "
                             "(benchmarks/_control_costs.py), and exit")
    parser.add_argument("--burst", type=int, nargs="+", metavar="N",
                        help="only measure a loss's re-form by the driver alone, the machine to itself, at these N "
                             "(benchmarks/_control_burst.py), and exit")
    parser.add_argument("--ray-calls", type=int, nargs="+", metavar="N",
                        help="only measure what a notice to N members costs the driver as fire-and-forget Ray actor "
                             "calls and as sealed pushes into their store queues, in one run on a local Ray "
                             "(benchmarks/_control_raycalls.py), and exit")
    args = parser.parse_args()
    if args.ray_calls:
        from benchmarks import _control_raycalls

        _control_raycalls.main(args.ray_calls)
        return
    if args.burst:
        from benchmarks import _control_burst

        _control_burst.main(args.burst)
        return
    if args.costs:
        from benchmarks import _control_costs

        _control_costs.main(args.costs)
        return
    if any(n < PER_NODE * 2 for n in args.workers):
        parser.error(f"--workers must be at least {PER_NODE * 2} (a node of {PER_NODE} drains)")
    if not 1 <= args.losses <= RESERVE - PER_NODE:
        parser.error(f"--losses must be between 1 and {RESERVE - PER_NODE} (the idle workers held back "
                     "for the replacements)")
    if not 0 <= args.sim_nice <= 19:
        parser.error("--sim-nice must be between 0 and 19")
    if not 0 <= args.sim_procs <= 64:
        parser.error("--sim-procs must be between 1 and 64 (or 0: the default)")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    opts = {"steady_s": args.steady_s, "interval_s": args.interval_s, "report_hz": args.report_hz,
            "heartbeat_timeout_s": args.heartbeat_timeout_s, "heartbeats": args.heartbeats,
            "losses": args.losses, "sim_nice": args.sim_nice, "sim_procs": args.sim_procs,
            "profile": args.profile, "timeout_s": args.timeout_s}
    rows: dict[int, dict[str, float]] = {}
    failed = False
    for n in args.workers:
        try:
            result = run_one(n, opts)
        except (RuntimeError, TimeoutError, queue.Empty) as exc:  # the next N may still tell something
            print(f"workers={n} FAILED: {str(exc).strip().splitlines()[0]}", flush=True)
            failed = True
            continue
        rows[n] = {k: v for k, v in result.items() if k in FIELDS and v is not None}
        print(format_line(n, rows[n]) + f" heartbeats={result['heartbeats']}", flush=True)
        if result.get("profile"):
            print(result["profile"], flush=True)
    if len(rows) > 1:
        ns = sorted(rows)
        grows = []
        for name in FIELDS[:-1]:
            k = exponent(ns, [rows[n].get(name) for n in ns])
            if k is not None:
                grows.append(f"{name} {k:.2f}")
        print(f"exponent k of figure ≈ c·N^k over N={ns[0]}–{ns[-1]} (k > 1: faster than the workers): "
              + ", ".join(grows), flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
