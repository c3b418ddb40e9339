"""``python -m benchmarks.control_plane --ray-calls 1023``: what a notice or an abort to every member costs the driver's
loop, through Ray actor calls (how the pool sent them until 2026-11-28) against sealed pushes into each member's
store queue (how it sends them now: ``WorkerPool.notify`` / ``tell_preemption`` / ``abort_round``), in one run.

Starts its own Ray (``address="local"``; never another's). This VM cannot hold N worker processes, so 8 stand in
for the members on each side, each serving N/8 of them:

* Ray: 8 actors of 0 CPUs; N fire-and-forget calls round-robin over them, as the old loop made them;
* store: a real ``StoreServer`` in this process (the driver's), the driver's real sealed ``Channel`` pushing one
  ``notice`` into each of N worker queues, and one reader process with 8 threads, each on its own connection,
  popping and unsealing its N/8 queues' messages as a worker's mailbox thread does.

Measured (wall, medians of 5): ``*_submit_ms``: the loop's own time to send the N messages; ``*_delivered_ms``:
until every one was handled by its reader (8 readers serve N/8 each: an upper bound on a real job's delivery, where
each of the N workers reads its one message in parallel); ``*_per_msg_us``: ``submit_ms`` per message; and
``submit_ratio``: Ray's submit time over the store's.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time

ACTORS = 8
REPS = 5


def _ray_side(n: int) -> dict[str, float]:
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
    samples: dict[str, list[float]] = {"ray_submit_ms": [], "ray_delivered_ms": []}
    for rep in range(REPS):
        started = time.perf_counter()
        for i in range(n):
            members[i % ACTORS].notify.remote(rep, True, False, False)
        submitted = time.perf_counter()
        ray.get([m.count.remote() for m in members])  # an actor's calls run in order: the last one ran before this
        delivered = time.perf_counter()
        samples["ray_submit_ms"].append((submitted - started) * 1000)
        samples["ray_delivered_ms"].append((delivered - started) * 1000)
    for m in members:
        ray.kill(m)
    return {name: statistics.median(values) for name, values in samples.items()}


def _readers(port: int, secret: bytes, n: int, reps: int) -> None:
    """A process of 8 reader threads (a worker's mailbox each, serving N/8 workers' queues)."""
    from elastic_ring.ring.store import connect
    from elastic_ring.core.spec import StoreAddress
    from ray_integration.wire.channel import Channel
    from ray_integration.wire.protocol import DRIVER, DriverKind, Keys

    keys = Keys("raycalls")

    def read(j: int) -> None:
        store = connect(StoreAddress("127.0.0.1", port), 60.0)
        channel = Channel(store, secret, f"reader{j}")
        for rep in range(reps):
            for i in range(j, n, ACTORS):
                msg = channel.receive(keys.worker_inbox(f"w{i}"), 60.0)
                assert msg is not None and msg["from"] == DRIVER and msg["k"] == DriverKind.NOTICE.value, msg
            if store.add(f"done{rep}", 1) == ACTORS:
                store.set(f"all{rep}", b"1")

    threads = [threading.Thread(target=read, args=(j,)) for j in range(ACTORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _store_side(n: int) -> dict[str, float]:
    import datetime

    from elastic_ring.core.auth import new_secret
    from elastic_ring.ring.store import StoreServer
    from ray_integration.wire.channel import Channel
    from ray_integration.wire.protocol import DRIVER, DriverKind, Keys

    server, secret, keys = StoreServer("127.0.0.1"), new_secret(), Keys("raycalls")
    send = Channel(server.store, secret, DRIVER)  # the driver's sending channel, as the pool's
    queues = [keys.worker_inbox(f"w{i}") for i in range(n)]
    readers = multiprocessing.get_context("spawn").Process(target=_readers, args=(server.address.port, secret, n, REPS))
    readers.start()
    waiter = server.connect(120.0)
    waiter.set_timeout(datetime.timedelta(seconds=120))
    samples: dict[str, list[float]] = {"store_submit_ms": [], "store_delivered_ms": []}
    try:
        for rep in range(REPS):
            time.sleep(0.2)
            started = time.perf_counter()
            for queue_key in queues:
                send.send(queue_key, DriverKind.NOTICE, round=rep, change=True, persist=False, stop=False)
            submitted = time.perf_counter()
            waiter.wait([f"all{rep}"])
            delivered = time.perf_counter()
            samples["store_submit_ms"].append((submitted - started) * 1000)
            samples["store_delivered_ms"].append((delivered - started) * 1000)
    finally:
        readers.join(60)
        if readers.is_alive():
            readers.kill()
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(n: int) -> dict[str, float]:
    out = {**_ray_side(n), **_store_side(n)}
    out["ray_per_msg_us"] = out["ray_submit_ms"] * 1000 / n
    out["store_per_msg_us"] = out["store_submit_ms"] * 1000 / n
    out["submit_ratio"] = out["ray_submit_ms"] / out["store_submit_ms"]
    return out


def main(ns: list[int]) -> None:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        names = ("ray_submit_ms", "store_submit_ms", "submit_ratio", "ray_delivered_ms", "store_delivered_ms",
                 "ray_per_msg_us", "store_per_msg_us")
        print("  msgs " + " ".join(f"{name:>18}" for name in names), flush=True)
        for n in ns:
            row = measure(n)
            print(f"{n:>6} " + " ".join(f"{row[name]:>18.2f}" for name in names), flush=True)
    finally:
        ray.shutdown()
