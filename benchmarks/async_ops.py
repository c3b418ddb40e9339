"""The cost of Horovod's ``_async`` semantics: the ordered queue, and the pairing of named operations by name.

    python -m benchmarks.async_ops [--reps 30] [--world 2]

Prints medians (methods interleaved repetition by repetition, so machine noise hits all alike):

1. the synchronous hot path: ``er.allreduce`` of 1 float and of 1 MiB on a communicator with no ``_async``
   queue (the path of a ring that never made an ``_async`` call, unchanged from before the queue existed) and
   with one (every check then calls the queue's ``settle`` hook: a counter read while it is idle); ratio;
2. ``_async`` round trips: ``hvd.allreduce_async`` of 1 float then ``synchronize``, unnamed (queued) and named
   (parked, then one negotiation round at synchronize); ratio;
3. 32 ``hvd.allreduce_async_`` of 256 KiB each, then ``synchronize`` of all, unnamed and named, against one
   synchronous ``hvd.grouped_allreduce_`` of the same tensors;
4. overlap: the same 32 submitted, then ``--compute-ms`` of matrix products, then ``synchronize`` of all:
   unnamed operations move their data during the compute, named ones wait for synchronize.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import elastic_ring as er
from benchmarks._launch import median_ms, run_ranks


def _timed(fn) -> float:
    er.barrier()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _bench(reps: int, compute_ms: float) -> dict[str, list[float]]:
    import ray_integration.horovod as hvd
    from elastic_ring.ring import runtime

    try:
        from elastic_ring.collectives import ordered
    except ImportError:  # a version from before the queue (run it with PYTHONPATH at an older checkout)
        ordered = None
    hvd.init()
    comm = runtime.current()
    one, mib = torch.ones(1), torch.ones(1 << 18)
    hvd.synchronize(hvd.allreduce_async(one))  # makes the ring's queue (and its hook)
    queue = ordered.existing(comm) if ordered is not None else None
    hook = [ref for ref in comm.before_check if queue is not None and getattr(ref(), "__self__", None) is queue]
    grads = [torch.ones(1 << 16) for _ in range(32)]
    a = torch.randn(256, 256)

    def compute() -> None:
        end = time.perf_counter() + compute_ms / 1000
        while time.perf_counter() < end:
            a @ a

    def without_queue(fn):
        def run():
            for ref in hook:
                comm.before_check.remove(ref)
            try:
                fn()
            finally:
                comm.before_check.extend(hook)
        return run

    def many(named: bool, work=None):
        def run():
            handles = [hvd.allreduce_async_(g, name=f"g{i}" if named else None) for i, g in enumerate(grads)]
            if work is not None:
                work()
            for h in handles:
                hvd.synchronize(h)
        return run

    methods = {
        "sync 1 float, no queue": without_queue(lambda: er.allreduce_(one)),
        "sync 1 float, queue": lambda: er.allreduce_(one),
        "sync 1 MiB, no queue": without_queue(lambda: er.allreduce_(mib)),
        "sync 1 MiB, queue": lambda: er.allreduce_(mib),
        "async 1 float unnamed": lambda: hvd.synchronize(hvd.allreduce_async_(one)),
        "async 1 float named": lambda: hvd.synchronize(hvd.allreduce_async_(one, name="x")),
        "32 x 256 KiB grouped sync": lambda: hvd.grouped_allreduce_(grads),
        "32 x 256 KiB unnamed": many(False),
        "32 x 256 KiB named": many(True),
        "compute alone": compute,
        "32 + compute unnamed": many(False, compute),
        "32 + compute named": many(True, compute),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        fn()
    for _ in range(reps):
        for name, fn in methods.items():
            times[name].append(_timed(fn))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    args = parser.parse_args()
    print(f"gloo, {args.world} ranks on {platform.node()}, {args.reps} interleaved reps; medians in ms")
    times = run_ranks(_bench, args.world, args.reps, args.compute_ms)[0]
    m = {name: median_ms(samples) for name, samples in times.items()}
    for name, value in m.items():
        print(f"  {name:<28} {value:9.3f}")
    print(f"ratios: sync 1 float queue/no queue {m['sync 1 float, queue'] / m['sync 1 float, no queue']:.3f}, "
          f"sync 1 MiB queue/no queue {m['sync 1 MiB, queue'] / m['sync 1 MiB, no queue']:.3f}, "
          f"async named/unnamed {m['async 1 float named'] / m['async 1 float unnamed']:.2f}, "
          f"32 named/unnamed {m['32 x 256 KiB named'] / m['32 x 256 KiB unnamed']:.2f}, "
          f"32 unnamed/grouped {m['32 x 256 KiB unnamed'] / m['32 x 256 KiB grouped sync']:.2f}, "
          f"overlap: (32 + compute) - compute, unnamed {m['32 + compute unnamed'] - m['compute alone']:.1f} ms, "
          f"named {m['32 + compute named'] - m['compute alone']:.1f} ms")


if __name__ == "__main__":
    main()
