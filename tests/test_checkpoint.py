"""Durable checkpoints: atomic writes, fallback past damage, two writers, resume in a fresh process."""

import json
import multiprocessing as mp
import pathlib
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from state import CheckpointConfig, CheckpointError
from state.checkpoints.background import BackgroundWriter
from state.checkpoints.store import CheckpointStore

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tree(i):
    return {"model": {"w": torch.full((3,), float(i))}, "epoch": i}


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_roundtrip_and_keep_last(tmp_path, kind):
    uri = str(tmp_path / "ckpt") if kind == "local" else f"memory://ckpt-{uuid.uuid4().hex}"
    store = CheckpointStore(uri, keep_last=2)
    assert store.load_latest() is None
    uris = [store.save(tree(i), {"commits": i, "names": ["epoch", "model"]}) for i in range(1, 5)]
    assert store.complete() == [3, 4]
    loaded, info = store.load_latest(expected_names=["model", "epoch"])
    assert loaded["epoch"] == 4 and torch.equal(loaded["model"]["w"], torch.full((3,), 4.0))
    assert info["uri"] == uris[-1] and info["seq"] == 4 and info["meta"]["commits"] == 4


def test_torn_write_is_never_the_latest(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=5)
    store.save(tree(1))
    torn = tmp_path / "ckpt-000000000002"
    torn.mkdir()
    (torn / "data.pt").write_bytes(b"half a checkpo")  # the writer died before its manifest
    loaded, info = store.load_latest()
    assert loaded["epoch"] == 1 and info["seq"] == 1
    store.save(tree(3))  # numbering goes past the torn one, and pruning cleans it away eventually
    assert store.load_latest()[1]["seq"] == 3


def test_corrupt_newest_falls_back_with_a_warning_naming_the_file(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=5)
    store.save(tree(1))
    store.save(tree(2))
    data = tmp_path / "ckpt-000000000002" / "data.pt"
    data.write_bytes(data.read_bytes()[:-10] + b"0123456789")
    with pytest.warns(RuntimeWarning, match=r"ckpt-000000000002/data.pt is corrupt"):
        loaded, info = store.load_latest()
    assert loaded["epoch"] == 1
    (tmp_path / "ckpt-000000000001" / "MANIFEST.json").write_text("{not json")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="no valid checkpoint"):
        store.load_latest()


def test_foreign_checkpoints_are_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(tree(1), {"names": ["epoch", "model"]})
    with pytest.raises(CheckpointError, match=r"holds state values \['epoch', 'model'\].*this state has \['optimizer'\]"):
        store.load_latest(expected_names=["optimizer"])
    manifest = tmp_path / "ckpt-000000000001" / "MANIFEST.json"
    m = json.loads(manifest.read_text())
    m["format"] = "someone-else/9"
    manifest.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="not an elastic_ring checkpoint"):
        store.load(1)


def _writer_process(uri, writer_id, count):
    store = CheckpointStore(uri, keep_last=100)
    for i in range(count):
        store.save({"writer": writer_id, "i": i, "blob": torch.randn(20_000)}, {"writer": writer_id})


def test_two_writers_on_one_directory(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(str(tmp_path), w, 6)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = CheckpointStore(str(tmp_path), keep_last=100)
    assert store.complete() == list(range(1, 13))
    writers = [store.load(seq)[0]["writer"] for seq in store.complete()]
    assert sorted(writers) == [0] * 6 + [1] * 6


def test_background_writer_does_not_block_and_keeps_the_newest(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=10)
    writer = BackgroundWriter(store)
    big = {"w": torch.randn(4_000_000)}
    started = time.monotonic()
    for i in range(5):
        writer.submit(lambda i=i: ({**big, "i": i}, {"i": i}))
    submit_s = time.monotonic() - started
    newest = writer.flush(timeout_s=120)
    assert submit_s < 0.5, f"submitting took {submit_s:.2f} s"
    assert store.load_latest()[0]["i"] == 4 and newest.endswith(f"ckpt-{store.complete()[-1]:012d}")
    assert len(store.complete()) <= 5


def test_unwritable_location_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory"):
        CheckpointStore(str(blocker / "sub"))


@pytest.mark.parametrize("kwargs, field", [
    (dict(uri=""), "uri"), (dict(uri="/x"), "every_n_commits or every_s"),
    (dict(uri="/x", every_n_commits=0), "every_n_commits=0"), (dict(uri="/x", every_s=-1), "every_s=-1"),
    (dict(uri="/x", every_s=1, keep_last=0), "keep_last=0"),
])
def test_checkpoint_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**kwargs)


RESUME_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    import elastic_ring as er
    from state import TorchState, ElasticSampler
    ckpt, phase = sys.argv[1], sys.argv[2]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    er.init(er.RingSpec(round_id=1, rank=0, world_size=1, node_ids=("n",), store=er.StoreAddress("127.0.0.1", store.port)))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(40, batch_size=4, seed=1)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    state.enable_checkpoints(ckpt, every_n_commits=2, keep_last=2)
    state.sync()
    print("RESUMED", state.resumed_from is not None, state.epoch, state.step, sampler.processed, flush=True)
    print("WEIGHT", model.weight.detach().tolist(), flush=True)
    for batch in sampler:
        x = torch.full((len(batch), 3), float(state.step))
        model(x).sum().backward(); opt.step(); opt.zero_grad()
        sampler.record_batch(); state.step += 1
        state.commit()
        if phase == "first" and state.step == 6:
            state.persist_now(timeout_s=60)
            print("WEIGHT", model.weight.detach().tolist(), flush=True)
            break
    print("DONE", state.step, sampler.processed, flush=True)
''')


def test_resume_from_a_checkpoint_in_a_fresh_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RESUME_SCRIPT)
    ckpt = str(tmp_path / "ckpt")
    first = subprocess.run([sys.executable, str(script), ckpt, "first"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "DONE 6 24" in first.stdout, first.stdout + first.stderr
    weights = lambda out: [line for line in out.splitlines() if line.startswith("WEIGHT")]
    second = subprocess.run([sys.executable, str(script), ckpt, "second"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "RESUMED True 0 6 24" in second.stdout, second.stdout + second.stderr
    assert "DONE 10 40" in second.stdout  # the remaining 4 batches of the epoch, not the whole epoch again
    fresh, saved = weights(first.stdout)  # before training, and at the checkpoint of step 6
    resumed = weights(second.stdout)[0]
    assert resumed == saved and resumed != fresh  # the model resumed exactly where it was saved
