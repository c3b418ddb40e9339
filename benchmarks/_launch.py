"""Run a function on N local processes that form one elastic_ring round (benchmarks only)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
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


def _main(fn, rank, world, port, secret, args, queue, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra = backend_fields(backend, rank)
    import torch

    torch.set_num_threads(1)
    er.init(ring_spec(secret, round_id=1, rank=rank, world_size=world, node_ids=("localhost",) * world,
                      store=er.StoreAddress("127.0.0.1", port), collective_timeout_s=600, **extra))
    try:
        queue.put((rank, fn(*args)))
    finally:
        er.shutdown()


def run_ranks(fn: Callable, world: int, *args, backend: str = "gloo") -> list[Any]:
    """``fn(*args)`` on ``world`` processes; returns each rank's result, by rank. With
    ``backend="nccl"`` every rank runs on CUDA device 0 (:func:`backend_fields`)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    secret = new_secret()
    procs = [ctx.Process(target=_main, args=(fn, r, world, store.port, secret, args, queue, backend)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    return [results[r] for r in range(world)]


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000
