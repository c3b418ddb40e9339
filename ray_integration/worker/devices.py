"""Which CUDA device a GPU worker drives, and which GPU placements the NCCL backend accepts.

Two pure functions (tested with tables in ``tests/test_devices.py``) and one thin
reader of the worker's environment:

* :func:`choose_cuda_device` maps Ray's GPU ids for this actor to the torch
  device index this process must use. Ray normally sets
  ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs, so its first GPU is index 0;
  with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it does not, and the
  process sees every GPU of the node: the index is then the position of the
  actor's GPU among the visible ones (``torch.cuda.set_device(0)`` would put
  every actor of the node on the first GPU).
* :func:`check_gpus_per_worker` refuses placements the NCCL ring cannot use:
  a fractional GPU per worker (two ranks of one ring on one GPU: NCCL refuses
  the communicator, "Duplicate GPU detected" / "Multiple Ranks are using the
  same GPU") and more than one GPU per worker (one rank drives one GPU: the
  ring moves tensors of one device per rank; the other GPUs would sit idle).
* :func:`worker_cuda_device` reads Ray's ids and the environment inside a
  worker actor and applies :func:`choose_cuda_device`.
"""

from __future__ import annotations

import os
from typing import Sequence

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _visible(cuda_visible_devices: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list (None: unset, every GPU of the node is visible)."""
    if cuda_visible_devices is None:
        return None
    text = cuda_visible_devices.strip()
    if text in ("", "NoDevFiles"):
        return []
    return [item.strip() for item in text.split(",") if item.strip()]


def choose_cuda_device(ray_gpu_ids: Sequence[int | str], cuda_visible_devices: str | None,
                       noset_visible_devices: bool = False) -> int:
    """The torch CUDA device index of this worker's GPU.

    Args:
        ray_gpu_ids: ``ray.get_gpu_ids()`` in the worker (ints, or the strings
            of the node's ``CUDA_VISIBLE_DEVICES`` such as UUIDs).
        cuda_visible_devices: this process's ``CUDA_VISIBLE_DEVICES`` (None if unset).
        noset_visible_devices: whether ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``
            is on (only changes the error message: the rule is the same).

    With several GPUs, the one that comes first among the visible devices is
    chosen (Ray's id list has no order).
    """
    ids = [str(i).strip() for i in ray_gpu_ids]
    if not ids:
        raise ValueError("this worker has no GPU from Ray (ray.get_gpu_ids() is empty); start the workers with "
                         "use_gpu=True on a cluster that has GPUs, or use use_gpu=False (gloo on CPU)")
    visible = _visible(cuda_visible_devices)
    if visible is None:
        try:
            return min(int(i) for i in ids)
        except ValueError:
            raise ValueError(f"Ray gave this worker GPU ids {ids}, which are not device indices, and "
                             "CUDA_VISIBLE_DEVICES is unset; set CUDA_VISIBLE_DEVICES for the Ray node (e.g. to "
                             "the GPU UUIDs) so the ids can be located") from None
    positions = [visible.index(i) for i in ids if i in visible]
    if not positions:
        who = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is on, so CUDA_VISIBLE_DEVICES is the node's"
               if noset_visible_devices else "Ray should have set CUDA_VISIBLE_DEVICES to them")
        raise ValueError(f"Ray gave this worker GPU ids {ids} but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} does "
                         f"not list them ({who}); do not override CUDA_VISIBLE_DEVICES inside the worker")
    return min(positions)


def check_gpus_per_worker(use_gpu: bool, gpus_per_worker: float | None) -> None:
    """Raise ValueError (naming the field, the value and the fix) for a GPU placement NCCL cannot use."""
    if not use_gpu or gpus_per_worker is None:
        return
    value = gpus_per_worker
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"ElasticTrainer gpus_per_worker={value!r} must be 1 (one GPU per worker) or None")
    if value < 1 or value != int(value):
        raise ValueError(
            f"ElasticTrainer gpus_per_worker={value!r} is a fraction of a GPU: several workers would share a GPU, "
            "and NCCL refuses two ranks of one ring on one GPU ('Duplicate GPU detected'); use gpus_per_worker=1 "
            "(one worker per GPU), or use_gpu=False to train on CPU with gloo"
        )
    if value > 1:
        raise ValueError(
            f"ElasticTrainer gpus_per_worker={value!r}: each worker is one rank of the NCCL ring and drives one GPU, "
            f"so {int(value) - 1} of its GPUs would sit idle; use gpus_per_worker=1 and {int(value)}x as many "
            "workers (max_workers)"
        )


def worker_cuda_device() -> int:
    """Inside a Ray worker actor: the CUDA device index it must use (see :func:`choose_cuda_device`)."""
    import ray

    noset = os.environ.get(NOSET_ENV, "").strip().lower() in ("1", "true")
    return choose_cuda_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), noset)
