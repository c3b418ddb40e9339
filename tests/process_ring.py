"""A pool of long-lived worker processes that run test functions as ranks of a ring.

This is the tests' stand-in for the Ray driver: it hosts the rendezvous TCP
store, hands each task a fresh round (a new ``RingSpec`` with a larger round
id), and collects results. Processes persist across tests, so every test also
exercises re-forming a ring in the same processes; a killed process is
replaced before the next task.

Test functions must be module-level (they are pickled by reference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

import elastic_ring as er

#: The job secret of the test rings (RingSpec.auth_key); real jobs make a fresh one per run.
TEST_SECRET = b"elastic-ring-tests-secret-32-byt"


@dataclass
class RankFailure:
    """What a rank raised, as the harness received it."""

    rank: int
    type_name: str
    message: str
    traceback: str


def use_lazy_gloo_pairs() -> None:
    """A ProcessRing ``setup``: this rank's gloo rings connect their pairs at first use (ELASTIC_RING_GLOO_LAZY=1,
    the default), whatever the environment of the test run says."""
    from elastic_ring.core import constants

    constants.GLOO_LAZY_PAIRS = True


def use_full_mesh_gloo_pairs() -> None:
    """A ProcessRing ``setup``: this rank's gloo rings connect every pair at construction (ELASTIC_RING_GLOO_LAZY=0)."""
    from elastic_ring.core import constants

    constants.GLOO_LAZY_PAIRS = False


class RingTaskError(AssertionError):
    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        super().__init__("\n".join(f"rank {f.rank} raised {f.type_name}: {f.message}\n{f.traceback}" for f in failures))


def _worker_main(conn, setup=None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if setup is not None:  # a module-level function, run once in the rank's process before any task
        setup()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            er.shutdown()
            return
        fn, args, spec = message
        try:
            if spec is not None:
                er.init(spec)
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # reported to the test, which decides
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))


class Pending:
    """A task running on some ranks."""

    def __init__(self, ring: "ProcessRing", slots: list[int]) -> None:
        self._ring = ring
        self.slots = slots

    @property
    def pids(self) -> list[int]:
        return [self._ring._procs[s].pid for s in self.slots]

    def results(self, timeout_s: float = 60.0, raise_errors: bool = True) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        out: list[Any] = []
        failures = []
        for rank, slot in enumerate(self.slots):
            reply = self._receive(rank, slot, deadline, timeout_s)
            if reply is None:
                proc = self._ring._procs[slot]
                proc.join(1)
                out.append(RankFailure(rank, "ProcessDied", f"exit code {proc.exitcode}", ""))
            elif reply[0] == "ok":
                out.append(reply[1])
            else:
                failure = RankFailure(rank, *reply[1:])
                failures.append(failure)
                out.append(failure)
        if failures and raise_errors:
            raise RingTaskError(failures)
        return out


    def _receive(self, rank: int, slot: int, deadline: float, timeout_s: float):
        """The rank's reply, or None if its process died first."""
        conn, proc = self._ring._conns[slot], self._ring._procs[slot]
        while True:
            if conn.poll(0.05):
                try:
                    return conn.recv()
                except EOFError:
                    return None
            if not proc.is_alive() and not conn.poll(0):
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} (pid {proc.pid}) gave no result within {timeout_s} s")


class ProcessRing:
    def __init__(self, num_procs: int, setup: Any = None) -> None:
        self._setup = setup  # run in every rank's process before its first task (e.g. use_lazy_gloo_pairs)
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "elastic_ring"])
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.address = er.StoreAddress("127.0.0.1", self.store.port)
        self._round = 0
        self._procs: list[Any] = [None] * num_procs
        self._conns: list[Any] = [None] * num_procs
        for slot in range(num_procs):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self._setup), daemon=True)
        proc.start()
        child.close()
        self._procs[slot], self._conns[slot] = proc, parent

    def next_round(self) -> int:
        self._round += 1
        return self._round

    def spec(self, rank: int, world_size: int, round_id: int, **overrides) -> er.RingSpec:
        node_ids = overrides.pop("node_ids", tuple(f"node{r // 2}" for r in range(world_size)))
        overrides.setdefault("auth_key", TEST_SECRET)
        return er.RingSpec(round_id=round_id, rank=rank, world_size=world_size, node_ids=node_ids,
                           store=self.address, **overrides)

    def start(self, fn: Callable, *args, world_size: int | None = None, form_ring: bool = True, **spec_overrides) -> Pending:
        world = world_size or len(self._procs)
        slots = list(range(world))
        for slot in slots:
            if not self._procs[slot].is_alive():
                self._spawn(slot)
        round_id = self.next_round()
        for rank, slot in enumerate(slots):
            spec = self.spec(rank, world, round_id, **dict(spec_overrides)) if form_ring else None
            self._conns[slot].send((fn, args, spec))
        return Pending(self, slots)

    def run(self, fn: Callable, *args, world_size: int | None = None, timeout_s: float = 60.0, **spec_overrides) -> list[Any]:
        return self.start(fn, *args, world_size=world_size, **spec_overrides).results(timeout_s)

    def kill(self, slot: int) -> float:
        """SIGKILL the process in ``slot``; returns the wall-clock time of the kill."""
        t = time.time()
        os.kill(self._procs[slot].pid, signal.SIGKILL)
        return t

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
