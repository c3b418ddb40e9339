"""Launch latency of small allreduces: the host microseconds each way of launching costs the caller.

``--world`` ranks share CUDA device 0 (``shared_gpu_env``: NCCL's socket transport on loopback). Each method
launches ``--calls`` allreduces of ``--numel`` float32 elements, in ``--blocks`` blocks interleaved with the
other methods, then waits for them. Per method: the host time of the launch loop per call (what the autograd
thread pays per bucket), and the whole per call including the wait at the end (median over blocks; rank 0, and
the slowest rank). The methods:

* ``torch``: ``dist.all_reduce(t, async_op=True)`` on torch's ProcessGroupNCCL (what DDP launches; its
  communicators are blocking);
* ``collective``: ``comm.allreduce(t, SUM)``, today's default bucket path (``ELASTIC_RING_NCCL_BUCKETS=collective``):
  a checked collective on the non-blocking communicator, settled, a new event and a watchdog entry per call;
  its wait is one ``Work.wait()`` per call;
* ``inline`` / ``thread``: the bucket paths of ``elastic_ring/backends/nccl/bucket_path.py`` (pooled events, one
  watchdog entry and one host wait per batch; ``thread``: the caller only records an event and enqueues);
* ``parent raw``: bare ``ncclAllReduce`` on the non-blocking communicator + ``settle`` (the floor of today's
  launch: what NCCL's in-progress launch costs without our wrapping);
* ``child raw``: bare ``ncclAllReduce`` on a *blocking* child made by ``ncclCommSplit(blocking=1)``: the other
  design of issue 30, measured here so that a GPU run can pick by numbers (docs/gpu.md).

Every method's result is checked once (a sum of ``rank + 1``). ``--device cpu`` is a dry run of the harness over
gloo (``torch``, ``collective`` and gloo's bucket path).

Rank 0 prints a line as each method's warm-up passes and as each block ends (flushed), so a run that stops
shows where. ``--timeout-s`` is the ring's ``collective_timeout_s`` (a hung collective becomes a ``CommError``
then, instead of after the benchmarks' usual 600 s); ``--methods`` runs only some methods (e.g. one lane alone).

    python -m benchmarks.nccl_launch [--calls 1000] [--blocks 4] [--numel 1024] [--world 2] [--device cuda|cpu]
        [--methods torch collective inline thread "parent raw" "child raw"] [--timeout-s 60]
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
from benchmarks._launch import run_ranks
from benchmarks._needs import Results, require_nccl
from elastic_ring.core.ops import ReduceOp


CUDA_METHODS = ("torch", "collective", "inline", "thread", "parent raw", "child raw")


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[nccl_launch] {text}", flush=True)


def _methods(comm, cuda: bool, numel: int, dev: torch.device, chosen: tuple[str, ...] = ()) -> tuple[dict, list]:
    """name -> (tensor, launch() -> token, finish(tokens)); and what to release at the end. ``chosen``: only
    those methods (every rank makes the same choice), else all."""
    methods: dict = {}
    cleanup: list = []

    def tensor() -> torch.Tensor:
        return torch.zeros(numel, device=dev)

    t = tensor()
    methods["torch"] = (t, lambda t=t: dist.all_reduce(t, async_op=True), lambda ws: [w.wait() for w in ws])
    t = tensor()
    methods["collective"] = (t, lambda t=t: comm.allreduce(t, ReduceOp.SUM), lambda ws: [w.wait() for w in ws])
    if not cuda:
        path, t = comm.bucket_path(), tensor()
        methods["gloo path"] = (t, lambda t=t: path.launch(t), path.wait)
        return methods, cleanup
    from elastic_ring.backends.nccl import handle as nccl_handle, lib as nccl_lib, reform as nccl_reform
    from elastic_ring.backends.nccl.handle import settle

    for mode in ("inline", "thread"):
        if chosen and mode not in chosen:
            continue
        path, t = comm.bucket_path(mode), tensor()
        methods[mode] = (t, lambda t=t, p=path: p.launch(t), path.wait)
    handle, stream, timeout_s = comm._handle, comm._stream, comm.spec.collective_timeout_s
    lib = handle.lib

    def raw(h, t: torch.Tensor, settles: bool):
        args = (t.data_ptr(), t.numel(), nccl_lib.FLOAT32, nccl_lib.SUM, stream.cuda_stream)

        def launch():
            status = h.call("allreduce", lib.all_reduce, *args)
            if settles and status == nccl_lib.IN_PROGRESS:
                settle(h, "allreduce", time.monotonic() + timeout_s)
        return launch

    t = tensor()
    methods["parent raw"] = (t, raw(handle, t, True), lambda tokens: stream.synchronize())
    if not chosen or "child raw" in chosen:
        _say(comm.spec.rank, "splitting a blocking child communicator (ncclCommSplit, blocking=1)")
        identity = comm.spec.identity
        child = nccl_reform.split(handle, comm.spec.rank, True, time.monotonic() + 60, identity, 60.0)
        cleanup.append(lambda: nccl_handle.abort(child, identity))
        t = tensor()
        methods["child raw"] = (t, raw(child, t, False), lambda tokens: stream.synchronize())
    if chosen:
        methods = {name: m for name, m in methods.items() if name in chosen or name == "collective"}
    return methods, cleanup


def _bench(calls: int, blocks: int, numel: int, port: int, device: str, chosen: tuple[str, ...] = ()) -> dict:
    rank, world = er.rank(), er.size()
    comm = runtime.current()
    cuda = device == "cuda"
    dev = comm.device
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("launch/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=dev if cuda else None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    methods, cleanup = _methods(comm, cuda, numel, dev, chosen)
    _say(rank, f"ring formed; methods {', '.join(methods)}")
    host: dict[str, list[float]] = {name: [] for name in methods}
    total: dict[str, list[float]] = {name: [] for name in methods}
    per_block = max(1, calls // blocks)
    try:
        for name, (t, launch, finish) in methods.items():  # warm-up and a check of each result
            t.fill_(rank + 1)
            finish([launch()])
            sync()
            expected = world * (world + 1) / 2
            if not torch.all(t == expected):
                raise AssertionError(f"{name}: allreduce gave {t[:4].tolist()}, expected {expected}")
            t.zero_()
            _say(rank, f"warm-up passed: {name}")
        for block in range(blocks):
            for name, (t, launch, finish) in methods.items():
                er.barrier()
                sync()
                started = time.perf_counter()
                tokens = [launch() for _ in range(per_block)]
                launched = time.perf_counter()
                finish(tokens)
                sync()
                done = time.perf_counter()
                host[name].append((launched - started) / per_block * 1e6)
                total[name].append((done - started) / per_block * 1e6)
                _say(rank, f"block {block + 1}/{blocks} {name}: host {host[name][-1]:.1f} us/call, "
                           f"with wait {total[name][-1]:.1f} us/call")
    finally:
        for release in cleanup:
            release()
        dist.destroy_process_group()
    watches = {mode: methods[mode][2].__self__.watch.registrations for mode in ("inline", "thread") if mode in methods}
    return {"host": {k: statistics.median(v) for k, v in host.items()},
            "total": {k: statistics.median(v) for k, v in total.items()}, "per_block": per_block,
            "watch_entries": watches, "waits": blocks + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="allreduces per method (split over the blocks)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per method, interleaved")
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements per allreduce")
    parser.add_argument("--world", type=int, default=2, help="ranks (all on CUDA device 0)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run over gloo")
    parser.add_argument("--methods", nargs="+", choices=CUDA_METHODS, default=[],
                        help="only these methods (cuda; 'collective' always runs: the ratios' base)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="the ring's collective_timeout_s: a hung launch fails after it (default 60)")
    args = parser.parse_args()
    if args.calls < 1 or args.blocks < 1 or args.numel < 1 or args.world < 2 or args.timeout_s <= 0:
        parser.error("--calls, --blocks and --numel must be >= 1, --world >= 2 and --timeout-s > 0")
    if args.methods and args.device != "cuda":
        parser.error("--methods chooses among the CUDA methods: use it with --device cuda")
    if args.device == "cuda":
        require_nccl(benchmark="benchmarks.nccl_launch", why="the NCCL launch paths", skip="--device cpu")
    results = Results("benchmarks.nccl_launch")
    print(f"[nccl_launch] {args.world} ranks, {args.calls} allreduces of {args.numel} float32 per method, "
          f"collective_timeout_s={args.timeout_s:g}", flush=True)
    with results.part("the launch latency run"):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ranks = run_ranks(_bench, args.world, args.calls, args.blocks, args.numel, store.port, args.device,
                          tuple(args.methods), backend="nccl" if args.device == "cuda" else "gloo",
                          collective_timeout_s=args.timeout_s)
    r0 = ranks[0]
    where = (torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU, gloo (dry run)")
    print(f"\n{where}, {args.world} ranks on one device; {r0['per_block']} allreduces of {args.numel} float32 per "
          f"block, {args.blocks} blocks per method, interleaved; medians over blocks")
    print(f"{'method':<12} {'host us/call':>12} {'slowest rank':>12} {'with wait':>10} {'slowest rank':>12} "
          f"{'host vs collective':>18}")
    base = r0["host"]["collective"]
    for name in r0["host"]:
        worst_host = max(r["host"][name] for r in ranks)
        worst_total = max(r["total"][name] for r in ranks)
        print(f"{name:<12} {r0['host'][name]:>12.1f} {worst_host:>12.1f} {r0['total'][name]:>10.1f} "
              f"{worst_total:>12.1f} {r0['host'][name] / base:>17.2f}x")
    for mode, entries in r0["watch_entries"].items():
        print(f"{mode}: {entries} watchdog entries for {r0['waits']} waits of {r0['per_block']} launches "
              "(one per wait expected when the launches outpace the watchdog's 20 ms poll)")


if __name__ == "__main__":
    main()
