"""The scenario of :mod:`benchmarks.control_plane`, in the driver's process: the real driver, its store and the
simulated workers (see that module's docstring for what is real and what is simulated, and what each figure means).
"""

from __future__ import annotations

import collections
import cProfile
import io
import math
import multiprocessing as mp
import os
import pstats
import queue
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

#: Every figure of a result line, in order (the first five are the issue's).
FIELDS = ("driver_cpu_per_s", "loss_to_spec_s", "store_ops_per_reform", "notice_to_all_s", "heartbeat_lag_s",
          "heartbeat_lag_p99_s", "loop_cpu_per_s", "inbox_cpu_per_s", "steps_per_s", "ms_per_step", "msgs_per_s",
          "store_bytes_per_reform", "loss_to_aborted_s", "answered_ahead", "requests_sent_s", "loss_to_requests_s",
          "drain_seen_s", "seen_to_notified_s", "loss_to_spec_max_s", "start_to_spec_s", "join_to_spec_s",
          "drain_to_spec_s", "load")

PER_NODE = 8
RESERVE = 16  # idle workers for the replacements


# ---------------------------------------------------------------- the driver's process
def thread_cpu_s(ident: int) -> float:
    """The CPU seconds of this process's thread ``ident`` (``threading.get_ident()``: its own CPU clock, ns
    resolution, not /proc's ticks); 0.0 once it ended."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ProcessLookupError):
        return 0.0


class _Scenario:
    """Runs in the driver's process beside the driver's loop: starts the workers, scripts the events, measures."""

    def __init__(self, n: int, opts: dict) -> None:
        from elastic_ring.ring.store import StoreServer
        from ray_integration.wire.protocol import Keys

        from benchmarks import _control_workers as sim

        self.n, self.opts = n, opts
        self.secret = secrets.token_bytes(32)
        self.keys = Keys(f"job-{secrets.token_hex(4)}")
        self.server = StoreServer("127.0.0.1", timeout_s=120.0)
        from ray_integration.config import TrainerConfig

        self.heartbeats = TrainerConfig(max_workers=n, heartbeats=opts.get("heartbeats", "auto")).heartbeat_mode
        # heartbeats="node": each simulated node's directory (beat files, leader lock) under a fresh temporary one
        self.beats_root = tempfile.mkdtemp(prefix="control-plane-beats-") if self.heartbeats == "node" else None
        total = n + RESERVE
        self.order = [f"{i:08x}" for i in range(total)]
        self.nodes = {wid: f"{i // PER_NODE:056x}" for i, wid in enumerate(self.order)}
        procs = opts.get("sim_procs") or max(2, min(8, math.ceil(total / 128)))
        ctx = mp.get_context("spawn")
        self.events: Any = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.host_of: dict[str, int] = {}
        self.procs = []
        for p in range(procs):
            slots = [(wid, self.nodes[wid]) for i, wid in enumerate(self.order) if i % procs == p]
            for wid, _ in slots:
                self.host_of[wid] = p
            proc = ctx.Process(target=sim.main, args=("127.0.0.1", self.server.address.port, self.secret,
                                                      self.keys.job, slots, opts["interval_s"], opts["report_hz"],
                                                      self.commands[p], self.events, self.beats_root,
                                                      opts.get("sim_nice", 0)), daemon=True)
            proc.start()
            self.procs.append(proc)
        self.formed: dict[int, dict[str, tuple[float, float]]] = {}
        self.notices: dict[int, dict[str, float]] = {}
        self.failures: list[str] = []
        self._counts: "queue.Queue[dict]" = queue.Queue()
        self.reader_tid: int | None = None
        ready = 0
        while ready < procs:
            kind, *_ = self.events.get(timeout=600)
            ready += kind == "ready"

    def command(self, kind: str, wids: list[str]) -> None:
        by_host: dict[int, list[str]] = {}
        for wid in wids:
            by_host.setdefault(self.host_of[wid], []).append(wid)
        for host, some in by_host.items():
            self.commands[host].put((kind, some))

    def read_events(self, wakeups: "queue.SimpleQueue") -> None:
        self.reader_tid = threading.get_ident()
        while True:
            try:
                kind, wid, round_id, value = self.events.get()
            except (EOFError, OSError):
                return
            if kind == "formed":
                self.formed.setdefault(round_id, {})[wid] = value
            elif kind == "notice":
                self.notices.setdefault(round_id, {})[wid] = value
            elif kind == "returned":  # (value: the generation it last asked for)
                wakeups.put(("ray", [("return", wid, value)]))
            elif kind == "counts":
                self._counts.put(value)
            elif kind == "form_failed":
                self.failures.append(f"{wid} round {round_id}: {value}")
            elif kind == "quit":
                return

    def worker_counts(self) -> dict[str, int]:
        for c in self.commands:
            c.put(("counts", None))
        total: dict[str, int] = {}
        for _ in self.commands:
            for k, v in self._counts.get(timeout=60).items():
                total[k] = total.get(k, 0) + v
        return total

    def wait_formed(self, round_id: int, wids: list[str], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(wids) <= set(self.formed.get(round_id, {})):
            if time.monotonic() > deadline:
                missing = sorted(set(wids) - set(self.formed.get(round_id, {})))
                raise TimeoutError(f"round {round_id}: {len(missing)} workers did not form it (e.g. {missing[:3]}); "
                                   f"failures: {self.failures[:3]}")
            time.sleep(0.01)

    def quit(self) -> None:
        for c in self.commands:
            c.put(("quit", None))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if self.beats_root is not None:
            shutil.rmtree(self.beats_root, ignore_errors=True)


def _wait(predicate, timeout_s: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what if isinstance(what, str) else what())
        time.sleep(0.005)


def _answered(pool: Any, ring: Any, wids: list[str] | None = None) -> float:
    """The wall time of the last ring answer of ``ring``'s round to ``wids`` (default: all its members), once all
    went out (the loop publishes the ring before it answers its members one by one)."""
    wids = list(ring.worker_ids) if wids is None else wids
    keys = [(ring.round_id, w) for w in wids]
    _wait(lambda: all(k in pool.answered_at for k in keys), 60, f"round {ring.round_id} was not answered")
    return max(pool.answered_at[k] for k in keys)


def driver_main(n: int, opts: dict, out: Any) -> None:
    try:
        out.put(_run(n, opts))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which prints it
        import traceback

        out.put({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
    out.close()
    out.join_thread()
    os._exit(0)  # threads still block in the store's native calls: no destructors


def _run(n: int, opts: dict) -> dict:
    from ray_integration.config import TrainerConfig
    from ray_integration.driver.events import EventLog
    from ray_integration.driver.loop import Driver
    from ray_integration.driver.mailroom import Acknowledger, Mailroom, RoundKeys
    from ray_integration.driver.progress import ProgressDisplay
    from ray_integration.wire.channel import Channel, Inbox
    from ray_integration.wire.protocol import DRIVER, DriverKind
    from ray_integration.wire.settings import WorkerSettings

    from benchmarks._control_pool import SimPool
    from benchmarks._control_workers import Counted

    sc = _Scenario(n, opts)
    server, keys = sc.server, sc.keys
    driver_store = Counted(server.store)
    recv_store = Counted(server.connect(60.0))
    send, receive = Channel(driver_store, sc.secret, DRIVER), Channel(recv_store, sc.secret, DRIVER)
    config = TrainerConfig(min_workers=max(1, n // 2), max_workers=n, heartbeat_interval_s=opts["interval_s"],
                           heartbeat_timeout_s=opts["heartbeat_timeout_s"], progress=False,
                           heartbeats=sc.heartbeats)
    wakeups: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
    settings = WorkerSettings(driver_silence_s=config.driver_silence_s, flush_timeout_s=10.0,
                              heartbeats=config.heartbeat_mode)
    pool = SimPool(config, send, "127.0.0.1", server.address.port, keys, sc.secret, None, {}, settings,
                   wakeups=wakeups, nodes=sc.nodes, order=sc.order, command=sc.command)
    pool.receive = receive
    events = EventLog()
    driver = Driver(config, pool, "127.0.0.1", events, wakeups)
    mailroom = Mailroom(pool, events, ProgressDisplay(False), None, None)
    cleaner = RoundKeys(driver_store, keys)

    def on_tick(d: Driver) -> None:
        mailroom(d.round_id, d.world_size)
        cleaner.forget_before(d.round_id - 1)

    inbox = Inbox(receive, keys.driver_inbox, wakeups, on_message=Acknowledger(send, keys, config.heartbeat_interval_s))
    inbox.start()
    threading.Thread(target=sc.read_events, args=(wakeups,), daemon=True).start()
    result: dict[str, Any] = {"heartbeats": sc.heartbeats}
    scenario = threading.Thread(target=_script, args=(sc, driver, pool, result, driver_store, recv_store),
                                daemon=True)
    scenario.start()
    profile = cProfile.Profile() if opts.get("profile") else None
    result["loop_tid"] = threading.get_ident()
    steps: list[float] = []
    advance = driver.advance

    def timed_advance(state: Any) -> Any:  # the real step, timed on the loop thread's CPU clock
        started = time.thread_time()
        try:
            return advance(state)
        finally:
            steps.append(time.thread_time() - started)

    driver.advance = timed_advance  # type: ignore[method-assign]
    result["steps"] = steps
    if profile is not None:
        profile.enable()
    try:
        final = driver.run(on_tick)
        result["final"] = type(final).__name__ + (f": {getattr(final, 'error', '')}" if hasattr(final, "error") else "")
    finally:
        if profile is not None:
            profile.disable()
        inbox.close(lambda: send.send(keys.driver_inbox, DriverKind.WAKE))
        sc.events.put(("quit", None, None, None))
        sc.quit()
    scenario.join(5)
    if profile is not None:
        path = os.path.join(opts["profile"], f"driver-{n}.prof")
        profile.dump_stats(path)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        result["profile"] = f"{path}\n{text.getvalue()}"
    lost = [e.detail.get("cause") for e in events.events if e.kind == "worker_lost"]
    if lost:
        causes = collections.Counter(str(c)[:60] for c in lost)
        result["lost"] = f"{len(lost)} workers lost: " + "; ".join(f"{k} ×{v}" for k, v in causes.most_common(4))
    result.pop("steps", None)
    if "error" in result:
        first, _, rest = result["error"].partition("\n")
        raise RuntimeError(f"{first} ({result.get('lost', 'no worker lost')}; the driver ended {result.get('final')})"
                           f"\n{rest}")
    if "done" not in result:
        raise RuntimeError(f"the driver's run ended before the scenario did ({result.get('final')}; "
                           f"{result.get('lost', 'no worker lost')}); measured so far: "
                           f"{ {k: v for k, v in result.items() if k in FIELDS} }")
    return result


def _script(sc: _Scenario, driver: Any, pool: Any, result: dict, driver_store: Any, recv_store: Any) -> None:
    """The scenario (see the module docstring); fills ``result``; ends the driver's run."""
    mine = {threading.get_ident()}
    try:
        _phases(sc, driver, pool, result, driver_store, recv_store, mine)
    except BaseException as exc:  # noqa: BLE001 - the driver's process reports it
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        driver.abort("the benchmark's scenario ended")


def _counts(sc: _Scenario, pool: Any, driver_store: Any, recv_store: Any) -> dict[str, float]:
    workers = sc.worker_counts()
    return {"ops": workers["ops"] + driver_store.ops + recv_store.ops, "bytes": workers["bytes"] + driver_store.bytes
            + recv_store.bytes, "bg_msgs": pool.background_msgs, "hb_ops": workers["hb_ops"],
            "hb_bytes": workers["hb_bytes"]}


def _loss_and_join(sc: _Scenario, driver: Any, pool: Any, driver_store: Any, recv_store: Any) -> dict[str, float]:
    """The last rank is lost (Ray reports its actor dead and the survivors ask for a ring at that instant, as their
    collective fails); once that re-form is measured, its replacement joins. Returns the figures of both."""
    out: dict[str, float] = {}
    ring = driver.ring
    victim, survivors = ring.worker_ids[-1], list(ring.worker_ids[:-1])
    pool.hold = True  # its replacement starts once the re-form is measured
    before = _counts(sc, pool, driver_store, recv_store)
    t_loss = time.time()
    sc.command("kill", [victim])
    pool.wakeups.put(("ray", [("dead", victim)]))  # Ray's watcher reports the actor dead
    sc.command("fail", survivors)  # their collective failed at once
    _wait(lambda: driver.ring is not None and driver.ring.round_id > ring.round_id, 120, "no ring after the loss")
    lost = driver.ring
    sc.wait_formed(lost.round_id, list(lost.worker_ids))
    time.sleep(0.3)  # the old round's keys are cleaned up on the driver's next ticks
    after = _counts(sc, pool, driver_store, recv_store)
    out["loss_to_spec_s"] = _answered(pool, lost) - t_loss
    # the survivors answered before the driver applied their request (decisions.prompt_ring: all but those that
    # asked first), and, off the critical path then, their requests: sent (the simulated workers' side, on this
    # VM's shared cores), then applied by the driver (its inbox's backlog included)
    formed = [e for e in driver.events.events if e.kind == "ring_formed" and e.round_id == lost.round_id]
    reported = [e for e in driver.events.events if e.kind == "worker_lost" and e.detail.get("worker") == victim]
    if reported:  # the re-form's step reported the loss: the abort was pushed to every survivor before
        out["loss_to_aborted_s"] = reported[-1].time - t_loss
    out["answered_ahead"] = formed[-1].detail.get("prompt", 0) if formed else 0
    last_request = max(pool.requested_at.get(w, float("-inf")) for w in survivors)
    if last_request > t_loss:
        out["requests_sent_s"] = max(pool.request_sent_at.get(w, t_loss) for w in survivors) - t_loss
        out["loss_to_requests_s"] = last_request - t_loss
    bg_msgs = after["bg_msgs"] - before["bg_msgs"]
    hb_ops = after["hb_ops"] - before["hb_ops"]
    per_msg = (after["hb_bytes"] - before["hb_bytes"]) / hb_ops if hb_ops else 0.0
    # the background's pushes are the workers' hb_ops; its pops are the driver's, one per background message
    out["store_ops_per_reform"] = after["ops"] - before["ops"] - bg_msgs
    out["store_bytes_per_reform"] = after["bytes"] - before["bytes"] - bg_msgs * per_msg
    pool.release()
    _wait(lambda: driver.ring.world_size == sc.n, 120, lambda: (
        f"the replacement did not join: ring of {driver.ring.world_size}, {len(pool.live())} live, joiners "
        f"{[r.worker_id for r in driver.joiners()]}, held {pool._held}"))
    grown = driver.ring
    sc.wait_formed(grown.round_id, list(grown.worker_ids))
    joiners = [w for w in grown.worker_ids if w not in lost.worker_ids]
    out["join_to_spec_s"] = _answered(pool, grown, joiners) - min(pool.started_at[w] for w in joiners)
    _at_rest(pool, sc.opts["interval_s"])  # the next loss starts from a ring at rest
    return out


def _at_rest(pool: Any, interval_s: float) -> None:
    """Wait until the driver heard every live worker within the last two heartbeat intervals: the simulated
    workers, niced on this machine's shared cores, caught up with the formation's store traffic."""
    def rested() -> bool:
        now = time.monotonic()
        return all(r.heard_at is not None and now - r.heard_at < 2 * interval_s for r in pool.live())
    time.sleep(interval_s)
    _wait(rested, 60, "the workers' heartbeats did not catch up after a re-form")


def _phases(sc: _Scenario, driver: Any, pool: Any, result: dict, driver_store: Any, recv_store: Any,
            mine: set) -> None:
    n, opts = sc.n, sc.opts
    started = time.time()
    _wait(lambda: driver.ring is not None and driver.ring.world_size == n, 300, "the first ring was not formed")
    first = driver.ring
    sc.wait_formed(first.round_id, list(first.worker_ids))
    result["start_to_spec_s"] = _answered(pool, first) - started
    time.sleep(1.0)

    # ---- steady state
    loop_tid = result["loop_tid"]
    if sc.reader_tid is not None:
        mine.add(sc.reader_tid)
    inbox_tid = next(t.ident for t in threading.enumerate() if t.name == "elastic-ring-driver-inbox")
    cpu0, loop0, t0 = time.process_time(), thread_cpu_s(loop_tid), time.monotonic()
    mine0 = sum(map(thread_cpu_s, mine))
    inbox0 = thread_cpu_s(inbox_tid)
    pool.lags = []
    steps0, msgs0 = len(result["steps"]), pool.background_msgs
    time.sleep(opts["steady_s"])
    lags, pool.lags = pool.lags, None
    elapsed = time.monotonic() - t0
    steady_steps = result["steps"][steps0:]
    result["steps_per_s"] = len(steady_steps) / elapsed
    result["ms_per_step"] = 1000 * statistics.median(steady_steps) if steady_steps else None
    result["msgs_per_s"] = (pool.background_msgs - msgs0) / elapsed
    result["driver_cpu_per_s"] = (time.process_time() - cpu0 - (sum(map(thread_cpu_s, mine)) - mine0)) / elapsed
    result["loop_cpu_per_s"] = (thread_cpu_s(loop_tid) - loop0) / elapsed
    result["inbox_cpu_per_s"] = (thread_cpu_s(inbox_tid) - inbox0) / elapsed
    lags.sort()
    result["heartbeat_lag_s"] = statistics.median(lags) if lags else None
    result["heartbeat_lag_p99_s"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None

    # ---- losses of the last rank, each followed by the join of its replacement (--losses of them; medians)
    losses: dict[str, list[float]] = {}
    for _ in range(opts.get("losses", 1)):
        for name, value in _loss_and_join(sc, driver, pool, driver_store, recv_store).items():
            losses.setdefault(name, []).append(value)
    for name, values in losses.items():
        result[name] = statistics.median(values)
    if len(losses.get("loss_to_spec_s", ())) > 1:
        result["loss_to_spec_max_s"] = max(losses["loss_to_spec_s"])
    grown = driver.ring

    # ---- a node drains (a full one, not rank 0's)
    members = list(grown.worker_ids)
    node = grown.node_ids[n // 2]
    pool.hold = True  # the replacements wait (not measured)
    t_drain = time.time()
    pool.draining_script = {node: int((time.time() + 120) * 1000)}
    _wait(lambda: set(members) <= set(sc.notices.get(grown.round_id, {})), 60, "the drain notice did not reach all")
    result["notice_to_all_s"] = max(sc.notices[grown.round_id][w] for w in members) - t_drain
    if pool.drain_seen_at is not None and grown.round_id in pool.notified_at:  # its parts: the drain poll, the
        result["drain_seen_s"] = pool.drain_seen_at - t_drain                  # driver's notices; the rest is the
        result["seen_to_notified_s"] = pool.notified_at[grown.round_id] - pool.drain_seen_at  # workers' receiving
    _wait(lambda: driver.ring.round_id > grown.round_id and node not in driver.ring.node_ids, 120, "no drain re-form")
    drained = driver.ring
    result["drain_to_spec_s"] = _answered(pool, drained) - t_drain
    result["load"] = os.getloadavg()[0]
    result["done"] = True
