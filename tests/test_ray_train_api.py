"""Ray Train's names: the configs translated to ElasticTrainer's options, reported checkpoints (written, verified,
pruned, refused), Result's Ray Train fields, load_checkpoint, and report / get_checkpoint / get_context on Ray."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

import state
from ray_integration import ElasticTrainer, Result, load_checkpoint
from ray_integration.train import get_checkpoint, get_context, report
from ray_integration.config import TrainerConfig
from state import CheckpointError, CheckpointRefused
from state.checkpoints.config import set_default_checkpointing
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.reported import ReportedCheckpoints
from state.checkpoints.store import CheckpointStore


# ---------------------------------------------------------------- configs
def test_scaling_and_run_config_become_options(tmp_path):
    trainer = ElasticTrainer(
        scaling_config=ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 2, "slot": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="job", failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)), progress=False)
    c = trainer.config
    assert (c.min_workers, c.max_workers, c.cpus_per_worker, c.resources_per_worker) == (2, 4, 2.0, {"slot": 1})
    assert c.checkpoint_uri == str(tmp_path / "job") and c.checkpoint_keep_last == 2 and c.max_failures == -1
    assert c.limits.max_failures > 10**9  # -1: no limit
    fixed = ElasticTrainer(scaling_config=ScalingConfig(num_workers=3)).config
    assert (fixed.min_workers, fixed.max_workers, fixed.checkpoint_uri, fixed.max_failures) == (3, 3, None, 10)


def test_failure_config_max_failures_only_and_other_fields_warn():
    """Only max_failures is compared with Ray's default; each other field set is named in a warning, not turned
    into max_failures=0 (FailureConfig(max_preemption_failures=3) used to fail the run on the first loss)."""
    with pytest.warns(UserWarning, match=r"ignores run_config.failure_config.max_preemption_failures=3: a preempted"):
        c = ElasticTrainer(run_config=RunConfig(failure_config=FailureConfig(max_preemption_failures=3))).config
    assert c.max_failures == 10  # our default: max_failures was not set
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ElasticTrainer(run_config=RunConfig(failure_config=FailureConfig(
            max_failures=2, controller_failure_limit=0, relax_collectives_on_preemption=True,
            preemption_grace_s=5.0))).config
    named = sorted(str(w.message).split("failure_config.")[1].split("=")[0] for w in caught)
    assert named == ["controller_failure_limit", "preemption_grace_s", "relax_collectives_on_preemption"], named
    assert c.max_failures == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray's defaults: no warning
        assert ElasticTrainer(run_config=RunConfig(failure_config=FailureConfig())).config.max_failures == 10
        # an explicit max_failures=0 is Ray's default value: it cannot be told from no FailureConfig (documented)
        explicit_zero = RunConfig(failure_config=FailureConfig(max_failures=0))
        assert ElasticTrainer(run_config=explicit_zero).config.max_failures == 10
        assert ElasticTrainer(max_failures=0, run_config=RunConfig()).config.max_failures == 0


def test_v1_fail_fast_is_max_failures_zero():
    from ray.air.config import FailureConfig as FailureConfigV1, RunConfig as RunConfigV1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # V1's RunConfig
        run_config = RunConfigV1(failure_config=FailureConfigV1(fail_fast=True))
    assert ElasticTrainer(run_config=run_config).config.max_failures == 0


def test_a_name_without_storage_path_warns_and_is_refused_on_several_nodes(monkeypatch):
    import ray

    with pytest.warns(UserWarning, match=r"RunConfig\(name='solo'\) without storage_path.*RunConfig\(storage_path="):
        trainer = ElasticTrainer(run_config=RunConfig(name="solo"))
    assert trainer.config.checkpoint_uri == os.path.join(os.path.expanduser("~/ray_results"), "solo")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    trainer._check_cluster()  # one live node: its disk is the only one
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    with pytest.raises(ValueError, match=r"has 2 nodes.*set RunConfig\(storage_path=\.\.\.\)"):
        trainer._check_cluster()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = ElasticTrainer(run_config=RunConfig(storage_path="/shared/runs", name="solo"))
    shared._check_cluster()  # a storage_path given: the user's choice


def test_run_config_defaults_are_not_options(tmp_path):
    """RunConfig() fills in a generated name, ~/ray_results and FailureConfig(): none of them is a choice."""
    c = ElasticTrainer(run_config=RunConfig(), max_failures=3).config
    assert c.checkpoint_uri is None and c.max_failures == 3


def test_relative_storage_path_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = ElasticTrainer(run_config=RunConfig(storage_path="results", name="run1")).config
    assert c.checkpoint_uri == str(tmp_path / "results" / "run1")


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_workers=4, scaling_config=ScalingConfig(num_workers=(1, 2))),
     r"ElasticTrainer got max_workers=4 and scaling_config.num_workers=\(1, 2\); give one"),
    (dict(checkpoint_uri="/tmp/a", run_config=RunConfig(storage_path="/tmp/b", name="n")),
     r"got checkpoint_uri='/tmp/a' and run_config=RunConfig\(storage_path='/tmp/b', name='n'\); give one"),
    (dict(max_failures=3, run_config=RunConfig(failure_config=FailureConfig(max_failures=5))),
     r"got max_failures=3 and run_config.failure_config.max_failures=5"),
    (dict(run_config=RunConfig(storage_path="/tmp/b")), r"needs a name too .*which Ray generated.*RunConfig\(name="),
    (dict(scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD")), r"placement_strategy='SPREAD'"),
    (dict(scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"memory": 10**9})), r"'memory'"),
    (dict(run_config=RunConfig(storage_path="/tmp/b", name="n",
                              checkpoint_config=CheckpointConfig(checkpoint_score_attribute="acc"))),
     r"checkpoint_score_attribute='acc' is not supported"),
    (dict(max_failures=-2), r"max_failures=-2 must be an int >= 0; or -1 for no limit"),
])
def test_config_errors_name_the_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElasticTrainer(**kwargs)


def test_the_same_value_both_ways_is_not_a_conflict():
    assert ElasticTrainer(max_workers=2, min_workers=2, scaling_config=ScalingConfig(num_workers=2)).config.max_workers == 2


def test_config_and_datasets_types_are_checked():
    with pytest.raises(TypeError, match=r"scaling_config=\{'num_workers': 2\} must be a ray.train.ScalingConfig"):
        ElasticTrainer(scaling_config={"num_workers": 2})
    with pytest.raises(TypeError, match=r"datasets=\{'train': 'list'\} must be a dict of name -> ray.data.Dataset"):
        ElasticTrainer(datasets={"train": [1, 2]})
    with pytest.raises(ValueError, match="max_failures"):
        TrainerConfig(max_failures=True)


# ---------------------------------------------------------------- reported checkpoints
def write_dir(path, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        target = path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return str(path)


def test_a_reported_checkpoint_is_uploaded_verified_and_pruned(tmp_path):
    store = ReportedCheckpoints(str(tmp_path / "loc"), keep_last=2, run_id="run-a")
    for i in range(3):
        seq, url = store.save(write_dir(tmp_path / f"d{i}", {"model.pt": bytes([i]) * 1000, "sub/meta.json": b"{}"}),
                              {"epoch": i})
        assert seq == i + 1 and url.endswith(f"/loc/reported/ckpt-{seq:012d}/files")
    assert store.complete() == [2, 3]  # keep_last=2
    manifest = json.loads((tmp_path / "loc/reported/ckpt-000000000003/MANIFEST.json").read_text())
    assert manifest["run_id"] == "run-a" and manifest["metrics"] == {"epoch": 2}
    assert sorted(manifest["files"]) == ["model.pt", "sub/meta.json"] and manifest["files"]["model.pt"]["bytes"] == 1000
    seq, local, _ = store.newest(lambda n: str(tmp_path / f"out{n}"))
    assert seq == 3 and (tmp_path / "out3/model.pt").read_bytes() == bytes([2]) * 1000
    assert (tmp_path / "out3/sub/meta.json").read_bytes() == b"{}"
    assert not any(p.name.startswith("ckpt-") for p in (tmp_path / "loc").iterdir())  # the state's names untouched


def test_a_corrupt_reported_checkpoint_falls_back_and_a_torn_one_is_invisible(tmp_path):
    store = ReportedCheckpoints(str(tmp_path / "loc"), keep_last=5)
    store.save(write_dir(tmp_path / "a", {"w": b"first"}))
    store.save(write_dir(tmp_path / "b", {"w": b"second"}))
    (tmp_path / "loc/reported/ckpt-000000000002/files/w").write_bytes(b"secXnd")  # same size, other bytes
    (tmp_path / "loc/reported/ckpt-000000000003/files").mkdir(parents=True)  # a write killed before its manifest
    (tmp_path / "loc/reported/ckpt-000000000003/files/w").write_bytes(b"torn")
    assert store.complete() == [1, 2]
    found = store.newest(lambda n: str(tmp_path / f"o{n}"))  # logs the corrupt one, falls back
    assert found[0] == 1 and (tmp_path / "o1/w").read_bytes() == b"first"
    assert not (tmp_path / "o2").exists()  # the corrupt download was removed
    with pytest.raises(CheckpointError, match=r"ckpt-000000000002/files/w is corrupt"):
        store.download(2, str(tmp_path / "again"))


def test_another_runs_lease_refuses_the_write_and_forged_paths_are_refused(tmp_path):
    loc = str(tmp_path / "loc")
    lease = CheckpointLease(loc, "other-run", ttl_s=5).acquire()
    try:
        with pytest.raises(CheckpointError, match=r"leased by run 'other-run'.*RunConfig\(storage_path=\.\.\., name"):
            ReportedCheckpoints(loc, run_id="me").save(write_dir(tmp_path / "a", {"w": b"x"}))
        ReportedCheckpoints(loc, run_id="other-run").save(write_dir(tmp_path / "a", {"w": b"x"}))
    finally:
        lease.release()
    path = tmp_path / "loc/reported/ckpt-000000000001/MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {"../../evil": manifest["files"]["w"]}
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not describe its files"):
        ReportedCheckpoints(loc).newest(lambda n: str(tmp_path / f"o{n}"))


def test_report_outside_a_run_checks_its_arguments(tmp_path):
    set_default_checkpointing(None)
    with pytest.raises(TypeError, match=r"^report\(metrics=\.\.\.\) must be a dict of str"):
        report([1.0])
    with pytest.raises(TypeError, match=r"^report\(metrics=\{'w\[1\]': \.\.\.\}\) got a Tensor.*float\(t\)"):
        report({"w": [1.0, torch.ones(2)]})
    with pytest.raises(TypeError, match=r"^report\(metrics=\{'x': \.\.\.\}\) got a object"):
        report({"x": object()})
    with pytest.raises(ValueError, match=r"report\(checkpoint_upload_mode='NO_UPLOAD'\) is not supported"):
        report({"loss": 1.0}, checkpoint_upload_mode="NO_UPLOAD")
    with pytest.raises(ValueError, match=r"\['rank'\]: every record carries"):
        report({"rank": 1})
    with pytest.raises(ValueError, match=r"RunConfig\(storage_path=\.\.\., name=\.\.\.\) or checkpoint_uri"):
        report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(str(tmp_path)))
    with pytest.raises(TypeError, match="must be a ray.train.Checkpoint"):
        report({"loss": 1.0}, checkpoint=str(tmp_path))
    assert get_checkpoint() is None


def test_report_accepts_what_ray_train_accepts(monkeypatch):
    """None, lists and nested dicts reach the record (Result.metrics); numpy scalars become numbers."""
    import numpy as np

    import elastic_ring as er
    from elastic_ring.ring.report import set_reporter

    records = []
    set_reporter(records.append)
    try:
        report({"loss": 0.5, "epoch": 1})  # numbers and strings: er.report's path
        report({"val_loss": None, "hist": [1, 2.5, None], "per_class": {"cat": {"f1": 0.9}}, "n": np.int64(3),
                "pair": (1, "a")})
        report({})
    finally:
        set_reporter(None)
    assert records[0]["loss"] == 0.5 and records[0]["rank"] == 0 and "time" in records[0]
    second = records[1]
    assert second["val_loss"] is None and second["hist"] == [1, 2.5, None]
    assert second["per_class"] == {"cat": {"f1": 0.9}} and second["n"] == 3 and type(second["n"]) is int
    assert second["pair"] == [1, "a"] and second["rank"] == 0 and second["world_size"] == 1
    assert json.loads(json.dumps(second)) == second and set(records[2]) >= {"time", "rank", "round", "world_size"}


def test_get_dataset_shard_takes_ray_trains_keyword():
    from ray_integration.train import get_dataset_shard

    for call in (lambda: get_dataset_shard(dataset_name="train"), lambda: get_dataset_shard("train"),
                 lambda: get_dataset_shard(name="train")):
        with pytest.raises(ValueError, match=r"get_dataset_shard\('train'\): this job was given no datasets"):
            call()
    with pytest.raises(TypeError, match="give one"):
        get_dataset_shard("a", name="b")


def test_report_then_get_checkpoint_in_one_process(tmp_path):
    uri = str(tmp_path / "loc")
    set_default_checkpointing(state.CheckpointConfig(uri, every_s=300, keep_last=2))
    try:
        assert get_checkpoint() is None
        report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / "a", {"m.pt": b"one"})))
        state.flush_checkpoints(30)  # the upload runs in the background
        first = get_checkpoint()
        with first.as_directory() as d:
            assert open(os.path.join(d, "m.pt"), "rb").read() == b"one"
        assert get_checkpoint().path == first.path  # cached while its files match the manifest
        report({"loss": 0.4}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / "b", {"m.pt": b"two"})))
        state.flush_checkpoints(30)
        second = get_checkpoint()
        assert second.path != first.path and open(os.path.join(second.path, "m.pt"), "rb").read() == b"two"
        assert get_context().get_experiment_name() == "loc" and get_context().get_storage_path() == uri
        with pytest.raises(NotImplementedError, match=r"get_storage\(\).*get_storage_path\(\)"):
            get_context().get_storage()   # Ray Train V2's StorageContext: named, with what to use instead
    finally:
        set_default_checkpointing(None)


# ---------------------------------------------------------------- Result and load_checkpoint
def test_result_metrics_is_the_last_record():
    history = [{"step": 1, "loss": 0.9}, {"step": 2, "loss": 0.5}]
    result = Result(value=None, metrics_history=history)
    assert result.metrics == {"step": 2, "loss": 0.5} and result.metrics["loss"] == 0.5
    frame = result.metrics_dataframe
    assert list(frame["loss"]) == [0.9, 0.5] and len(frame) == 2
    assert Result(value=None).metrics == {} and Result(value=None).error is None


def test_result_metrics_is_a_plain_dict():
    history = [{"step": 1}, {"step": 2, "loss": 0.5, "hist": [1, 2]}]
    metrics = Result(value=None, metrics_history=history).metrics
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        assert dict(metrics) == {**metrics} == history[-1] and metrics == history[-1]
        assert list(metrics.keys()) == ["step", "loss", "hist"] and dict(metrics.items()) == history[-1]
        assert json.loads(json.dumps(metrics)) == history[-1] and "loss" in metrics and bool(metrics)
        assert metrics.get("loss") == 0.5 and not Result(value=None).metrics
        assert [k for k in metrics] == ["step", "loss", "hist"]
        assert len(metrics) == 3


def test_result_checkpoint_is_a_ray_checkpoint(tmp_path):
    state_uri = "file:///runs/job/ckpt-000000000002"
    reported = Checkpoint("/runs/job/reported/ckpt-000000000005/files")
    result = Result(value=None, checkpoint_uri=state_uri, checkpoint=reported)
    ckpt = result.checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Checkpoint uses: no warning
        assert isinstance(ckpt, Checkpoint) and ckpt.path == reported.path and ckpt.filesystem is reported.filesystem
        assert ckpt == ckpt and ckpt != Checkpoint(reported.path) and bool(ckpt) and "Checkpoint(" in repr(ckpt)
        assert hash(ckpt) == hash(ckpt) and {ckpt: 1}[ckpt] == 1
    import pickle

    again = pickle.loads(pickle.dumps(result))
    assert again.checkpoint.path == reported.path and again.metrics == {}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckpt.nope


def test_load_checkpoint_reads_state_and_reported_checkpoints(tmp_path):
    loc = str(tmp_path / "loc")
    with pytest.raises(CheckpointError, match="the location does not exist"):
        load_checkpoint(loc)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = CheckpointStore(loc)
    with pytest.raises(CheckpointError, match="there is no complete checkpoint at"):
        load_checkpoint(loc)
    uri = store.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3})
    tree = load_checkpoint(loc)  # only a state checkpoint: its tree
    assert tree["epoch"] == 3 and torch.equal(tree["model"]["weight"], model.weight.detach())
    assert "param_groups" in tree["optimizer"]
    ReportedCheckpoints(loc).save(write_dir(tmp_path / "a", {"w": b"files"}))
    assert open(os.path.join(load_checkpoint(loc), "w"), "rb").read() == b"files"  # a reported one: as Result's
    assert load_checkpoint(loc) != load_checkpoint(loc)  # a new directory each call: nothing cached
    assert load_checkpoint(uri)["epoch"] == 3
    assert load_checkpoint(Checkpoint(uri.replace("file://", "")))["epoch"] == 3
    reported = Checkpoint(f"{loc}/reported/ckpt-000000000001/files")
    assert open(os.path.join(load_checkpoint(reported), "w"), "rb").read() == b"files"
    manifest = tmp_path / "loc/ckpt-000000000001/MANIFEST.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": "someone-else/1"}))
    with pytest.raises(CheckpointRefused, match="is not an elastic_ring checkpoint"):
        load_checkpoint(uri)


def test_a_location_means_the_same_checkpoint_for_load_checkpoint_and_result(tmp_path):
    """Both kinds at one location: load_checkpoint(result.path) and load_checkpoint(result.checkpoint) agree (the
    newest reported one); with every reported one damaged, both fall back to the state checkpoint."""
    loc = str(tmp_path / "loc")
    state_uri = CheckpointStore(loc).save({"epoch": 7})
    ReportedCheckpoints(loc).save(write_dir(tmp_path / "a", {"w": b"reported"}))
    trainer = ElasticTrainer(checkpoint_uri=loc, progress=False)
    result = Result(value=None, checkpoint_uri=state_uri, checkpoint=trainer._result_checkpoint(state_uri), path=loc)
    by_path, by_checkpoint = load_checkpoint(result.path), load_checkpoint(result.checkpoint)
    assert open(os.path.join(by_path, "w"), "rb").read() == open(os.path.join(by_checkpoint, "w"), "rb").read() \
        == b"reported"
    assert load_checkpoint(result.checkpoint_uri)["epoch"] == 7  # the state's own, by its URI
    (tmp_path / "loc/reported/ckpt-000000000001/files/w").write_bytes(b"torn")  # another size: damaged
    result = Result(value=None, checkpoint_uri=state_uri, checkpoint=trainer._result_checkpoint(state_uri), path=loc)
    assert load_checkpoint(result.path)["epoch"] == 7 and load_checkpoint(result.checkpoint)["epoch"] == 7


# ---------------------------------------------------------------- on Ray
def context_job(config):
    import elastic_ring as er
    from ray_integration.train import get_context, report

    er.size()
    ctx = get_context()
    seen = (ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(), ctx.get_local_world_size(),
            ctx.get_node_rank())
    d = os.path.join(config["tmp"], f"rank{ctx.get_world_rank()}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "who"), "w") as f:
        f.write(str(ctx.get_world_rank()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report({"loss": 1.0 / (1 + ctx.get_world_rank()), "per_rank": [ctx.get_world_rank(), None]},
               checkpoint=Checkpoint.from_directory(d))
    if ctx.get_world_rank() == 0:
        import shutil

        shutil.rmtree(d)  # the upload runs from report()'s own copy
        state.flush_checkpoints(30)  # uploaded in the background: visible to the other ranks once flushed
    er.allgather_object(None)  # report() does not wait for the other ranks (Ray Train's does)
    previous = get_checkpoint()
    return {"context": er.allgather_object(seen), "warned": er.allgather_object([str(w.message) for w in caught]),
            "got": open(os.path.join(previous.path, "who")).read()}


def test_report_get_checkpoint_and_get_context_on_ray(ray_session, tmp_path):
    result = ElasticTrainer(scaling_config=ScalingConfig(num_workers=2), progress=False,
                            run_config=RunConfig(storage_path=str(tmp_path), name="ctx")).run(
        context_job, config={"tmp": str(tmp_path / "dirs")})
    assert result.value["context"] == [(0, 2, 0, 2, 0), (1, 2, 1, 2, 0)]  # one node: node rank 0 for both
    assert result.value["warned"][0] == [] and "only rank 0's checkpoint is kept" in result.value["warned"][1][0]
    assert result.value["got"] == "0"
    assert result.metrics["loss"] == 1.0 and result.metrics["per_rank"] == [0, None]
    assert result.path == str(tmp_path / "ctx")
    assert open(os.path.join(load_checkpoint(result.checkpoint), "who")).read() == "0"
    written = [e.detail for e in result.events if e.kind == "reported_checkpoint_written"]
    assert len(written) == 1 and written[0]["seq"] == 1 and written[0]["uri"].endswith("/ctx/reported/ckpt-"
                                                                                       "000000000001/files")
    assert result.checkpoint_uri is None  # no state checkpoint was written (nothing committed)
