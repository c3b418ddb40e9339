"""``python -m benchmarks.control_plane --ray-calls 1023``: what the driver's O(n) Ray actor calls cost it (a notice
or an abort to every member: ``WorkerPool.notify`` / ``abort_round``), on a local Ray.

Starts its own Ray (``address="local"``; never another's), 8 actors of 0 CPUs standing in for the members (this VM
cannot hold 1,023 worker processes), and makes N fire-and-forget calls round-robin over them, as the driver's loop
does, one per member. Measured (wall, medians of 5):

* ``submit_ms``: the loop's own time to submit the N calls (what a notice to every member costs the driver);
* ``delivered_ms``: until every call ran in its actor (8 actors serve N/8 calls each: an upper bound on a real
  job's delivery, where each of the N workers serves its one call in parallel);
* ``per_call_us``: ``submit_ms`` per call.
"""

from __future__ import annotations

import statistics
import time

ACTORS = 8
REPS = 5


def measure(n: int) -> dict[str, float]:
    import ray

    @ray.remote(num_cpus=0)
    class Member:
        def __init__(self) -> None:
            self.notices = 0

        def notify(self, round_id: int, change: bool, persist: bool, stop: bool) -> None:
            self.notices += 1

        def count(self) -> int:
            return self.notices

    members = [Member.remote() for _ in range(ACTORS)]
    ray.get([m.count.remote() for m in members])
    samples: dict[str, list[float]] = {"submit_ms": [], "delivered_ms": []}
    for rep in range(REPS):
        started = time.perf_counter()
        for i in range(n):
            members[i % ACTORS].notify.remote(rep, True, False, False)
        submitted = time.perf_counter()
        ray.get([m.count.remote() for m in members])  # an actor's calls run in order: the last one ran before this
        delivered = time.perf_counter()
        samples["submit_ms"].append((submitted - started) * 1000)
        samples["delivered_ms"].append((delivered - started) * 1000)
    out = {name: statistics.median(values) for name, values in samples.items()}
    out["per_call_us"] = out["submit_ms"] * 1000 / n
    return out


def main(ns: list[int]) -> None:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        names = ("submit_ms", "delivered_ms", "per_call_us")
        print("calls " + " ".join(f"{name:>14}" for name in names), flush=True)
        for n in ns:
            row = measure(n)
            print(f"{n:>5} " + " ".join(f"{row[name]:>14.2f}" for name in names), flush=True)
    finally:
        ray.shutdown()
