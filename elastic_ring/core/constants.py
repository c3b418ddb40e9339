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


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in choices:
        raise ValueError(f"environment variable {name}={raw!r} is not one of {', '.join(choices)}; unset it or "
                         "pick one")
    return raw


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean; use 1 or 0")


#: Largest fusion buffer: tensors are packed into buffers of at most this many
#: bytes, one allreduce per buffer (Horovod's HOROVOD_FUSION_THRESHOLD).
FUSION_THRESHOLD_BYTES: int = _env_int("ELASTIC_RING_FUSION_THRESHOLD_BYTES", 64 * MIB)

#: Most bytes the collectives' reusable fusion buffers may hold (beyond it, a
#: call's buffer is freed after the call). The pool is emptied when its ring goes.
FUSION_POOL_MAX_BYTES: int = _env_int("ELASTIC_RING_FUSION_POOL_MAX_BYTES", 256 * MIB)

#: Default bucket size of DistributedOptimizer's gradient buckets, and the
#: autotuner's baseline (see docs/performance.md for the measurements).
OPTIMIZER_BUCKET_BYTES: int = _env_int("ELASTIC_RING_OPTIMIZER_BUCKET_BYTES", 16 * MIB)

#: DistributedOptimizer's first bucket closes once it holds this many bytes, so
#: the first allreduce starts early in backward (DDP's first bucket is 1 MiB).
FIRST_BUCKET_BYTES: int = _env_int("ELASTIC_RING_FIRST_BUCKET_BYTES", 1 * MIB)

#: Gradients smaller than this are moved into their bucket views together when their bucket is
#: complete (one batched copy and division); larger ones in their own hook, while backward goes on.
GRAD_BATCH_BELOW_BYTES: int = _env_int("ELASTIC_RING_GRAD_BATCH_BELOW_BYTES", 256 * 1024)

#: Whether DistributedOptimizer's gradient hooks take the lean path (no lock, no lookup, inlined bucket
#: bookkeeping) once a step's agreement rides in its last bucket; 0 sends every hook through the locked path.
LEAN_HOOKS: bool = _env_bool("ELASTIC_RING_LEAN_HOOKS", True)

#: How the NCCL backend sends DistributedOptimizer's gradient buckets (docs/gpu.md): ``collective`` (the
#: default: each bucket is one checked collective, launched and waited for like any other), ``inline`` (pooled
#: events, one host wait and one watchdog entry per step, the step's trailer through persistent pinned buffers;
#: launched on the autograd thread) or ``thread`` (the same, launched by one FIFO launcher thread per
#: communicator: the autograd thread only records a ready event and enqueues the bucket).
NCCL_BUCKET_PATHS: tuple[str, ...] = ("collective", "inline", "thread")
NCCL_BUCKETS: str = _env_choice("ELASTIC_RING_NCCL_BUCKETS", "collective", NCCL_BUCKET_PATHS)

#: Whether DistributedOptimizer tunes its bucket size during the first steps of
#: every ring when the caller did not fix ``fusion_threshold_bytes``.
AUTOTUNE: bool = _env_bool("ELASTIC_RING_AUTOTUNE", True)

#: Bucket sizes the autotuner tries (sizes that give the same buckets as an
#: earlier one are skipped), and how many steps it spends on each: the first
#: ``AUTOTUNE_WARMUP_STEPS`` are not measured, the median of the next
#: ``AUTOTUNE_SAMPLE_STEPS`` step times (the slowest rank's) is the score.
AUTOTUNE_CANDIDATE_BYTES: tuple[int, ...] = (4 * MIB, 16 * MIB, 64 * MIB)
AUTOTUNE_WARMUP_STEPS: int = _env_int("ELASTIC_RING_AUTOTUNE_WARMUP_STEPS", 2)
AUTOTUNE_SAMPLE_STEPS: int = _env_int("ELASTIC_RING_AUTOTUNE_SAMPLE_STEPS", 5)

#: The autotuner keeps the default bucket size unless another is faster by more than this fraction.
AUTOTUNE_MARGIN: float = _env_float("ELASTIC_RING_AUTOTUNE_MARGIN", 0.03)

#: How long any collective may take before the survivors raise CommError.
COLLECTIVE_TIMEOUT_S: float = _env_float("ELASTIC_RING_COLLECTIVE_TIMEOUT_S", 60.0)

#: How long forming a communicator may take (store connect, peer handshake).
CONNECT_TIMEOUT_S: float = _env_float("ELASTIC_RING_CONNECT_TIMEOUT_S", 60.0)

#: How often the NCCL watchdog thread looks at the deadlines and errors of the collectives in flight.
NCCL_WATCHDOG_INTERVAL_S: float = _env_float("ELASTIC_RING_NCCL_WATCHDOG_INTERVAL_S", 0.02)

#: Threads of one gloo process group (concurrent collectives in flight).
GLOO_THREADS: int = _env_int("ELASTIC_RING_GLOO_THREADS", 2)

#: Whether a gloo ring connects its pairs at first use (lazy devices, then one barrier that connects every pair
#: the ring's collectives use: 2·log2(n) per rank) instead of gloo's full mesh at construction (n - 1 per rank,
#: O(n²) store reads per round). Read when a ring forms.
GLOO_LAZY_PAIRS: bool = _env_bool("ELASTIC_RING_GLOO_LAZY", True)
