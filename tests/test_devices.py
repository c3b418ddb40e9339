"""Device choice for GPU workers and the NCCL placement rules: pure functions, tested with tables."""

import pytest

from ray_integration.config import check_gpus_per_worker
from ray_integration.worker.devices import choose_cuda_device

# (ray_gpu_ids, CUDA_VISIBLE_DEVICES, noset, expected device index)
CHOICES = [
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU: it is device 0 of the process
    ([3], "3", False, 0),
    (["3"], "3", False, 0),
    # the node's CUDA_VISIBLE_DEVICES was set before Ray started: ids are its entries
    (["6"], "6", False, 0),
    # NOSET: the process sees every GPU of the node; the index is the GPU's position
    ([2], None, True, 2),
    ([0], None, True, 0),
    (["6"], "4,5,6,7", True, 2),
    (["GPU-bbbb"], "GPU-aaaa,GPU-bbbb", True, 1),
    (["MIG-1"], " MIG-0 , MIG-1 ", True, 1),
    # several GPUs (refused for NCCL by check_gpus_per_worker, but the choice is still defined):
    # the first one among the visible devices, whatever order Ray lists them in
    ([5, 4], "4,5", False, 0),
    (["7", "5"], "4,5,6,7", True, 1),
    ([3, 1], None, True, 1),
]


@pytest.mark.parametrize("ids, visible, noset, expected", CHOICES)
def test_choose_cuda_device(ids, visible, noset, expected):
    assert choose_cuda_device(ids, visible, noset) == expected


# (ray_gpu_ids, CUDA_VISIBLE_DEVICES, noset, words the error must contain)
REFUSALS = [
    ([], "0", False, ["no GPU from Ray", "use_gpu=True"]),
    (["GPU-aaaa"], None, True, ["not device indices", "CUDA_VISIBLE_DEVICES is unset"]),
    ([3], "0,1", False, ["[\'3\']", "'0,1'", "Ray should have set"]),
    ([3], "0,1", True, ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is on"]),
    ([0], "", False, ["CUDA_VISIBLE_DEVICES=''"]),
    ([0], "NoDevFiles", False, ["does not list them"]),
]


@pytest.mark.parametrize("ids, visible, noset, words", REFUSALS)
def test_choose_cuda_device_refuses_with_the_fix(ids, visible, noset, words):
    with pytest.raises(ValueError) as info:
        choose_cuda_device(ids, visible, noset)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# (use_gpu, gpus_per_worker, None if accepted else words of the error)
PLACEMENTS = [
    (True, None, None),
    (True, 1, None),
    (True, 1.0, None),
    (False, None, None),
    (True, 0.5, ["gpus_per_worker=0.5", "fraction", "Duplicate GPU", "gpus_per_worker=1"]),
    (True, 0.25, ["fraction"]),
    (True, 1.5, ["fraction", "gpus_per_worker=1"]),
    (True, 2, ["gpus_per_worker=2", "1 of its GPUs would sit idle", "2x as many workers"]),
    (True, 4.0, ["3 of its GPUs would sit idle", "4x as many"]),
    (True, 0, ["must be 1"]),
    (True, -1, ["must be 1"]),
    (True, True, ["must be 1"]),
    (True, "1", ["must be 1"]),
]


@pytest.mark.parametrize("use_gpu, gpus, words", PLACEMENTS)
def test_check_gpus_per_worker(use_gpu, gpus, words):
    if words is None:
        check_gpus_per_worker(use_gpu, gpus)
        return
    with pytest.raises(ValueError) as info:
        check_gpus_per_worker(use_gpu, gpus)
    assert "ElasticTrainer gpus_per_worker=" in str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
