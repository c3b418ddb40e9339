"""The one sequenced writer of both kinds of checkpoint (state trees and reported directories), on real files:
byte-for-byte the manifests they always wrote, a failed claim leaves no directory, and the lease fence before and
after the manifest holds for both."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from state import CheckpointError
from state.checkpoints import sequenced
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.reported import ReportedCheckpoints
from state.checkpoints.store import CheckpointStore


def write_dir(path, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return str(path)


def save(kind: str, uri: str, tmp_path, **options) -> int:
    """One checkpoint of ``kind`` at ``uri``; its number."""
    if kind == "state":
        url = CheckpointStore(uri, **options).save({"w": torch.zeros(2)}, {"commits": 1})
        return int(url.rsplit("ckpt-", 1)[1])
    return ReportedCheckpoints(uri, **options).save(write_dir(tmp_path / "d", {"m.pt": b"weights"}), {"loss": 1})[0]


def base(kind: str, uri: str) -> str:
    return uri if kind == "state" else f"{uri}/reported"


def test_the_manifests_are_byte_for_byte_what_they_always_were(tmp_path, monkeypatch):
    monkeypatch.setattr(sequenced.time, "time", lambda: 1700000000.5)
    uri = str(tmp_path / "loc")
    save("state", uri, tmp_path, run_id="r")
    save("reported", uri, tmp_path, run_id="r")
    state_manifest = (tmp_path / "loc/ckpt-000000000001/MANIFEST.json").read_text()
    data = (tmp_path / "loc/ckpt-000000000001/data.pt").read_bytes()
    import hashlib

    assert state_manifest == json.dumps(
        {"format": "elastic_ring.checkpoint/2", "seq": 1, "run_id": "r", "created_unix_s": 1700000000.5,
         "files": {"data.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
         "meta": {"commits": 1}}, indent=1)
    reported_manifest = (tmp_path / "loc/reported/ckpt-000000000001/MANIFEST.json").read_text()
    assert reported_manifest == json.dumps(
        {"format": "elastic_ring.reported/1", "seq": 1, "run_id": "r", "created_unix_s": 1700000000.5,
         "files": {"m.pt": {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}},
         "metrics": {"loss": 1}}, indent=1)
    assert json.loads((tmp_path / "loc/reported/ckpt-000000000001/CLAIM.json").read_text())["run_id"] == "r"


@pytest.mark.parametrize("kind", ["state", "reported"])
def test_a_claim_that_fails_leaves_no_directory(tmp_path, monkeypatch, kind):
    uri = str(tmp_path / "loc")
    save(kind, uri, tmp_path)
    real = sequenced.Location.create_exclusive

    def full(loc, path, data, durable=True):
        if path.endswith("/CLAIM.json"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return real(loc, path, data, durable)

    monkeypatch.setattr(sequenced.Location, "create_exclusive", full)
    with pytest.raises(CheckpointError, match=r"No space left on device.*1 is still the newest"):
        save(kind, uri, tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / base(kind, "loc")).iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-000000000001"]


@pytest.mark.parametrize("kind", ["state", "reported"])
def test_a_lease_taken_over_while_the_files_are_written_publishes_nothing(tmp_path, monkeypatch, kind):
    """Without a lease generation the fence is "no other live run holds the location": checked before the claim,
    just before the manifest and after it, for both kinds."""
    uri = str(tmp_path / "loc")
    taken = []
    real = sequenced.SequencedWriter._read_back

    def read_back(writer, root, files):
        if not taken:
            taken.append(CheckpointLease(uri, "run-b", ttl_s=5).acquire())  # another run takes the location
        return real(writer, root, files)

    monkeypatch.setattr(sequenced.SequencedWriter, "_read_back", read_back)
    try:
        with pytest.raises(CheckpointError, match=r"leased by run 'run-b'.*not by this run 'run-a'"):
            save(kind, uri, tmp_path, run_id="run-a")
    finally:
        taken[0].release()
    assert (CheckpointStore(uri) if kind == "state" else ReportedCheckpoints(uri)).complete() == []


def test_a_state_store_given_its_lease_generation_is_fenced_by_it(tmp_path):
    uri = str(tmp_path / "loc")
    lease = CheckpointLease(uri, "run-a", ttl_s=5).acquire()
    store = CheckpointStore(uri, run_id="run-a", lease_generation=lease.generation)
    store.save({"step": 1})
    lease.release()
    CheckpointLease(uri, "run-b", ttl_s=5).acquire().release()  # another run took it over, and ended
    with pytest.raises(CheckpointError, match=r"no longer holds the lease .*held generation 1; now: generation 2"):
        store.save({"step": 2})
    assert store.complete() == [1]
