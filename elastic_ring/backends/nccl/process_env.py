"""The process environment NCCL reads when a communicator forms: checks and settings (pure functions)."""

from __future__ import annotations

import os


def set_eager_connect(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Make NCCL connect every peer while the communicator forms (NCCL >= 2.22 connects lazily at
    the first collective otherwise). Leaves a value the user set; returns whether it set one."""
    if "NCCL_RUNTIME_CONNECT" in environ:
        return False
    environ["NCCL_RUNTIME_CONNECT"] = "0"
    return True


def shared_gpu_env(slot: int, host_prefix: str = "elastic-ring-host") -> dict[str, str]:
    """NCCL settings for the rank process in ``slot`` when several ranks share one GPU (development,
    tests, benchmarks): NCCL refuses two ranks of a communicator on one device ("Duplicate GPU
    detected") unless each claims its own host (a distinct ``NCCL_HOSTID``); with P2P and shared
    memory off, the ranks talk over NCCL's socket transport on loopback. Apply it to ``os.environ``
    before the process forms its first communicator. See docs/gpu.md."""
    return {"NCCL_HOSTID": f"{host_prefix}{slot}", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


def check_nonblocking_allowed(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> None:
    """``NCCL_COMM_BLOCKING=1`` would override our non-blocking config: creation could then
    block forever on a missing peer, out of the watchdog's reach. Refuse it."""
    value = environ.get("NCCL_COMM_BLOCKING", "").strip()
    if value not in ("", "0"):
        raise RuntimeError(f"environment variable NCCL_COMM_BLOCKING={value!r} makes NCCL communicators blocking, "
                           "which backend='nccl' cannot abort on a lost peer; unset it (or set it to 0)")
