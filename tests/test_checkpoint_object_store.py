"""Checkpoints and the lease on object stores: fsspec's memory filesystem, and S3 through s3fs against a
local S3 emulator (moto's server on 127.0.0.1). The S3 cases skip cleanly when moto or s3fs is missing
(both come with the project's ``test`` extra)."""

import re
import threading
import uuid

import fsspec
import pytest
import torch

from state import CheckpointError
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.store import CheckpointStore


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server", reason="moto[s3] (with flask) is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["memory", "s3"])
def location(request, monkeypatch):
    """A fresh, empty object-store location."""
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex}"
    endpoint = request.getfixturevalue("s3_endpoint")
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    # how a user points s3:// at another endpoint too: fsspec's config (or FSSPEC_S3_ENDPOINT_URL)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint, "skip_instance_cache": True})
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    return f"s3://{bucket}/job"


def _no_moves(monkeypatch, store):
    """Object stores: final keys are written directly; a copy + delete would double the I/O."""
    def refuse(*args, **kwargs):
        raise AssertionError("mv/copy on an object store")

    for name in ("mv", "copy", "rename"):
        monkeypatch.setattr(store.fs, name, refuse)


def _keys(store):
    return sorted(p[len(store.root) + 1:] for p in store.fs.find(store.root))


def test_roundtrip_prune_and_layout(location, monkeypatch):
    store = CheckpointStore(location, keep_last=2, run_id="run-a")
    _no_moves(monkeypatch, store)
    for i in range(1, 5):
        uri = store.save({"w": torch.full((1000,), float(i)), "step": i}, {"commits": i})
    assert store.complete() == [3, 4] and uri.endswith("ckpt-000000000004")
    assert _keys(store) == [f"ckpt-00000000000{s}/{f}" for s in (3, 4) for f in ("CLAIM.json", "MANIFEST.json", "data.pt")]
    tree, info = CheckpointStore(location).load_latest()
    assert tree["step"] == 4 and info["run_id"] == "run-a" and info["meta"]["commits"] == 4


def test_sequence_numbers_are_claimed_atomically(location):
    stores = [CheckpointStore(location, keep_last=100, run_id=f"w{i}") for i in range(3)]
    errors = []

    def write(store):
        try:
            for i in range(4):
                store.save({"writer": store.run_id, "i": i})
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    reader = CheckpointStore(location)
    assert reader.complete() == list(range(1, 13))
    writers = sorted(reader.load(seq)[0]["writer"] for seq in reader.complete())
    assert writers == ["w0"] * 4 + ["w1"] * 4 + ["w2"] * 4


def test_corrupt_object_falls_back_and_a_write_error_names_the_location(location, monkeypatch):
    store = CheckpointStore(location, keep_last=5)
    store.save({"step": 1})
    store.save({"step": 2})
    store.fs.pipe_file(f"{store.root}/ckpt-000000000002/data.pt", b"garbage")
    with pytest.warns(RuntimeWarning, match="ckpt-000000000002/data.pt is corrupt"):
        assert store.load_latest()[0]["step"] == 1
    real_open = store.fs.open

    def denied(path, mode="rb", **kwargs):
        if mode == "wb":
            raise PermissionError("Access Denied")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(store.fs, "open", denied)
    with pytest.raises(CheckpointError, match=rf"checkpoint 3 under {re.escape(store.uri)} failed: Access Denied; "
                                              r"checkpoint 2 is still the newest"):
        store.save({"step": 3})
    monkeypatch.undo()
    assert store.writer.sequences() == [1, 2]  # the failed claim was removed


def test_lease_on_an_object_store(location):
    a = CheckpointLease(location, "run-a", ttl_s=1.0).acquire()
    try:
        with pytest.raises(CheckpointError, match=r"is in use by run 'run-a'"):
            CheckpointLease(location, "run-b", ttl_s=1.0).acquire()
        with pytest.raises(CheckpointError, match="leased by run 'run-a'"):
            CheckpointStore(location, run_id="run-b").save({"x": 1})
        CheckpointStore(location, run_id="run-a").save({"x": 1})
    finally:
        a._stop.set()  # the holder "dies": no release, no renewal
        a._thread.join(10)
    b = CheckpointLease(location, "run-b", ttl_s=1.0).acquire(timeout_s=20)
    try:
        assert b.generation == 2
        CheckpointStore(location, run_id="run-b").save({"x": 2})
    finally:
        b.release()
