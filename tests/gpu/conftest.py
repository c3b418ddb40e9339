"""GPU tests: skipped cleanly (with the reason) where CUDA or NCCL >= 2.25 is missing.

Run on a GPU machine: ``pip install -e ".[gpu,test]" && pytest tests/gpu -v``. One GPU is enough:
the rank processes share it with the two-ranks-on-one-GPU recipe of :mod:`tests.gpu.gpu_ring`.
"""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def gpu_skip_reason() -> str | None:
    import torch

    import elastic_ring as er

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if not er.nccl_available():
        return "needs NCCL >= 2.25 (pip install -e '.[gpu]', i.e. nvidia-nccl-cu12>=2.25)"
    return None


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in pathlib.Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    reason = gpu_skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def gpu_ring():
    """Three rank processes on CUDA device 0 (restarted per test module)."""
    from tests.gpu.gpu_ring import GpuRing

    ring = GpuRing(3)
    yield ring
    ring.close()
