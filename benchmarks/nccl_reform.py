"""NCCL re-form by shrink and grow against a full init, after a lost rank and for a joining one.

``--world`` rank processes share CUDA device 0 (``elastic_ring.backends.nccl.communicator.shared_gpu_env``: NCCL's
socket transport on loopback). Each repetition, alternating the two modes (``nccl_reform="init"`` and
``"shrink_grow"``), runs four phases:

1. **leave**: the last rank leaves gracefully (a drained worker): the others form a round of ``world - 1``
   (full init, or ncclCommShrink of their healthy communicator), then it closes its communicator;
2. **join**: it comes back: a round of ``world`` (full init, or ncclCommGrow);
3. **loss**: the ring allreduces in a loop and the last rank is SIGKILLed; once every survivor has its
   CommError, they form a round of ``world - 1``. A failed communicator is aborted, so this is a full init in
   both modes (elastic_ring/backends/nccl/reform.py says why);
4. **join new**: a fresh process (its CUDA context and libnccl already loaded, as a ready worker's are) joins.

A shrink or grow that fails is reported, and the round is formed again by a full init (the time counts both).

Each time is the slowest rank's ``er.init(spec)``: from the call to the end of the warm-up collective that
proves every peer is connected. The path each round took is printed (a libnccl without shrink or grow
falls back to a full init). Prints medians and the ratios.

    python -m benchmarks.nccl_reform [--world 3] [--repeats 4] [--backend nccl]

``--backend gloo`` runs the same choreography on CPU (every round is a full gloo init): a dry run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import signal
import statistics
import tempfile
import time

import torch.distributed as dist

import elastic_ring as er
from elastic_ring.ring import runtime
from benchmarks._launch import new_secret
from benchmarks._needs import Results, require_nccl
from elastic_ring.backends.nccl.communicator import shared_gpu_env


# ---------------------------------------------------------------- in the rank processes
def _serve(conn, slot: int, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        os.environ.update(shared_gpu_env(slot, host_prefix="elastic-ring-bench-host"))
    import torch

    torch.set_num_threads(1)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            er.shutdown()
            return
        name, args = message
        try:
            conn.send(("ok", globals()[name](*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def warm(backend: str) -> bool:
    if backend == "nccl":
        import torch

        from elastic_ring.backends.nccl import lib as nccl_lib

        torch.zeros(1, device="cuda:0")
        nccl_lib.load()
    return True


def form(spec: er.RingSpec) -> dict:
    import torch

    started = time.perf_counter()
    comm = er.init(spec)
    seconds = time.perf_counter() - started
    x = torch.full((1024,), float(spec.rank + 1), device=comm.device)
    comm.allreduce(x, er.core.ops.ReduceOp.SUM).wait()
    expect = spec.world_size * (spec.world_size + 1) / 2
    if x[0].item() != expect:
        raise AssertionError(f"rank {spec.rank}: sum {x[0].item()} != {expect}")
    return {"seconds": seconds, "formed_by": getattr(comm, "formed_by", "init")}


def loop_until_error(flag: str) -> str:
    import torch

    comm = runtime.current()
    x = torch.ones(1 << 18, device=comm.device)
    pathlib.Path(flag).touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            comm.allreduce(x, er.core.ops.ReduceOp.MAX).wait()
        except er.CommError as exc:
            return str(exc)[:120]
    raise TimeoutError("no CommError within 120 s of the kill")


# ---------------------------------------------------------------- the parent
class Ranks:
    def __init__(self, world: int, backend: str) -> None:
        self.ctx, self.backend = mp.get_context("spawn"), backend
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.secret = new_secret()
        self.procs: list = [None] * world
        self.conns: list = [None] * world
        self.round = 0
        for slot in range(world):
            self.spawn(slot)

    def spawn(self, slot: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, slot, self.backend), daemon=True)
        proc.start()
        child.close()
        self.procs[slot], self.conns[slot] = proc, parent
        self.call([slot], "warm", lambda rank: (self.backend,))

    def spec(self, rank: int, world: int, **fields) -> er.RingSpec:
        extra = {"backend": "nccl", "cuda_device": 0} if self.backend == "nccl" else {}
        return er.RingSpec(round_id=self.round, rank=rank, world_size=world, node_ids=("localhost",) * world,
                           store=er.StoreAddress("127.0.0.1", self.store.port), auth_key=self.secret,
                           collective_timeout_s=60.0, connect_timeout_s=60.0, **extra, **fields)

    def send(self, slots: list[int], name: str, make_args) -> None:
        for rank, slot in enumerate(slots):
            self.conns[slot].send((name, make_args(rank)))

    def collect(self, slots: list[int], timeout_s: float = 180.0) -> list:
        """Every slot's answer (all are read, so no pipe is left with one); RuntimeError naming the failures."""
        out, failed = [], []
        for slot in slots:
            if not self.conns[slot].poll(timeout_s):
                raise TimeoutError(f"slot {slot} gave no answer within {timeout_s} s")
            reply = self.conns[slot].recv()
            if reply[0] != "ok":
                failed.append(f"slot {slot}: {reply[1]}")
            out.append(reply[1])
        if failed:
            raise RuntimeError("; ".join(failed))
        return out

    def call(self, slots: list[int], name: str, make_args) -> list:
        self.send(slots, name, make_args)
        return self.collect(slots)

    def form(self, slots: list[int], **fields) -> list[dict]:
        self.round += 1
        world = len(slots)
        return self.call(slots, "form", lambda rank: (self.spec(rank, world, **fields),))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def leave() -> bool:
    """This rank leaves its ring gracefully (a drained or stopped worker): it aborts its communicator."""
    runtime.current().abort()
    er.shutdown()
    return True


def one_repetition(ranks: Ranks, mode: str, world: int, tmp: pathlib.Path) -> dict[str, dict]:
    """leave (graceful) -> join -> loss (SIGKILL) -> join; each phase's time and path."""
    slots, reform, out = list(range(world)), {"nccl_reform": mode}, {}
    shrink_grow = mode == "shrink_grow"
    ranks.form(slots, **reform)
    base, victim, survivors = ranks.round, slots[-1], slots[:-1]
    lineage = {"parent_round": base, "parent_ranks": tuple(survivors)} if shrink_grow else {}
    out["leave"] = _form_or_fall_back(ranks, survivors, reform, lineage)
    ranks.call([victim], "leave", lambda rank: ())  # it closes its communicator once the others moved on
    lineage = {"parent_round": ranks.round, "parent_ranks": tuple(range(world - 1)) + (-1,)} if shrink_grow else {}
    out["join"] = _form_or_fall_back(ranks, survivors + [victim], reform, lineage)  # the leaver comes back

    base = ranks.round
    flags = [tmp / f"r{base}-{s}" for s in slots]
    ranks.send(slots, "loop_until_error", lambda rank: (str(flags[rank]),))
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in flags):
        if time.monotonic() > deadline:
            raise TimeoutError("the ranks did not start looping")
        time.sleep(0.02)
    time.sleep(0.2)
    os.kill(ranks.procs[victim].pid, signal.SIGKILL)
    ranks.procs[victim].join(10)
    ranks.collect(survivors)  # every survivor has its CommError
    lineage = {"parent_round": base, "parent_ranks": tuple(survivors)} if shrink_grow else {}
    out["loss"] = _form_or_fall_back(ranks, survivors, reform, lineage)
    ranks.spawn(victim)
    lineage = {"parent_round": ranks.round, "parent_ranks": tuple(range(world - 1)) + (-1,)} if shrink_grow else {}
    out["join new"] = _form_or_fall_back(ranks, survivors + [victim], reform, lineage)  # a fresh process joins
    return out


def _form_or_fall_back(ranks: Ranks, slots: list[int], reform: dict, lineage: dict) -> dict:
    """Form a round; if it fails (a refused shrink or grow), say why and form the next one by a full init, as
    the driver would: the time is then the failed attempt's plus the full init's."""
    started = time.perf_counter()
    try:
        results = ranks.form(slots, **reform, **lineage)
    except RuntimeError as exc:
        failed_s = time.perf_counter() - started
        print(f"  the round failed after {failed_s:.3f} s ({str(exc)[:300]}); next round by a full init", flush=True)
        results = ranks.form(slots, **reform)
        return {"seconds": failed_s + max(r["seconds"] for r in results),
                "paths": ["failed->" + p for p in sorted({r["formed_by"] for r in results})]}
    return {"seconds": max(r["seconds"] for r in results), "paths": sorted({r["formed_by"] for r in results})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4, help="repetitions per mode (alternating)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    args = parser.parse_args()
    if args.world < 2:
        parser.error("--world must be at least 2 (one rank is lost and replaced)")
    if args.backend == "nccl":
        from elastic_ring.backends.nccl import lib as nccl_lib

        require_nccl(benchmark="benchmarks.nccl_reform", why="--backend nccl", skip="--backend gloo (a dry run)")
        lib = nccl_lib.load()
        print(f"libnccl {lib.version()} at {lib.path}; shrink={lib.has('ncclCommShrink')} "
              f"revoke={lib.has('ncclCommRevoke')} grow={lib.has('ncclCommGrow')}", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    phases = ("leave", "join", "loss", "join new")

    def medians() -> None:
        done = len(times.get(("shrink_grow", phases[-1]), []))
        print(f"\nmedians over {done} repetitions each, world {args.world} (leave/loss: {args.world} -> "
              f"{args.world - 1}; join: back to {args.world}), backend {args.backend}:")
        for p in phases:
            if not times.get(("init", p)) or not times.get(("shrink_grow", p)):
                print(f"  {p:8s}: not measured in both modes")
                continue
            full, fast = statistics.median(times[("init", p)]), statistics.median(times[("shrink_grow", p)])
            print(f"  {p:8s}: full init {full:.4f} s, shrink/grow {fast:.4f} s, speed-up {full / fast:.2f}x")

    # a repetition that fails prints the medians of those before it, then the failure
    with Results("benchmarks.nccl_reform").part("a repetition", partial=medians):
        ranks = Ranks(args.world, args.backend)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for i in range(2 * args.repeats):
                    mode = ("init", "shrink_grow")[i % 2]
                    result = one_repetition(ranks, mode, args.world, pathlib.Path(tmp))
                    print(f"{mode:12s} " + "   ".join(f"{p} {result[p]['seconds']:.4f} s {result[p]['paths']}"
                                                       for p in phases), flush=True)
                    for p in phases:
                        times.setdefault((mode, p), []).append(result[p]["seconds"])
        finally:
            ranks.close()
    medians()


if __name__ == "__main__":
    main()
