"""``python -m benchmarks.control_plane --burst 128 512 1024``: a loss's re-form by the driver alone, with the
machine to itself (no simulated workers competing for its cores): what the driver can do, as on a head node.

Per N, in one process: the real ``Driver.run`` loop with its real inbox thread (``wire.channel.Inbox``) reading the
store's queue, the pool's Ray calls simulated as in the scenario (:class:`benchmarks._control_pool.SimPool`). The
N workers' messages are sealed beforehand (each with its own sender id and counter, as each worker seals its own)
and pushed into the store by this process. A first ring of N forms; then the N − 1 survivors' ring requests are
queued in the store while the inbox thread is held, and, at once, Ray reports the last rank dead and the inbox is
let go; the next loss is of that ring's last rank (rings of N, N − 1, ...). Measured (wall, medians of ``REPS``):

* ``burst_to_spec_ms``: from that instant to the last survivor's ring answer pushed (the loop stepped, aborted the
  old round, formed the ring and answered every survivor, while its inbox read the requests: since 2026-11-28 the
  survivors whose request it had not applied yet are answered ahead of it, ``decisions.prompt_ring``);
* ``loop_cpu_ms`` / ``inbox_cpu_ms``: the two threads' CPU time in that window;
* ``steps``: how many times the loop stepped its state in it;
* then a node of the ring drains (Ray's drain list): ``drain_seen_ms`` until the driver's drain watcher saw it (it
  polls every ``DRAIN_POLL_S``), ``drain_notified_ms`` until it pushed its last notice to the ring's members.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time

#: Re-forms measured per N.
REPS = 5


def burst(n: int, reps: int = REPS) -> dict[str, float]:
    from elastic_ring.core.auth import new_secret, seal_json
    from elastic_ring.ring.store import StoreServer
    from ray_integration.config import TrainerConfig
    from ray_integration.driver.events import EventLog
    from ray_integration.driver.loop import Driver
    from ray_integration.driver.states import Running
    from ray_integration.wire.channel import Channel, Inbox
    from ray_integration.wire.protocol import DRIVER, Keys, WorkerKind
    from ray_integration.wire.settings import WorkerSettings

    from benchmarks._control_pool import SimPool
    from benchmarks._control_scenario import thread_cpu_s

    secret, keys = new_secret(), Keys("job-burst")
    server = StoreServer("127.0.0.1", timeout_s=60.0)
    total = n
    order = [f"{i:08x}" for i in range(total)]
    nodes = {wid: f"{i // 8:056x}" for i, wid in enumerate(order)}
    config = TrainerConfig(min_workers=max(1, n // 2), max_workers=n, progress=False, heartbeats="worker")
    wakeups: "queue.SimpleQueue" = queue.SimpleQueue()
    pool = SimPool(config, Channel(server.store, secret, DRIVER), "127.0.0.1", server.address.port, keys, secret,
                   None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0), wakeups=wakeups,
                   nodes=nodes, order=order, command=lambda kind, wids: None)
    driver = Driver(config, pool, "127.0.0.1", EventLog(), wakeups)
    gate = threading.Event()
    gate.set()
    inbox = Inbox(Channel(server.connect(60.0), secret, DRIVER), keys.driver_inbox, wakeups,
                  on_message=lambda msg: gate.wait())
    inbox.start()
    steps: list[float] = []
    advance = driver.advance

    def counted(state):
        steps.append(time.time())
        return advance(state)

    driver.advance = counted  # type: ignore[method-assign]
    result: list = []
    loop = threading.Thread(target=lambda: result.append(driver.run()), daemon=True)
    loop.start()
    pusher = server.connect(60.0)
    sent = {wid: 0 for wid in order}

    def sealed(wid: str, kind: WorkerKind, **fields) -> bytes:
        sent[wid] += 1
        return seal_json(secret, keys.driver_inbox, {"from": wid, "n": sent[wid], "k": kind.value, **fields})

    def push(blobs: list[bytes]) -> None:
        for blob in blobs:
            pusher.queue_push(keys.driver_inbox, blob)

    def wait(predicate, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline or result:
                raise RuntimeError(f"{what} (the driver ended {result[0]!r})" if result else what)
            time.sleep(0.002)

    try:
        wait(lambda: len(pool.records) == n and all(r.info for r in pool.records.values()), "the workers started")
        push([sealed(w, WorkerKind.HEARTBEAT, seq=1, waiting=1, reason="start", synced=True) for w in pool.records])
        wait(lambda: driver.ring is not None and driver.ring.world_size == n, "the first ring did not form")
        pool.hold = True  # the replacements never start: each measured re-form is a loss alone (N, N - 1, ...)
        samples: dict[str, list[float]] = {"burst_to_spec_ms": [], "loop_cpu_ms": [], "inbox_cpu_ms": [], "steps": []}
        inbox_thread = next(t for t in threading.enumerate() if t.name == "elastic-ring-driver-inbox")
        for _ in range(reps):
            ring = driver.ring
            members = list(ring.worker_ids)
            generation = {w: pool.records[w].generation for w in members}
            push([sealed(w, WorkerKind.HEARTBEAT, seq=sent[w] + 1, waiting=0, synced=True) for w in members])
            time.sleep(0.3)  # every member formed and heard: the ring at rest
            survivors = members[:-1]
            held = sealed(members[-1], WorkerKind.HEARTBEAT, seq=sent[members[-1]] + 1)  # (sealed before the
            requests = [sealed(w, WorkerKind.RING_REQUEST, generation=generation[w] + 1, reason="failure")  # others:
                        for w in survivors]                                         # counters only grow)
            gate.clear()
            push([held])  # the inbox thread pops it and holds
            time.sleep(0.05)
            push(requests)
            loop_cpu, inbox_cpu = thread_cpu_s(loop.ident), thread_cpu_s(inbox_thread.ident)
            before = len(steps)
            started = time.time()
            wakeups.put(("ray", [("dead", members[-1])]))
            gate.set()
            keys_answered = [(ring.round_id + 1, w) for w in survivors]
            wait(lambda: all(k in pool.answered_at for k in keys_answered), "the survivors were not answered")
            samples["burst_to_spec_ms"].append((max(pool.answered_at[k] for k in keys_answered) - started) * 1000)
            samples["loop_cpu_ms"].append((thread_cpu_s(loop.ident) - loop_cpu) * 1000)
            samples["inbox_cpu_ms"].append((thread_cpu_s(inbox_thread.ident) - inbox_cpu) * 1000)
            samples["steps"].append(len(steps) - before)
        out = {name: statistics.median(values) for name, values in samples.items()}
        # a node drains (Ray's drain list): until the driver's poll saw it, and until its last notice was pushed
        ring = driver.ring
        push([sealed(w, WorkerKind.HEARTBEAT, seq=sent[w] + 1, waiting=0, synced=True) for w in ring.worker_ids])
        time.sleep(0.3)
        started = time.time()
        pool.draining_script = {ring.node_ids[len(ring.node_ids) // 2]: int((started + 120) * 1000)}
        wait(lambda: ring.round_id in pool.notified_at, "the drain was not notified")
        out["drain_seen_ms"] = (pool.drain_seen_at - started) * 1000
        out["drain_notified_ms"] = (pool.notified_at[ring.round_id] - started) * 1000
        return out
    finally:
        gate.set()
        driver.abort("the burst measurement ended")
        wakeups.put(("stop", "the measurement ended"))
        loop.join(10)
        inbox.close(lambda: pool.send.send(keys.driver_inbox, "wake"))
        server.close()


def main(ns: list[int], reps: int = REPS) -> None:
    names = ("burst_to_spec_ms", "loop_cpu_ms", "inbox_cpu_ms", "steps", "drain_seen_ms", "drain_notified_ms")
    print("workers " + " ".join(f"{name:>16}" for name in names), flush=True)
    for n in ns:
        row = burst(n, reps)
        print(f"{n:>7} " + " ".join(f"{row[name]:>16.1f}" for name in names), flush=True)
