"""``ray_integration.train`` as a drop-in for ``ray.train``: Ray's names and signatures, what is refused, and on real
Ray: Ray Train's own linear example (only its imports changed) under a SIGKILL with a replacement joining, an
exception of the training function counted as Ray counts it, and a script that also keeps its state in a
``TorchState`` (step-exact: every sample once per epoch across a kill and a join)."""

from __future__ import annotations

import contextlib
import glob
import inspect
import json
import os
import warnings

import pytest
import torch

import ray_integration.train as train
from ray_integration.train import _config
from ray_integration.train._dropin import Options, Session, _enter, takes_config
from ray_integration.train.torch import TorchTrainer, prepare_data_loader, prepare_model


# ---------------------------------------------------------------- names, signatures, refusals (no Ray cluster)
def test_rays_own_classes_are_re_exported():
    import ray.train
    import ray.train.torch

    for name in ("Checkpoint", "ScalingConfig", "RunConfig", "FailureConfig", "CheckpointConfig", "CheckpointUploadMode",
                 "DataConfig", "Result", "TrainingFailedError", "WorkerGroupError", "ControllerError"):
        assert getattr(train, name) is getattr(ray.train, name), name
    assert train.torch.TorchConfig is ray.train.torch.TorchConfig
    assert train.torch.TorchCheckpoint is ray.train.torch.TorchCheckpoint
    with pytest.raises(AttributeError, match="Result.best_checkpoints"):
        train.get_all_reported_checkpoints  # noqa: B018


def test_signatures_are_ray_trains():
    import ray.train
    import ray.train.torch

    for ours, theirs in ((TorchTrainer.__init__, ray.train.torch.TorchTrainer.__init__), (train.report, ray.train.report),
                         (prepare_model, ray.train.torch.prepare_model),
                         (prepare_data_loader, ray.train.torch.prepare_data_loader),
                         (train.torch.enable_reproducibility, ray.train.torch.enable_reproducibility)):
        assert [(p.name, p.kind) for p in inspect.signature(ours).parameters.values()] == \
            [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()], ours
    with pytest.raises(TypeError):  # train_loop_config is keyword-only, as in Ray
        TorchTrainer(lambda config: None, {"lr": 1})  # type: ignore[misc]


def test_what_ray_train_v2_deprecated_raises_and_what_is_refused_names_the_argument(tmp_path):
    for call in (lambda: train.torch.accelerate(), lambda: train.torch.backward(torch.ones(1)),
                 lambda: train.torch.prepare_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)),
                 lambda: TorchTrainer(lambda: None, metadata={"a": 1}),
                 lambda: TorchTrainer(lambda: None, resume_from_checkpoint=train.Checkpoint(str(tmp_path))),
                 lambda: train.get_context().get_trial_name()):
        with pytest.raises(DeprecationWarning):
            call()
    with pytest.raises(ValueError, match="takes 2 required arguments"):
        TorchTrainer(lambda a, b: None)
    with pytest.raises(ValueError, match=r"parallel_strategy='fsdp'"):
        prepare_model(torch.nn.Linear(1, 1), parallel_strategy="fsdp")
    with pytest.raises(ValueError, match="static_graphs"):
        prepare_model(torch.nn.Linear(1, 1), parallel_strategy_kwargs={"static_graphs": True})
    with pytest.raises(ValueError, match="checkpoint_upload_fn"):
        train.report({}, checkpoint_upload_fn=lambda c, d: c)
    with pytest.raises(ValueError, match="num_workers=0"):
        TorchTrainer(lambda: None, scaling_config=train.ScalingConfig(num_workers=0))
    with pytest.raises(ValueError, match="backend='nccl'"):
        TorchTrainer(lambda: None, torch_config=train.torch.TorchConfig(backend="nccl"))
    assert takes_config(lambda: None) is False and takes_config(lambda config: None) is True
    assert takes_config(lambda config=None: None) is True


def test_outside_a_run_the_helpers_act_as_rays_local_mode():
    model = torch.nn.Linear(2, 1)
    assert prepare_model(model) is model  # one process, no ring: the model itself
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3, shuffle=True)
    assert prepare_data_loader(loader) is loader
    assert train.torch.get_device() == torch.device("cpu") and train.torch.get_devices() == [torch.device("cpu")]


def test_dropin_configs_follow_ray_trains_semantics(tmp_path):
    options, k = _config.translate_dropin(train.ScalingConfig(num_workers=3), train.RunConfig(storage_path=str(tmp_path)))
    assert (options["min_workers"], options["start_workers"], options["max_workers"], k) == (1, 3, 3, 0)
    assert options["checkpoint_uri"].startswith(str(tmp_path) + "/ray_train_run-")  # Ray's generated name, kept
    assert "max_failures" not in options  # Ray's default 0: a lost worker is recovered within our default budget
    options, k = _config.translate_dropin(
        train.ScalingConfig(num_workers=(2, 4)),
        train.RunConfig(name="job", storage_path=str(tmp_path), failure_config=train.FailureConfig(max_failures=2)))
    assert (options["min_workers"], options["max_workers"], options["max_failures"], k) == (2, 4, 2, 2)
    assert options["failure_window_s"] == _config.WHOLE_RUN_S and options["checkpoint_uri"] == str(tmp_path / "job")
    options, _ = _config.translate_dropin(None, None)  # Ray's defaults: one worker, ~/ray_results/<generated>
    assert options["max_workers"] == 1 and "/ray_results/ray_train_run-" in options["checkpoint_uri"]


def test_the_first_ring_waits_for_start_workers_and_the_floor_stays_min_workers():
    """ScalingConfig(num_workers=3) in the drop-in: start_workers=3, min_workers=1 (a new TrainerConfig option)."""
    from ray_integration.config import TrainerConfig
    from ray_integration.driver import context as c
    from ray_integration.driver.states import START_GRACE_S, Running, Starting
    from tests.test_driver_states import ctx, drive

    limits = TrainerConfig(min_workers=1, max_workers=3, start_workers=3).limits
    starting = Starting()
    drive(starting, ctx(limits=limits, joiners=("a", "b")))
    actions, nxt = drive(starting, ctx(now=100.0 + 10 * START_GRACE_S, limits=limits, joiners=("a", "b")))
    assert nxt is starting and not any(isinstance(a, c.Form) for a in actions)  # 2 of 3: it keeps waiting
    actions, nxt = drive(starting, ctx(now=100.0 + 11 * START_GRACE_S, limits=limits, joiners=("a", "b", "c")))
    assert actions[-1] == c.Form((), ("a", "b", "c"), reason="start") and isinstance(nxt, Running)
    assert TrainerConfig(min_workers=2, max_workers=3).limits.first_ring_workers == 2  # default: min_workers
    for bad in (dict(min_workers=2, max_workers=3, start_workers=1), dict(max_workers=2, start_workers=3),
                dict(start_workers=0)):
        with pytest.raises(ValueError, match="start_workers"):
            TrainerConfig(**bad)


def test_a_script_that_calls_ray_train_itself_gets_the_fix_and_an_exception_without_budget_is_raised(tmp_path):
    import ray.train

    def bug():
        raise KeyError("a bug")

    session = Session(Options(takes_config=False, max_failures=0, max_workers=1))
    try:
        with pytest.raises(RuntimeError, match=r"import ray_integration.train as train"):
            _enter(session, lambda: ray.train.report({"loss": 1.0}), {})
        with pytest.raises(KeyError, match="a bug"):  # Ray's default max_failures=0: fit() fails with it
            _enter(session, bug, {})
        assert session.entering  # it would enter again (after a re-form) if it were retried
    finally:
        session.close()


# ---------------------------------------------------------------- prepare_model's wrapper on a ring (no Ray)
def _wrapped_training(kind: str, steps: int, passes: int):
    import copy

    import elastic_ring as er
    from tests.test_optimizer import global_batch, make_model, make_optimizer, reference_training

    n, r, per_rank = er.size(), er.rank(), 6
    model = prepare_model(make_model(seed=r))  # every rank starts from rank 0's model (seed 0), as DDP's
    optimizer = make_optimizer(kind, model.parameters())  # the script's plain optimizer
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(passes):  # DDP's idiom: accumulate under no_sync(), reduce at the last pass
            x, y = global_batch(step * passes + k, n, per_rank)
            sl = slice(r * per_rank, (r + 1) * per_rank)
            with model.no_sync() if k < passes - 1 else contextlib.nullcontext():
                torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        optimizer.step()  # the gradients were averaged by the end of backward
    for p, e in zip(model.parameters(), reference_training(kind, n, per_rank, steps, passes)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)
    everyone = er.allgather_object([p.detach() for p in model.parameters()])
    copied = copy.deepcopy(model)
    return (all(torch.equal(a, b) for other in everyone for a, b in zip(everyone[0], other)),
            isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model.module).__name__,
            sorted(copied.state_dict())[:2], copied._reducer is None)


@pytest.mark.parametrize("kind, passes, world", [("sgd", 1, 3), ("adam", 2, 2)])
def test_prepare_model_averages_gradients_by_the_end_of_backward(ring, kind, passes, world):
    """The wrapper with the script's plain optimizer equals one process on the concatenated batch (no_sync()
    passes accumulate locally); ranks end identical; it is a DistributedDataParallel to the script."""
    for identical, is_ddp, inner, keys, copy_reduces_nothing in ring.run(_wrapped_training, kind, 3, passes,
                                                                         world_size=world):
        assert identical and is_ddp and inner == "Sequential" and copy_reduces_nothing
        assert keys == ["module.0.bias", "module.0.weight"], keys


# ---------------------------------------------------------------- on Ray
def test_prepare_data_loader_splits_a_shuffled_loader_over_the_real_ring(ray_session, tmp_path):  # ~10 s
    """Two workers, a shuffled DataLoader of 41 samples through prepare_data_loader: each rank's share is a
    DistributedSampler's of the ring (21 each, one padded, as Ray Train's), the shares are disjoint up to the
    padding and cover every sample in each epoch, and set_epoch reshuffles them."""
    from tests import dropin_jobs

    out = tmp_path / "shares"
    out.mkdir()
    TorchTrainer(dropin_jobs.partition, train_loop_config={"samples": 41, "out": str(out)},
                 scaling_config=train.ScalingConfig(num_workers=2),
                 run_config=train.RunConfig(name="partition", storage_path=str(tmp_path))).fit()
    shares = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert all(s["world"] == 2 and s["sampler"] == "DistributedSampler" for s in shares), shares
    for epoch in range(2):
        parts = [s["epochs"][epoch] for s in shares]
        assert [len(p) for p in parts] == [21, 21], parts  # ceil(41 / 2): the sampler pads with 1 repeat
        together = sum(parts, [])
        assert sorted(set(together)) == list(range(41)) and len(together) - len(set(together)) == 1, parts
    assert shares[0]["epochs"][0] != shares[0]["epochs"][1]  # set_epoch reshuffled


def _probe_marks(tmp, pattern="*-*.*.json"):
    return [json.loads(open(p).read()) for p in glob.glob(os.path.join(tmp, "marks", pattern))]


def _run_linear_example(tmp_path, monkeypatch, epochs: int, **probe) -> tuple[dict, list[dict], list[dict], float]:
    """Ray Train's torch_linear_example.py, only its imports changed, run by its own train_linear() on 2 workers;
    rank 1 SIGKILLs itself after its 20th optimizer step (the probe, tests/dropin_probe.py). Returns the metrics,
    each entry's first step (in time order), each final rank's parameters, and the kill's time."""
    from tests.dropin_probe import Instrumented
    from tests.ray_examples import torch_linear_example as script

    (tmp_path / "marks").mkdir()
    kill_file = str(tmp_path / "killed")
    monkeypatch.setattr(script, "TorchTrainer", Instrumented.configured(
        config_added={"data_size": 400, "val_size": 80},  # the script reads them from its config (default 1000)
        kill_file=kill_file, marks_dir=str(tmp_path / "marks"), victim_rank=1, kill_step=20, **probe))
    metrics = script.train_linear(num_workers=2, epochs=epochs, storage_path=str(tmp_path))
    marks = sorted(_probe_marks(str(tmp_path)), key=lambda m: m["first_step"])
    final = sorted(_probe_marks(str(tmp_path), "final-*.json"), key=lambda m: m["rank"])
    return metrics, marks, final, float(open(kill_file).read())


def _check_recovery(marks: list[dict], killed: float) -> float:
    after = [m for m in marks if m["first_step"] > killed]
    assert after and after[0]["round"] == 2 and after[0]["world"] == 1, marks  # the survivor, alone, in its process
    assert after[0]["pid"] in [m["pid"] for m in marks if m["round"] == 1], marks
    recovery = after[0]["first_step"] - killed
    print(f"kill -> the re-entered function's first step: {recovery:.3f} s (of which its own set-up "
          f"{after[0]['first_step'] - after[0]['entered']:.3f} s); entries {marks}")
    assert recovery < 5.0, recovery  # measured 0.04-0.25 s here; benchmarks/recovery.py times it beside Ray Train
    return recovery


def test_rays_linear_example_survives_a_sigkill(ray_session, tmp_path, monkeypatch):
    """Rank 0 keeps its process and re-enters the training function at once, alone (the script resumes from
    nothing: it never calls get_checkpoint, as under Ray Train); the run completes, every rank of the final ring
    with the same parameters."""
    metrics, marks, final, killed = _run_linear_example(tmp_path, monkeypatch, epochs=2)
    assert set(metrics) == {"loss"} and metrics["loss"] < 50, metrics
    _check_recovery(marks, killed)
    assert final and [m["rank"] for m in final] == list(range(final[0]["world"])), final
    assert final[0]["params"] is not None and all(m["params"] == final[0]["params"] for m in final), final


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: the replacement's process starts while rank 0 trains alone
def test_rays_linear_example_survives_a_sigkill_and_a_replacement_joins(ray_session, tmp_path, monkeypatch):
    """The same, held open while rank 0 trains alone: the replacement joins at the next report with a checkpoint,
    where both re-enter the function; the final ring has both workers, with equal parameters."""
    metrics, marks, final, killed = _run_linear_example(tmp_path, monkeypatch, epochs=3, slow_below_size=2)
    _check_recovery(marks, killed)
    assert [m["rank"] for m in final] == [0, 1] and {m["world"] for m in final} == {2}, final
    assert final[0]["round"] == final[1]["round"] == marks[-1]["round"] >= 3, (final, marks)
    assert final[0]["params"] == final[1]["params"] and final[0]["params"] is not None, final


def test_an_exception_re_enters_from_the_newest_checkpoint_until_max_failures(ray_session, tmp_path):
    """FailureConfig(max_failures=1): rank 1's first ValueError re-enters the function on both workers, which
    resume from the newest reported checkpoint (step 2); its second one fails fit() with Ray's WorkerGroupError
    naming rank 1 and the error. (With Ray's default, max_failures=0, the first one does: the test above.)"""
    from tests import dropin_jobs

    run = train.RunConfig(name="raises", storage_path=str(tmp_path), failure_config=train.FailureConfig(max_failures=1))
    trainer = TorchTrainer(dropin_jobs.raises, train_loop_config={"steps": 8, "raise_at": 2},
                           scaling_config=train.ScalingConfig(num_workers=2), run_config=run)
    with pytest.raises(train.WorkerGroupError) as caught:
        trainer.fit()
    assert isinstance(caught.value, train.TrainingFailedError) and list(caught.value.worker_failures) == [1]
    assert "a bug at step 4, resumed from 2" in str(caught.value), caught.value
    # as Ray Train's: the rank's entry wraps the exception the function raised with its traceback
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    failure = caught.value.worker_failures[1]
    assert isinstance(failure, UserExceptionWithTraceback) and "Traceback" in str(failure), repr(failure)
    assert type(failure._base_exc) is ValueError and str(failure._base_exc) == "a bug at step 4, resumed from 2"


@pytest.mark.slow  # ~20 s: a kill, a replacement's start and its join
def test_a_script_with_a_torch_state_keeps_every_sample_once_across_a_kill_and_a_join(ray_session, tmp_path):
    from tests import dropin_jobs

    n, batch, epochs = 96, 4, 3
    result = TorchTrainer(dropin_jobs.stateful,
                          train_loop_config={"samples": n, "batch": batch, "epochs": epochs, "kill": (1, 1, 5),
                                             "slow_below_size": 3},
                          scaling_config=train.ScalingConfig(num_workers=3),
                          run_config=train.RunConfig(name="stateful", storage_path=str(tmp_path))).fit()
    value = result.return_value
    assert value["seen"] == [float(epochs)] * n, "every sample exactly once per epoch"
    assert value["identical"] and value["world"] == 3 and value["round"] >= 3, value
    assert not value["wrapper_reduces"], "the er.DistributedOptimizer reduces; prepare_model's wrapper stepped aside"
    assert result.checkpoint is not None and result.metrics["step"] % 3 == 0, result.metrics


@pytest.mark.slow  # ~30 s: 10 epochs of an MLP on 28x28 images
def test_rays_fashion_mnist_example_survives_a_sigkill(ray_session, tmp_path, monkeypatch):
    """Ray Train's torch_fashion_mnist_example.py, only its imports changed (its body writes ``ray.train.X``:
    ``import ray_integration as ray``), on FashionMNIST made locally by a torchvision stand-in, run by its own
    train_fashion_mnist(num_workers=2): rank 1 is SIGKILLed in epoch 1; rank 0 re-enters the function at once and
    trains the 10 epochs again alone (the script reports no checkpoint, so no replacement is admitted and, as in Ray
    Train V2, ``Result.metrics`` is None)."""
    from tests.dropin_probe import Instrumented
    from tests.ray_examples import torch_fashion_mnist_example as script

    (tmp_path / "marks").mkdir()
    kill_file = str(tmp_path / "killed")
    monkeypatch.setattr(script, "TorchTrainer", Instrumented.configured(  # storage_path: not ~/ray_results
        kill_file=kill_file, marks_dir=str(tmp_path / "marks"), victim_rank=1, kill_step=40,
        storage_path=str(tmp_path)))
    script.train_fashion_mnist(num_workers=2, use_gpu=False)
    marks = sorted(_probe_marks(str(tmp_path)), key=lambda m: m["first_step"])
    _check_recovery(marks, float(open(kill_file).read()))
    final = _probe_marks(str(tmp_path), "final-*.json")
    assert [m["rank"] for m in final] == [0] and final[0]["wrapped"] == "ElasticDataParallel", final
    assert final[0]["metrics"]["accuracy"] > 0.5, final  # chance is 0.1


def test_losing_rank_0_its_only_holder_resumes_from_the_checkpoint_its_last_report_returned_with(ray_session,
                                                                                                  tmp_path):
    """Found by a review: report's default upload was in the background, so a rank 0 killed right after report()
    returned left the survivors the previous checkpoint (Ray Train's default, SYNC, resumes from that report's)."""
    from tests import dropin_jobs

    log = tmp_path / "log.jsonl"
    TorchTrainer(dropin_jobs.rank0_reports_then_dies,
                 train_loop_config={"log": str(log), "steps": 3, "kill_after": 2, "blob_mib": 96},
                 scaling_config=train.ScalingConfig(num_workers=2),
                 run_config=train.RunConfig(name="r0", storage_path=str(tmp_path))).fit()
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["resumed_from"] for e in entries if e["round"] > 1] == [2], entries
