"""Tunables of the collective layer, with their units in their names.

This is the only module of ``elastic_ring`` that reads environment variables.
Every other module imports the values from here, so a reader can see in one
place what can be tuned and how.
"""

from __future__ import annotations

import os

MIB = 1024 * 1024


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number; unset it or give a number") from None
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be > 0")
    return value


def _env_int(name: str, default: int) -> int:
    value = _env_float(name, float(default))
    if value != int(value):
        raise ValueError(f"environment variable {name}={value!r} must be a whole number")
    return int(value)


#: Largest fusion buffer: tensors are packed into buffers of at most this many
#: bytes, one allreduce per buffer (Horovod's HOROVOD_FUSION_THRESHOLD).
FUSION_THRESHOLD_BYTES: int = _env_int("ELASTIC_RING_FUSION_THRESHOLD_BYTES", 64 * MIB)

#: Default bucket size of DistributedOptimizer's gradient buckets. Smaller than
#: the fusion threshold so that the first buckets are reduced while backward is
#: still running: on a 50 MiB MLP, benchmarks/step.py measured 0.91-0.99x DDP's
#: throughput with 64 MiB buckets (no overlap) and 1.05-1.10x with 16 MiB.
OPTIMIZER_BUCKET_BYTES: int = _env_int("ELASTIC_RING_OPTIMIZER_BUCKET_BYTES", 16 * MIB)

#: How long any collective may take before the survivors raise CommError.
COLLECTIVE_TIMEOUT_S: float = _env_float("ELASTIC_RING_COLLECTIVE_TIMEOUT_S", 60.0)

#: How long forming a communicator may take (store connect, peer handshake).
CONNECT_TIMEOUT_S: float = _env_float("ELASTIC_RING_CONNECT_TIMEOUT_S", 60.0)

#: How often the NCCL watchdog thread looks at the deadlines and errors of the collectives in flight.
NCCL_WATCHDOG_INTERVAL_S: float = _env_float("ELASTIC_RING_NCCL_WATCHDOG_INTERVAL_S", 0.02)

#: Threads of one gloo process group (concurrent collectives in flight).
GLOO_THREADS: int = _env_int("ELASTIC_RING_GLOO_THREADS", 2)
