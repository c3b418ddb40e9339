"""Two public scripts ported with the fewest changes (Horovod's elastic MNIST example, Ray Train's
fashion-MNIST example) run on real Ray with two to three workers: one rank is SIGKILLed right after
``optimizer.step()`` and before the loop's own loss allreduce, mid-epoch, and a replacement joins.

Checked for each: the run completes; ``worker_lost``, ``recovered`` and ``worker_joined`` happen, the
join mid-epoch (commits are only at epoch ends); ``len(train_loader)`` is constant within an epoch of a
ring; every training sample is used exactly once per epoch (counted exactly: a parameter whose
gradient is the batch's one-hot hits moves only with the optimizer's applied steps); every rank ends
with identical parameters; the held-out accuracy is above chance; a torch ``DistributedSampler`` test
split matches the final ring. The Ray Train port reports a checkpoint every epoch (``report(metrics,
checkpoint=...)``, uploaded in the background, flushed when ``fn`` returns) and resumes from ``get_checkpoint()``
after every worker was killed.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from ray.train import RunConfig, ScalingConfig

from examples import horovod_elastic_mnist, ray_train_fashion_mnist
from ray_integration import ElasticTrainer, RunFailed, WorkerError, load_checkpoint
from state.checkpoints.reported import ReportedCheckpoints

KILL = (1, 1, 6)  # (round, rank, step): rank 1 of the first ring, right after its 6th optimizer step


def check_events(result):
    kinds = [e.kind for e in result.events]
    for kind in ("worker_lost", "recovered", "worker_joined", "finished"):
        assert kind in kinds, kinds
    lost = [e for e in result.events if e.kind == "worker_lost"]
    assert len(lost) == 1 and lost[0].round_id == KILL[0], [(e.kind, e.round_id, e.detail) for e in result.events]
    return kinds


def reports(result):
    return [m for m in result.metrics_history if "position" in m]


def check_join_mid_epoch(result, samples):
    """The joiner's first ring trained from inside an epoch: the last report before that ring and the first
    in it are in the same epoch, and the last one before was not at the epoch's end."""
    joined = [e for e in result.events if e.kind == "worker_joined"]
    join_round = joined[0].round_id
    before = [m for m in reports(result) if m["round"] < join_round]
    after = [m for m in reports(result) if m["round"] == join_round]
    assert before and after, "rings before and with the joiner trained"
    assert after[0]["epoch"] == before[-1]["epoch"] and 0 < before[-1]["position"] < samples, (before[-1], after[0])
    assert joined[0].detail["waited_s"] is not None and joined[0].detail["waited_s"] < 5.0, joined[0].detail
    return join_round


def check_lengths(result):
    """len(train_loader) is constant within each ring's part of an epoch (recomputed only at a resize)."""
    seen = {}
    for m in reports(result):
        seen.setdefault((m["round"], m["epoch"]), set()).add(m["batches"])
    assert all(len(v) == 1 for v in seen.values()), seen
    assert all(b > 0 for v in seen.values() for b in v), seen


def check_test_split(value, test_images):
    world = value["world"]
    assert value["test_images"] == math.ceil(test_images / world) * world, value
    split = value["test_split"]  # (num_replicas, rank) of each rank's test DistributedSampler, then (size, rank)
    assert [(n, r) for n, r, _, _ in split] == [(size, rank) for _, _, size, rank in split], split


@pytest.mark.slow  # ~20 s; tests/test_launch.py runs the same Horovod example under a SIGKILL by default
def test_horovod_elastic_mnist_port_survives_a_kill_and_a_join(ray_session):
    started = time.monotonic()
    epochs = 3
    result = ElasticTrainer(min_workers=2, max_workers=3, progress=False).run(
        horovod_elastic_mnist.train_fn,
        config={"epochs": epochs, "batch_size": 16, "log_interval": 1, "batches_per_commit": 0, "lr": 0.05,
                "count_hits": True, "kill": KILL, "step_delay_s": 0.06})
    wall = time.monotonic() - started
    value = result.value
    print(f"horovod port: test accuracy {value['test_accuracy']:.4f}, world {value['world']}, "
          f"{value['steps']} steps, {wall:.1f} s; events {[e.kind for e in result.events]}")
    assert result.completed
    check_events(result)
    train_images = len(value["seen"])
    check_join_mid_epoch(result, train_images)
    check_lengths(result)
    assert value["seen"] == [float(epochs)] * train_images, "every training image exactly once per epoch"
    assert value["identical"], "every rank of the final ring holds identical parameters"
    assert value["epochs"] == epochs
    check_test_split(value, 360)
    assert value["test_accuracy"] > 0.5, value  # chance is 0.1


@pytest.mark.slow  # ~20 s; Ray's own scripts under a SIGKILL stay in the default suite through the drop-in (tests/test_dropin_train.py)
def test_ray_train_fashion_mnist_port_survives_a_kill_and_a_join(ray_session, tmp_path):
    started = time.monotonic()
    epochs, train_samples, test_samples = 3, 1536, 384
    result = ElasticTrainer(scaling_config=ScalingConfig(num_workers=(2, 3)),
                            run_config=RunConfig(storage_path=str(tmp_path), name="fashion"), progress=False).run(
        ray_train_fashion_mnist.train_func_per_worker,
        config={"lr": 1e-3, "epochs": epochs, "batch_size_per_worker": 16, "train_samples": train_samples,
                "test_samples": test_samples, "log_every": 1, "count_hits": True, "kill": KILL,
                "step_delay_s": 0.06, "checkpoint": True})
    wall = time.monotonic() - started
    value = result.value
    print(f"ray train port: rank 0's shard accuracy {value['accuracy']:.4f}, whole test set "
          f"{value['ring_accuracy']:.4f}, world {value['world']}, {value['steps']} steps, {wall:.1f} s; "
          f"events {[e.kind for e in result.events]}")
    assert result.completed
    check_events(result)
    check_join_mid_epoch(result, train_samples)
    check_lengths(result)
    assert value["seen"] == [float(epochs)] * train_samples, "every training image exactly once per epoch"
    assert value["identical"], "every rank of the final ring holds identical parameters"
    assert value["epochs"] == epochs
    check_test_split(value, test_samples)  # the loop's DistributedSampler was re-pointed at the new rings
    epoch_reports = [m for m in result.metrics_history if "accuracy" in m]
    assert len(epoch_reports) >= epochs and all(0.0 <= m["accuracy"] <= 1.0 for m in epoch_reports), epoch_reports
    assert value["ring_accuracy"] > 0.3, value  # chance is 0.1
    # Ray Train's Result: the last reported record, and the last epoch's reported checkpoint (rank 0's upload)
    assert result.metrics["epoch"] == epochs - 1 and result.metrics["accuracy"] == epoch_reports[-1]["accuracy"]
    assert result.path == str(tmp_path / "fashion") and value["resumed_epoch"] is None
    assert "/fashion/reported/ckpt-" in result.checkpoint.path and result.checkpoint.path.endswith("/files")
    saved = torch.load(os.path.join(load_checkpoint(result.checkpoint), "checkpoint.pt"))
    assert saved["epoch"] == epochs - 1 and saved["model"]["hits"].round().tolist() == value["seen"]


def port_with_sync_reports(config):
    """The port with its reports in Ray Train's default upload mode (``CheckpointUploadMode.SYNC``: rank 0's
    ``report`` returns once the checkpoint is durable), so that a SIGKILL right after ``report`` finds it written
    (with the background upload, elastic_ring's default, it would race the upload)."""
    import functools

    from ray.train import CheckpointUploadMode

    import ray_integration.train

    ray_train_fashion_mnist.report = functools.partial(ray_integration.train.report,
                                                       checkpoint_upload_mode=CheckpointUploadMode.SYNC)
    return ray_train_fashion_mnist.train_func_per_worker(config)


@pytest.mark.slow  # ~14 s; resuming after the whole ring is lost stays covered by tests/test_trainer_ray.py and tests/chaos/test_compound.py
def test_ray_train_port_resumes_from_get_checkpoint_after_every_worker_is_killed(ray_session, tmp_path):
    """Every worker is SIGKILLed at once right after epoch 0's report (its checkpoint written by rank 0, reported
    with checkpoint_upload_mode=SYNC): the run fails. The same script at the same storage path resumes from
    get_checkpoint() at epoch 1 and trains each remaining sample once per epoch."""
    epochs, train_samples = 3, 768
    options = dict(scaling_config=ScalingConfig(num_workers=2), progress=False,
                   run_config=RunConfig(storage_path=str(tmp_path), name="fashion"))
    config = {"lr": 1e-3, "epochs": epochs, "batch_size_per_worker": 16, "train_samples": train_samples,
              "test_samples": 128, "count_hits": True, "checkpoint": True}
    with pytest.raises((RunFailed, WorkerError)):
        ElasticTrainer(**options).run(port_with_sync_reports, config={**config, "kill_all_after_epoch": 0})
    first = ReportedCheckpoints(str(tmp_path / "fashion"))
    assert first.complete() == [1], first.complete()  # epoch 0's; the run died before it went on
    result = ElasticTrainer(**options).run(ray_train_fashion_mnist.train_func_per_worker, config=config)
    value = result.value
    assert value["resumed_epoch"] == 0, value["resumed_epoch"]
    assert value["seen"] == [float(epochs)] * train_samples, "each sample once per epoch, across both runs"
    assert value["steps"] == (epochs - 1) * train_samples // (2 * 16), "only the remaining epochs were trained"
    assert value["identical"]
    assert [m["epoch"] for m in result.metrics_history if "accuracy" in m] == [1, 2]
    assert first.complete() == [1, 2, 3]


def test_an_elastic_sampler_built_before_the_ring_is_cut_for_the_ring_at_the_first_sync(ray_session):
    """Horovod's order without hvd.init(): the sampler is built first, the ring is formed lazily by the next
    er.size(), before @er.elastic.run; the state's first sync cuts the sampler for that ring."""
    result = ElasticTrainer(min_workers=2, max_workers=2, progress=False).run(
        horovod_elastic_mnist.train_fn,
        config={"epochs": 1, "batch_size": 32, "log_interval": 100, "batches_per_commit": 0, "count_hits": True,
                "init_ring_first": False})
    assert result.completed
    assert set(result.value["seen"]) == {1.0}, sorted(set(result.value["seen"]))
