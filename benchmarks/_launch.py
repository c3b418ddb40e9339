"""Run a function on N local processes that form one elastic_ring round (benchmarks only)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends.nccl.communicator import shared_gpu_env


def new_secret() -> bytes | None:
    """A job secret for RingSpec.auth_key where this version of elastic_ring has one (else None)."""
    try:
        from elastic_ring.core import auth
    except ImportError:  # a version from before the sub-packages: er.auth, or no authentication at all
        auth = getattr(er, "auth", None)
    return auth.new_secret() if auth is not None else None


def ring_spec(secret: bytes | None, **fields: Any) -> er.RingSpec:
    """``er.RingSpec(**fields)``, with ``auth_key=secret`` where RingSpec takes one."""
    if secret is not None and "auth_key" in {f.name for f in dataclasses.fields(er.RingSpec)}:
        fields["auth_key"] = secret
    return er.RingSpec(**fields)


def backend_fields(backend: str, rank: int) -> dict[str, Any]:
    """The RingSpec fields of ``backend`` for this rank process. For ``"nccl"`` every rank runs on GPU 0
    and this process's environment gets NCCL's shared-GPU settings (``shared_gpu_env``: socket transport
    on loopback, slower than real multi-GPU links, but DDP and ours ride the same one)."""
    if backend != "nccl":
        return {}
    os.environ.update(shared_gpu_env(rank, host_prefix="elastic-ring-bench-host"))
    return {"backend": "nccl", "cuda_device": 0}


class RankFailed(RuntimeError):
    """A rank process raised (its traceback is the message) or died without a result."""


def _main(fn, rank, world, port, secret, args, queue, backend, collective_timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra = backend_fields(backend, rank)
    import torch

    torch.set_num_threads(1)
    try:
        er.init(ring_spec(secret, round_id=1, rank=rank, world_size=world, node_ids=("localhost",) * world,
                          store=er.StoreAddress("127.0.0.1", port), collective_timeout_s=collective_timeout_s,
                          **extra))
        try:
            queue.put((rank, fn(*args), None))
        finally:
            er.shutdown()
    except BaseException:  # the parent names it at once instead of waiting for a result that never comes
        queue.put((rank, None, traceback.format_exc()))
        raise


def run_ranks(fn: Callable, world: int, *args, backend: str = "gloo", collective_timeout_s: float = 600.0,
              timeout_s: float = 1800.0) -> list[Any]:
    """``fn(*args)`` on ``world`` processes; returns each rank's result, by rank. With
    ``backend="nccl"`` every rank runs on CUDA device 0 (:func:`backend_fields`). ``collective_timeout_s`` is the
    ring's (a hung collective becomes a CommError after it); RankFailed as soon as a rank raised or died, or
    past ``timeout_s``."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    secret = new_secret()
    procs = [ctx.Process(target=_main, args=(fn, r, world, store.port, secret, args, queue, backend,
                                             collective_timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, result, failure = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without a result")
                if time.monotonic() > deadline:
                    raise RankFailed(f"no result from ranks {sorted(set(range(world)) - set(results))} within "
                                     f"{timeout_s:g} s") from None
                continue
            if failure is not None:
                raise RankFailed(f"rank {rank} failed:\n{failure}")
            results[rank] = result
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    for p in procs:
        p.join(60)
    return [results[r] for r in range(world)]


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000
