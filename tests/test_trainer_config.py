"""TrainerConfig: impossible settings fail fast with messages naming the field, the value and the fix."""

import pytest

from ray_integration.config import TrainerConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_workers=0), "min_workers=0 must be an int > 0"),
        (dict(min_workers=3, max_workers=2), "min_workers=3 is larger than max_workers=2"),
        (dict(max_workers=1.5), "max_workers=1.5 must be an int"),
        (dict(use_gpu="yes"), "use_gpu='yes'"),
        (dict(cpus_per_worker=-1), "cpus_per_worker=-1"),
        (dict(gpus_per_worker=1), "gpus_per_worker=1 needs use_gpu=True"),
        (dict(resources_per_worker={"slot": 0}), "resources_per_worker="),
        (dict(resources_per_worker={"CPU": 1}), "use cpus_per_worker"),
        (dict(checkpoint_uri="/tmp/x"), "say how often to persist"),
        (dict(checkpoint_every_n_commits=0), "checkpoint_every_n_commits=0"),
        (dict(max_failures=-1), "max_failures=-1"),
        (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s=0"),
        (dict(elastic_timeout_s="soon"), "elastic_timeout_s='soon'"),
        (dict(runtime_env=["pip"]), "runtime_env="),
        (dict(progress="on"), "progress='on'"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        TrainerConfig(**kwargs)


def test_defaults_and_derived():
    c = TrainerConfig(min_workers=2, max_workers=4)
    assert c.backend == "gloo" and c.worker_gpus == 0
    g = TrainerConfig(use_gpu=True)
    assert g.backend == "nccl" and g.worker_gpus == 1.0
    assert TrainerConfig(use_gpu=True, gpus_per_worker=0.5).worker_gpus == 0.5
    TrainerConfig(checkpoint_uri="s3://b/j", checkpoint_every_s=30)
