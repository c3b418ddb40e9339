"""Every option is checked at construction, fast, with a message naming the field, the value and the fix:
a table of bad values across ElasticTrainer, ElasticSampler, TorchState, DistributedOptimizer, RingSpec and
the checkpoint options. bool for an int, nan and inf for a number, unknown fsspec protocols: all refused."""

import math
import re

import pytest
import torch

import elastic_ring as er
from ray_integration.config import TrainerConfig
from state import CheckpointConfig, ElasticSampler, TorchState

NAN, INF = math.nan, math.inf


def _opt():
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def _spec(**overrides):
    base = dict(round_id=1, rank=0, world_size=2, node_ids=("a", "b"), store=er.StoreAddress("127.0.0.1", 29500))
    base.update(overrides)
    return er.RingSpec(**base)


TRAINER = [
    (dict(min_workers=0), "min_workers=0 must be an int >= 1"),
    (dict(min_workers=True), "min_workers=True must be an int >= 1"),
    (dict(min_workers=3, max_workers=2), "min_workers=3 is larger than max_workers=2; set max_workers >= min_workers"),
    (dict(max_workers=1.5), "max_workers=1.5 must be an int"),
    (dict(use_gpu="yes"), "use_gpu='yes' must be True or False"),
    (dict(cpus_per_worker=-1), "cpus_per_worker=-1 must be a finite number of CPUs >= 0"),
    (dict(cpus_per_worker=NAN), "cpus_per_worker=nan must be a finite number"),
    (dict(gpus_per_worker=1), "gpus_per_worker=1 needs use_gpu=True"),
    (dict(use_gpu=True, gpus_per_worker=0.5), "gpus_per_worker=0.5 is a fraction of a GPU"),
    (dict(use_gpu=True, gpus_per_worker=2), "gpus_per_worker=2: each worker is one rank"),
    (dict(resources_per_worker={"slot": 0}), "resources_per_worker={'slot': 0} must map resource names"),
    (dict(resources_per_worker={"slot": INF}), "resources_per_worker={'slot': inf}"),
    (dict(resources_per_worker={"CPU": 1}), "resources_per_worker has 'CPU'; use cpus_per_worker"),
    (dict(checkpoint_uri="ckpt/run1"), "checkpoint_uri='ckpt/run1' is a relative path"),
    (dict(checkpoint_uri="/"), "checkpoint_uri='/' is the filesystem root"),
    (dict(checkpoint_uri="nosuch://bucket/job"), "fsspec knows no protocol 'nosuch'"),
    (dict(checkpoint_uri="/data/c", checkpoint_every_n_commits=0), "checkpoint_every_n_commits=0 must be an int >= 1"),
    (dict(checkpoint_every_n_commits=5), "checkpoint_every_n_commits=5 has no effect without checkpoint_uri"),
    (dict(checkpoint_uri="/data/c", checkpoint_every_s=INF), "checkpoint_every_s=inf must be a finite number"),
    (dict(checkpoint_keep_last=True), "checkpoint_keep_last=True must be an int >= 1"),
    (dict(checkpoint_uri="/data/c", trusted_checkpoints="yes"), "trusted_checkpoints='yes' must be True or False"),
    (dict(trusted_checkpoints=True), "trusted_checkpoints=True has no effect without checkpoint_uri"),
    (dict(max_failures=-2), "max_failures=-2 must be an int >= 0; or -1 for no limit"),
    (dict(failure_window_s=0), "failure_window_s=0"),
    (dict(failure_window_s=NAN), "failure_window_s=nan must be a finite number of seconds"),
    (dict(checkpoint_uri="/tmp/x", lease_ttl_s=0.5), "lease_ttl_s=0.5 must be in [1, 120] seconds"),
    (dict(checkpoint_uri="/tmp/x", lease_ttl_s=True), "lease_ttl_s=True"),
    (dict(heartbeat_timeout_s=0.9), "heartbeat_timeout_s=0.9 is shorter than two heartbeats"),
    (dict(heartbeat_timeout_s=NAN), "heartbeat_timeout_s=nan must be a finite number of seconds"),
    (dict(heartbeat_interval_s=0), "heartbeat_interval_s=0 must be a finite number of seconds > 0"),
    (dict(elastic_timeout_s="soon"), "elastic_timeout_s='soon' must be a finite number of seconds"),
    (dict(connect_timeout_s=-1), "connect_timeout_s=-1 must be a finite number of seconds > 0"),
    (dict(stop_timeout_s=INF), "stop_timeout_s=inf must be a finite number of seconds"),
    (dict(collective_timeout_s=True), "collective_timeout_s=True must be a finite number"),
    (dict(bind_address=""), "bind_address='' must be an address of the driver's machine"),
    (dict(runtime_env=["pip"]), "runtime_env=['pip'] must be a dict"),
    (dict(progress="on"), "progress='on' must be True, False or None"),
    (dict(timeline_path=3), "timeline_path=3 must be a file path"),
]

OTHERS = [
    (lambda: ElasticSampler(10, batch_size=True), "ElasticSampler batch_size=True must be an int >= 1"),
    (lambda: ElasticSampler(10, batch_size=0), "ElasticSampler batch_size=0 must be an int >= 1"),
    (lambda: ElasticSampler(10, batch_size=2, shuffle="no"), "ElasticSampler shuffle='no' must be True or False"),
    (lambda: ElasticSampler(10, batch_size=2, seed=None), "ElasticSampler seed=None must be an int >= 0"),
    (lambda: ElasticSampler(-5, batch_size=2), "ElasticSampler dataset size=-5 must be an int >= 0"),
    (lambda: ElasticSampler(object(), batch_size=2), "ElasticSampler dataset=<object object"),
    (lambda: ElasticSampler(10, batch_size=2).set_epoch(True), "set_epoch epoch=True must be an int >= 0"),
    (lambda: TorchState(model=3), "TorchState model= must be a torch.nn.Module, got int"),
    (lambda: TorchState(optimizer="adam"), "TorchState optimizer= must be a torch.optim.Optimizer, got str"),
    (lambda: er.DistributedOptimizer(_opt(), backward_passes_per_step=True), "backward_passes_per_step=True"),
    (lambda: er.DistributedOptimizer(_opt(), backward_passes_per_step=0), "backward_passes_per_step=0"),
    (lambda: er.DistributedOptimizer(_opt(), fusion_threshold_bytes=True), "fusion_threshold_bytes=True"),
    (lambda: er.DistributedOptimizer(_opt(), compression="fp16"), "compression='fp16' is not a compressor"),
    (lambda: er.DistributedOptimizer(_opt(), op="median"), "op='median' is not a reduction"),
    (lambda: _spec(round_id=True), "RingSpec.round_id=True must be an int >= 0"),
    (lambda: _spec(rank=5), "RingSpec.rank=5 must be an int >= 0 and <= 1"),
    (lambda: _spec(store=er.StoreAddress("127.0.0.1", True)), "StoreAddress.port=True must be an int >= 1"),
    (lambda: _spec(collective_timeout_s=NAN), "RingSpec.collective_timeout_s=nan must be a finite number"),
    (lambda: _spec(job_id=5), "RingSpec.job_id=5 must be a non-empty string"),
    (lambda: _spec(backend="mpi"), "RingSpec.backend='mpi' is unknown"),
    (lambda: _spec(auth_key=b"short"), "RingSpec.auth_key must be a secret of at least 16 bytes"),
    (lambda: CheckpointConfig("relative/dir", every_n_commits=1), "is a relative path"),
    (lambda: CheckpointConfig("/data/c", every_n_commits=True), "every_n_commits=True"),
    (lambda: CheckpointConfig("/data/c", every_n_commits=1, keep_last=0), "keep_last=0"),
    (lambda: CheckpointConfig("/data/c", every_n_commits=1, run_id="a/b"), "run_id='a/b'"),
]


@pytest.mark.parametrize("kwargs, message", TRAINER, ids=[next(iter(k)) for k, _ in TRAINER])
def test_bad_trainer_options(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainerConfig(**kwargs)


@pytest.mark.parametrize("make, message", OTHERS, ids=[m.split("=")[0][-30:] for _, m in OTHERS])
def test_bad_options_elsewhere(make, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        make()


def test_the_table_covers_at_least_thirty_bad_values():
    assert len(TRAINER) + len(OTHERS) >= 30


def test_defaults_and_derived():
    c = TrainerConfig(min_workers=2, max_workers=4)
    assert c.backend == "gloo" and c.worker_gpus == 0
    g = TrainerConfig(use_gpu=True)
    assert g.backend == "nccl" and g.worker_gpus == 1.0
    assert TrainerConfig(checkpoint_uri="s3://b/j", checkpoint_every_s=30).checkpoint_cadence == (None, 30)
    assert TrainerConfig(checkpoint_uri="/data/ckpt").checkpoint_cadence == (None, 300.0)
    limits = TrainerConfig(collective_timeout_s=20, connect_timeout_s=10).limits
    assert limits.stuck_after_s == 20 + 10 + 2.0 and limits.suspect_after_s == 1.5
    # heartbeats per node (auto from 64 workers, or asked for): a beat may wait one interval for its forwarder
    assert TrainerConfig(max_workers=64).limits.suspect_after_s == 2.0
    assert TrainerConfig(max_workers=4, heartbeats="node").limits.suspect_after_s == 2.0
    assert TrainerConfig(max_workers=64, heartbeats="worker").limits.suspect_after_s == 1.5
    # "auto" stays per worker when heartbeat_timeout_s is too short for per node; "node" with it is refused
    assert TrainerConfig(max_workers=64, heartbeat_timeout_s=1.5).heartbeat_mode == "worker"
    assert TrainerConfig(max_workers=64, heartbeat_timeout_s=2.0).heartbeat_mode == "node"
    with pytest.raises(ValueError, match=r"heartbeats='node' with heartbeat_timeout_s=1.5.*heartbeat_timeout_s >= 2"):
        TrainerConfig(heartbeats="node", heartbeat_timeout_s=1.5)
