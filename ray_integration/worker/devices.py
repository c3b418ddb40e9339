"""Which CUDA device a GPU worker drives.

A pure function (tested with a table in ``tests/test_devices.py``) and one thin
reader of the worker's environment (the GPU placements the NCCL ring accepts are
checked with the options: :func:`ray_integration.config.check_gpus_per_worker`):

* :func:`choose_cuda_device` maps Ray's GPU ids for this actor to the torch
  device index this process must use. Ray normally sets
  ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs, so its first GPU is index 0;
  with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it does not, and the
  process sees every GPU of the node: the index is then the position of the
  actor's GPU among the visible ones (``torch.cuda.set_device(0)`` would put
  every actor of the node on the first GPU).
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


def worker_cuda_device() -> int:
    """Inside a Ray worker actor: the CUDA device index it must use (see :func:`choose_cuda_device`)."""
    import ray

    noset = os.environ.get(NOSET_ENV, "").strip().lower() in ("1", "true")
    return choose_cuda_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), noset)
