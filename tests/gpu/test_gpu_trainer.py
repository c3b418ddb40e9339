"""ElasticTrainer(use_gpu=True) end to end on a local Ray instance: one worker per GPU over NCCL.

One GPU runs the one-worker job (a ring of one; the collectives still go through the NCCL
communicator's warm-up and the state layer's CUDA snapshots); the two-worker job needs two GPUs,
because a worker never shares a GPU (fractional GPUs are refused for NCCL)."""

import pytest
import torch

from ray_integration import ElasticTrainer
from tests.gpu import gpu_jobs

pytestmark = pytest.mark.gpu


def check(result, world, epochs=2):
    value = result.value
    assert value["world"] == world
    assert value["device"] == value["comm_device"] == value["param_device"] == f"cuda:{value['expected_device']}"
    assert value["seen"] == [float(epochs)] * gpu_jobs.N_SAMPLES, "every sample once per epoch"
    assert value["identical"]


def test_elastic_trainer_on_one_gpu(ray_session):
    result = ElasticTrainer(min_workers=1, max_workers=1, use_gpu=True, progress=False).run(
        gpu_jobs.train_on_gpu, config={"epochs": 2})
    check(result, world=1)


def test_elastic_trainer_on_two_gpus(ray_session):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one worker per GPU (NCCL refuses two ranks of a ring on one GPU)")
    result = ElasticTrainer(min_workers=2, max_workers=2, use_gpu=True, progress=False).run(
        gpu_jobs.train_on_gpu, config={"epochs": 2})
    check(result, world=2)
