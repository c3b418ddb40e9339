"""Reported checkpoints: uploaded in the background from a snapshot (report() returns at once, the directory may go),
one at a time with a newer one replacing the waiting one, flushed by state.flush_checkpoints, failures as
checkpoint_failed events and retried when transient; reading them (a pruned one re-lists, the download cache keyed by
the manifest's digest and verified, forged manifests refused); lease generation fencing on file systems and object
stores."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
import uuid

import pytest
from ray.train import Checkpoint, CheckpointUploadMode

import state
from ray_integration import load_checkpoint
from ray_integration.train import get_checkpoint, report
from state import CheckpointError
from state.checkpoints import uploads as reported_uploads
from state.checkpoints.config import set_default_checkpointing
from state.checkpoints.hooks import set_checkpoint_listener
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.reported import ReportedCheckpoints


def write_dir(path, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        target = path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return str(path)


@pytest.fixture
def location(tmp_path):
    """A run's location as the worker runtime sets it, a listener collecting the events; everything reset after."""
    uri = str(tmp_path / "loc")
    events: list[dict] = []
    set_default_checkpointing(state.CheckpointConfig(uri, every_s=300, keep_last=3, run_id="run-a"))
    set_checkpoint_listener(events.append)
    try:
        yield uri, events
    finally:
        try:
            state.flush_checkpoints(30)
        except CheckpointError:
            pass  # a test's failing upload
        set_default_checkpointing(None)
        set_checkpoint_listener(None)
        reported_uploads._uploads.clear()


class Gate:
    """Holds every ReportedCheckpoints._upload until opened (a slow storage), counting the files begun."""

    def __init__(self, monkeypatch):
        self.open, self.started = threading.Event(), []
        real = ReportedCheckpoints._upload

        def upload(store, source, target):
            self.started.append(target)
            assert self.open.wait(20), "the test never opened the gate"
            return real(store, source, target)

        monkeypatch.setattr(ReportedCheckpoints, "_upload", upload)


def files_of(uri: str, seq: int) -> dict[str, bytes]:
    base = os.path.join(uri, "reported", f"ckpt-{seq:012d}", "files")
    return {name: open(os.path.join(base, name), "rb").read() for name in sorted(os.listdir(base))}


def test_report_returns_before_the_upload_and_the_directory_may_go_at_once(location, tmp_path, monkeypatch):
    uri, events = location
    snapshots = tmp_path / "tmp"
    snapshots.mkdir()
    monkeypatch.setattr(reported_uploads.tempfile, "tempdir", str(snapshots))
    gate = Gate(monkeypatch)
    d = write_dir(tmp_path / "d", {"model.pt": b"weights" * 1000})
    started = time.monotonic()
    report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(d))
    assert time.monotonic() - started < 2.0  # the upload is held at the gate: report did not wait for it
    shutil.rmtree(d)  # allowed at once (Ray Train allows it): the upload reads report()'s own copy
    write_dir(tmp_path / "d", {"model.pt": b"reused"})  # the same directory reused for the next one
    assert ReportedCheckpoints(uri).complete() == [] and get_checkpoint() is None  # in flight: not visible yet
    gate.open.set()
    state.flush_checkpoints(30)  # the worker calls this when fn returns, at a stop, at a drain
    assert ReportedCheckpoints(uri).complete() == [1] and files_of(uri, 1) == {"model.pt": b"weights" * 1000}
    with get_checkpoint().as_directory() as local:
        assert open(os.path.join(local, "model.pt"), "rb").read() == b"weights" * 1000
    assert [e["kind"] for e in events] == ["reported_checkpoint_written"]
    assert events[0]["seq"] == 1 and events[0]["bytes"] == 7000 and events[0]["uri"].endswith("/files")
    assert not [n for n in os.listdir(snapshots) if n.startswith("er-reported-")]  # report()'s copy removed


def test_a_newer_report_replaces_the_waiting_one_and_sync_mode_waits(location, tmp_path, monkeypatch):
    uri, events = location
    gate = Gate(monkeypatch)
    for i in range(3):
        report({"i": i}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / f"d{i}", {"w": bytes([i])})))
    deadline = time.monotonic() + 10
    while not gate.started and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.open.set()
    state.flush_checkpoints(30)
    store = ReportedCheckpoints(uri)
    assert store.complete() == [1, 2]  # the first (in flight) and the last; the middle one was skipped
    assert files_of(uri, 1) == {"w": b"\x00"} and files_of(uri, 2) == {"w": b"\x02"}
    assert [(e["kind"], e["superseded"]) for e in events] == [("reported_checkpoint_written", 0),
                                                               ("reported_checkpoint_written", 1)]
    assert store.manifest(2)["metrics"] == {"i": 2}
    report({"i": 3}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / "d3", {"w": b"\x03"})),
           checkpoint_upload_mode=CheckpointUploadMode.SYNC)
    assert store.complete() == [1, 2, 3]  # SYNC: durable when report returns


def test_a_transient_failure_is_retried_and_a_lasting_one_is_an_event_then_an_error(location, tmp_path,
                                                                                      monkeypatch):
    uri, events = location
    real = ReportedCheckpoints._upload
    failures = {"left": 1, "code": errno.ENOSPC}

    def flaky(store, source, target):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(failures["code"], os.strerror(failures["code"]), target)
        return real(store, source, target)

    monkeypatch.setattr(ReportedCheckpoints, "_upload", flaky)
    report({}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / "a", {"w": b"a"})))
    state.flush_checkpoints(30)
    assert [(e["kind"], e["attempts"]) for e in events] == [("reported_checkpoint_written", 2)]  # ENOSPC: retried
    failures.update(left=10**6, code=errno.EACCES)  # permissions: not retried
    for i in range(3):
        report({}, checkpoint=Checkpoint.from_directory(write_dir(tmp_path / f"b{i}", {"w": b"b"})))
        with pytest.raises(CheckpointError, match=r"the last reported checkpoint upload to .* failed: .*Permission"):
            state.flush_checkpoints(30)
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert len(failed) == 3 and all(e["reported"] and not e["transient"] and e["seq"] is None for e in failed)
    assert [e["consecutive_failures"] for e in failed] == [1, 2, 3] and "Permission denied" in failed[0]["error"]
    with pytest.raises(CheckpointError, match=r"3 reported checkpoint uploads in a row to .* failed"):
        report({}, checkpoint=Checkpoint.from_directory(str(tmp_path / "a")))
    assert ReportedCheckpoints(uri).complete() == [1]


# ---------------------------------------------------------------- reading
def test_newest_lists_again_when_the_checkpoint_it_reads_is_pruned(tmp_path):
    """A writer prunes (keep_last=1) while a reader downloads: the reader lists again and finds the newest, instead of
    skipping every pruned one and answering None."""
    uri = str(tmp_path / "loc")
    writer = ReportedCheckpoints(uri, keep_last=1, run_id="w")
    writer.save(write_dir(tmp_path / "a", {"w": b"1"}))
    writer_moves = iter([True])

    def dest_for(seq):
        if next(writer_moves, False):  # while the reader is at this one, the writer saves one more and prunes it
            writer.save(write_dir(tmp_path / "b", {"w": b"2"}))
        return str(tmp_path / f"out-{seq}-{uuid.uuid4().hex[:6]}")

    found = ReportedCheckpoints(uri).newest(dest_for)
    assert found is not None and found[0] == 2 and open(os.path.join(found[1], "w"), "rb").read() == b"2"


def test_get_checkpoint_never_hands_out_a_stale_or_edited_copy(location, tmp_path):
    uri, _ = location
    ReportedCheckpoints(uri, run_id="run-a").save(write_dir(tmp_path / "a", {"w": b"first run"}))
    first = get_checkpoint().path
    assert get_checkpoint().path == first  # unchanged: the verified copy again
    open(os.path.join(first, "w"), "wb").write(b"edited!!!")  # the user edits the copy it was given
    second = get_checkpoint().path
    assert second != first and open(os.path.join(second, "w"), "rb").read() == b"first run"
    shutil.rmtree(uri)  # the location deleted and written again: number 1 again, other files
    ReportedCheckpoints(uri, run_id="run-b").save(write_dir(tmp_path / "b", {"w": b"second run"}))
    with get_checkpoint().as_directory() as local:
        assert open(os.path.join(local, "w"), "rb").read() == b"second run"
    assert load_checkpoint(uri) != load_checkpoint(uri)  # load_checkpoint never caches


def test_a_manifest_listing_a_file_and_a_file_inside_it_is_corrupt(tmp_path):
    uri = str(tmp_path / "loc")
    store = ReportedCheckpoints(uri, keep_last=5)
    store.save(write_dir(tmp_path / "a", {"good": b"older"}))
    store.save(write_dir(tmp_path / "b", {"a": b"x", "c": b"y"}))
    path = tmp_path / "loc/reported/ckpt-000000000002/MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {"a": manifest["files"]["a"], "a/b": manifest["files"]["c"]}
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"lists 'a' as a file and 'a/b' inside it"):
        store.download(2, str(tmp_path / "direct"))
    found = store.newest(lambda n: str(tmp_path / f"o{n}"))  # falls back to the older one
    assert found[0] == 1 and open(os.path.join(found[1], "good"), "rb").read() == b"older"


# ---------------------------------------------------------------- lease fencing
@pytest.mark.parametrize("kind", ["file", "object store"])
def test_a_writer_whose_lease_generation_is_gone_does_not_publish(tmp_path, kind):
    uri = str(tmp_path / "loc") if kind == "file" else f"memory://fence-{uuid.uuid4().hex[:8]}/loc"
    lease_a = CheckpointLease(uri, "run-a", ttl_s=5).acquire()
    generation = lease_a.generation
    store_a = ReportedCheckpoints(uri, run_id="run-a", lease_generation=generation)
    store_a.save(write_dir(tmp_path / "a", {"w": b"a"}))  # while it holds its generation
    lease_a.release()  # (a stalled run's lease expiring: another run takes the location over)
    lease_b = CheckpointLease(uri, "run-b", ttl_s=5).acquire()
    ReportedCheckpoints(uri, run_id="run-b", lease_generation=lease_b.generation).save(
        write_dir(tmp_path / "b", {"w": b"b"}))
    lease_b.release()  # run b is done: its lease says released, so an unfenced writer would be let through
    with pytest.raises(CheckpointError, match=rf"no longer holds the lease .*held generation {generation}; now"):
        store_a.save(write_dir(tmp_path / "c", {"w": b"late"}))
    assert ReportedCheckpoints(uri).complete() == [1, 2]


def test_a_lease_lost_during_the_upload_unpublishes_nothing_half_written(tmp_path, monkeypatch):
    """The lease moves on while the files upload (minutes on real storage): the manifest is not published."""
    uri = f"memory://fence-{uuid.uuid4().hex[:8]}/loc"
    lease_a = CheckpointLease(uri, "run-a", ttl_s=5).acquire()
    store_a = ReportedCheckpoints(uri, run_id="run-a", lease_generation=lease_a.generation)
    real, taken = ReportedCheckpoints._upload, []

    def upload(store, source, target):
        if not taken:
            lease_a.release()
            taken.append(CheckpointLease(uri, "run-b", ttl_s=5).acquire())
        return real(store, source, target)

    monkeypatch.setattr(ReportedCheckpoints, "_upload", upload)
    with pytest.raises(CheckpointError, match="no longer holds the lease"):
        store_a.save(write_dir(tmp_path / "a", {"w": b"a"}))
    taken[0].release()
    assert ReportedCheckpoints(uri).complete() == []


def test_the_lease_generation_travels_with_the_checkpoint_config():
    import dataclasses
    import pickle

    config = state.CheckpointConfig("/tmp/x", every_s=5, run_id="r", lease_generation=4)  # a declared field now
    again = pickle.loads(pickle.dumps(config))
    assert again.lease_generation == 4 and again == config and state.CheckpointConfig(
        "/tmp/x", every_s=5).lease_generation is None
    assert dataclasses.asdict(config)["lease_generation"] == 4  # asdict no longer drops it
    set_default_checkpointing(again)
    try:
        assert state.State(x=1)._checkpoint == config  # a State built from it keeps every field
    finally:
        set_default_checkpointing(None)
    with pytest.raises(ValueError, match="generation"):
        dataclasses.replace(config, lease_generation=0)
