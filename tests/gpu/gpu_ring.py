"""Rank processes on GPUs for the NCCL tests, including several ranks on ONE GPU.

NCCL refuses two ranks of one communicator on one device ("Duplicate GPU
detected"), unless each rank claims to be its own host: a distinct
``NCCL_HOSTID`` per rank process, with the GPU-to-GPU transports off
(``NCCL_P2P_DISABLE=1``, ``NCCL_SHM_DISABLE=1``) so that the ranks talk over
NCCL's socket transport on loopback (``NCCL_SOCKET_IFNAME=lo``,
``NCCL_IB_DISABLE=1``, ``NCCL_NET=Socket``). :func:`rank_env` is that recipe (``elastic_ring.backends.nccl.communicator.shared_gpu_env``);
:class:`GpuRing` starts each rank process with it (``spawn``: CUDA and fork do
not mix) and otherwise behaves like the CPU tests' :class:`ProcessRing`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch.distributed as dist

import elastic_ring as er
from elastic_ring.backends.nccl.communicator import shared_gpu_env
from tests.process_ring import ProcessRing, _worker_main


def rank_env(slot: int) -> dict[str, str]:
    """The environment of the rank process in ``slot``: one fake host per rank, sockets on loopback."""
    return {
        **shared_gpu_env(slot, host_prefix="elastic-ring-test-host"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "OMP_NUM_THREADS": "1",
    }


def _gpu_worker_main(conn, env: dict[str, str]) -> None:
    # NCCL reads its environment when the first communicator forms, which is after this.
    os.environ.update(env)
    _worker_main(conn)


class GpuRing(ProcessRing):
    """``num_procs`` rank processes, all on CUDA device ``device`` (several ranks per GPU)."""

    def __init__(self, num_procs: int, device: int = 0) -> None:  # noqa: D107 - replaces ProcessRing's start-up
        self._ctx = mp.get_context("spawn")
        self.device = device
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.address = er.StoreAddress("127.0.0.1", self.store.port)
        self._round = 0
        self._procs = [None] * num_procs
        self._conns = [None] * num_procs
        for slot in range(num_procs):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_gpu_worker_main, args=(child, rank_env(slot)), daemon=True)
        proc.start()
        child.close()
        self._procs[slot], self._conns[slot] = proc, parent

    def spec(self, rank: int, world_size: int, round_id: int, **overrides) -> er.RingSpec:
        overrides.setdefault("backend", "nccl")
        overrides.setdefault("cuda_device", self.device)
        overrides.setdefault("node_ids", tuple(f"elastic-ring-test-host{r}" for r in range(world_size)))
        overrides.setdefault("job_id", "gpu-tests")
        return super().spec(rank, world_size, round_id, **overrides)

    def signal(self, slot: int, sig: int) -> float:
        """Send ``sig`` to the process in ``slot``; returns the wall-clock time it was sent."""
        t = time.time()
        os.kill(self._procs[slot].pid, sig)
        return t

    def reap(self, slot: int, timeout_s: float = 10.0) -> None:
        """SIGKILL the process in ``slot`` (stopped or not) and wait for it, so the next task respawns it."""
        proc = self._procs[slot]
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout_s)
        if proc.is_alive():
            raise RuntimeError(f"rank process {proc.pid} in slot {slot} did not die within {timeout_s} s")
