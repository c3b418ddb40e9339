"""``python -m benchmarks.control_plane --costs 32 128 512 1024``: what one piece of the driver's work costs at N, in
one process, on the loop thread's CPU clock (no worker processes: the records are fed their messages directly).

Per N, with the real ``Driver``, states and ``WorkerPool`` logic (:class:`benchmarks._control_pool.SimPool`) and a
real store server:

* ``context_ms``: one ``Driver.context()`` (a state sees a fresh one after each action it yields);
* ``step_ms``: one ``Driver.advance`` of ``Running`` in the steady state (the loop does one per wake-up, and every
  message wakes it);
* ``kill_silent_ms``: the silence scan one step makes (``Driver.kill_silent`` of the members);
* ``apply_us``: applying one heartbeat (``WorkerPool.apply``);
* ``answers_ms`` / ``answer_kb``: building, sealing and pushing the N ring answers of a re-form, and one answer's size;
* ``cleanup_ms``: deleting one old round's keys (``mailroom.RoundKeys.forget_before``: ``list_keys`` of the store,
  then a delete per key) with the keys of two rounds of N ranks in the store;
* ``wait_all_keys_ms`` / ``wait_one_key_ms``: one rank's wait in the formation's arrival barrier before issue 34
  (on all N ranks' keys) and now (on one key), wall time on a store where the keys exist; the store's one thread
  serves the N ranks' waits one after another;
* ``demand_cores``: what the loop would need if every heartbeat stepped the state (before issue 34: 2 wake-ups per
  worker per second), ``2 N · step_ms``; ``tick_cores``: what it needs stepping every ``TICK_S`` and applying the
  2 N heartbeats per second, ``step_ms / TICK_S + 2 N · apply_us``.
"""

from __future__ import annotations

import dataclasses
import queue
import statistics
import time
from typing import Callable

#: Messages / repetitions per measurement.
REPS = 15


def _median_ms(fn: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    samples = []
    for _ in range(reps):
        started = clock()
        fn()
        samples.append((clock() - started) * 1000)
    return statistics.median(samples)


def _cpu_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median ms of ``fn`` on this thread's CPU clock."""
    return _median_ms(fn, reps, time.thread_time)


def _wall_ms(fn: Callable[[], object], reps: int = 31) -> float:
    """Median ms of ``fn`` on the wall clock."""
    return _median_ms(fn, reps, time.perf_counter)


def costs(n: int) -> dict[str, float]:
    import elastic_ring as er
    from elastic_ring.backends import arrival, gloo
    from elastic_ring.core.auth import AuthenticatedStore, new_secret
    from elastic_ring.ring.store import StoreServer
    from ray_integration.config import TrainerConfig
    from ray_integration.driver.events import EventLog
    from ray_integration.driver.loop import TICK_S, Driver
    from ray_integration.driver.mailroom import RoundKeys
    from ray_integration.driver.states import Running, Starting
    from ray_integration.wire.channel import Channel
    from ray_integration.wire.protocol import DRIVER, Keys, WorkerKind
    from ray_integration.wire.settings import WorkerSettings

    from benchmarks._control_pool import SimPool

    secret, keys = new_secret(), Keys("job-costs")
    server = StoreServer("127.0.0.1")
    send = Channel(server.store, secret, DRIVER)
    config = TrainerConfig(min_workers=n, max_workers=n, progress=False)
    wakeups: "queue.SimpleQueue" = queue.SimpleQueue()
    order = [f"{i:08x}" for i in range(n)]
    nodes = {wid: f"{i // 8:056x}" for i, wid in enumerate(order)}
    pool = SimPool(config, send, "127.0.0.1", server.address.port, keys, secret, None, {},
                   WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0), wakeups=wakeups, nodes=nodes,
                   order=order, command=lambda kind, wids: None)
    driver = Driver(config, pool, "127.0.0.1", EventLog(), wakeups)
    pool.request(n)
    pool.apply_ray([item for kind, items in [wakeups.get()] for item in items])
    seq = {wid: 0 for wid in order}

    def beat(wid: str, waiting: int = 0, reason: str | None = None) -> dict:
        seq[wid] += 1
        return {"from": wid, "n": seq[wid], "k": WorkerKind.HEARTBEAT.value, "seq": seq[wid], "synced": True,
                "waiting": waiting, "reason": reason}

    for wid in order:
        pool.apply(beat(wid, 1, "start"))
    started = time.thread_time()
    state = driver.advance(Starting(since=time.monotonic() - 60))  # every worker waits: the first ring forms
    answers_ms = (time.thread_time() - started) * 1000
    if not isinstance(state, Running) or driver.ring is None or driver.ring.world_size != n:
        raise RuntimeError(f"the first ring of {n} did not form ({state!r})")
    answer_kb = len(str(pool.records[order[0]].answer)) / 1024
    for wid in order:
        pool.apply(beat(wid))  # they formed: no longer waiting
    running = Running()
    out = {"workers": n, "answers_ms": answers_ms, "answer_kb": answer_kb}
    out["context_ms"] = _cpu_ms(driver.context)
    out["step_ms"] = _cpu_ms(lambda: driver.advance(running))
    out["kill_silent_ms"] = _cpu_ms(lambda: driver.kill_silent(driver.members(), None))
    msgs = [beat(order[i % n]) for i in range(2000)]
    started = time.thread_time()
    for msg in msgs:
        pool.apply(msg)
    out["apply_us"] = (time.thread_time() - started) / len(msgs) * 1e6
    store = AuthenticatedStore(server.store, secret)
    cleaner = RoundKeys(server.store, keys)
    for round_id in (1, 2):
        base = er.RingSpec(round_id=round_id, rank=0, world_size=n, node_ids=tuple(driver.ring.node_ids),
                           store=server.address, job_id=keys.job, auth_key=secret)
        for rank in range(n):
            ranked = dataclasses.replace(base, rank=rank)
            arrival.announce_arrival(store, ranked)
            store.set(gloo.address_key(ranked, rank, lazy=True), b"a" * 154)
    # the arrival barrier: one rank's wait on every rank's key (before issue 34) against one key (now); the store's
    # single thread serves the N ranks' waits one after another, so a round costs about N times this
    keys_n = [arrival.arrival_key(dataclasses.replace(base, rank=r), r) for r in range(n)]
    one = [arrival.all_arrived_key(base)]
    out["wait_all_keys_ms"] = _wall_ms(lambda: server.store.wait(keys_n))
    out["wait_one_key_ms"] = _wall_ms(lambda: server.store.wait(one))
    started = time.thread_time()
    cleaner.forget_before(2)
    out["cleanup_ms"] = (time.thread_time() - started) * 1000
    out["demand_cores"] = 2 * n * out["step_ms"] / 1000
    out["tick_cores"] = out["step_ms"] / 1000 / TICK_S + 2 * n * out["apply_us"] / 1e6
    return out


def main(ns: list[int]) -> None:
    names = ("context_ms", "step_ms", "kill_silent_ms", "apply_us", "answers_ms", "answer_kb", "cleanup_ms",
             "wait_all_keys_ms", "wait_one_key_ms", "demand_cores", "tick_cores")
    print("workers " + " ".join(f"{name:>14}" for name in names), flush=True)
    for n in ns:
        row = costs(n)
        print(f"{n:>7} " + " ".join(f"{row[name]:>14.3f}" for name in names), flush=True)
