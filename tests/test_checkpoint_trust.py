"""Safe checkpoint loading: weights_only by default, code is refused, custom objects need trusted=True."""

import collections
import hashlib
import io
import json
import pathlib

import pytest
import torch

from state import CheckpointError, CheckpointRefused, ElasticSampler
from state.checkpoints.store import CheckpointStore


class Malicious:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_malicious_pickle_is_refused_by_default_and_loads_only_with_the_opt_in(tmp_path):
    marker = tmp_path / "pwned"
    uri = str(tmp_path / "ckpt")
    CheckpointStore(uri, trusted=True).save({"step": 1, "payload": Malicious(marker)})
    assert not marker.exists()
    with pytest.raises(CheckpointRefused, match=r"ckpt-000000000001/data.pt holds objects a safe load refuses "
                                                r"\(builtins.exec\).*trusted_checkpoints=True"):
        CheckpointStore(uri).load_latest()
    assert not marker.exists()  # nothing was unpickled
    tree, _ = CheckpointStore(uri, trusted=True).load_latest()
    assert marker.exists() and tree["step"] == 1


def test_the_weights_only_unpickler_itself_refuses_what_the_static_scan_misses(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    uri = str(tmp_path / "ckpt")
    CheckpointStore(uri, trusted=True).save({"payload": Malicious(marker)})
    monkeypatch.setattr(torch.serialization, "get_unsafe_globals_in_checkpoint", lambda f: [])  # scan fooled
    with pytest.raises(CheckpointRefused, match=r"refused by the safe \(weights_only\) load.*trusted_checkpoints=True"):
        CheckpointStore(uri).load_latest()
    assert not marker.exists()


def _forge(store_dir: pathlib.Path, seq: int, data: bytes) -> None:
    """Replace checkpoint ``seq``'s data with ``data`` and make its manifest match (a consistent checkpoint)."""
    d = store_dir / f"ckpt-{seq:012d}"
    (d / "data.pt").write_bytes(data)
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["files"]["data.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit: only to build the archive
def test_a_torchscript_archive_holding_code_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save({"step": 1})
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    _forge(tmp_path, 1, buffer.getvalue())
    with pytest.raises(CheckpointRefused, match=r"ckpt-000000000001/data.pt was refused: .*may hold code.*"
                                                r"trusted_checkpoints=True"):
        store.load_latest()


def test_saving_objects_a_safe_load_would_refuse_fails_early_and_says_how_to_fix(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save({"step": 1})
    with pytest.raises(CheckpointError, match=r"writing checkpoint 2 .* failed: the state holds objects that a safe "
                                              r"load refuses \(.*collections.defaultdict.*\).*state_dict\(\).*"
                                              r"trusted_checkpoints=True.*checkpoint 1 is still the newest"):
        store.save({"counts": collections.defaultdict(int, a=1)})
    assert store.complete() == [1]
    trusted = CheckpointStore(str(tmp_path), trusted=True)
    trusted.save({"counts": collections.defaultdict(int, a=1)})
    assert trusted.load_latest()[0]["counts"]["a"] == 1


def test_training_state_loads_with_weights_only(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = ElasticSampler(20, batch_size=2, seed=3)
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict(),
            "step_lr": step_lr.state_dict(), "sampler": sampler.state_dict(), "epoch": 2, "name": "run",
            "history": [1.5, 2.5], "pair": (1, "a"), "flags": {"x": True, "y": None}, "ids": {1, 2}}
    store = CheckpointStore(str(tmp_path))
    store.save(tree)
    loaded, _ = store.load_latest()
    assert loaded.keys() == tree.keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in tree["model"].items())
    assert loaded["sampler"] == tree["sampler"] and loaded["sched"] == tree["sched"]
    assert (loaded["epoch"], loaded["pair"], loaded["ids"], loaded["flags"]) == (2, (1, "a"), {1, 2}, tree["flags"])
    opt.load_state_dict(loaded["optimizer"])


def test_signed_manifests_refuse_forgery_and_unsigned_ones(tmp_path):
    key = b"0123456789abcdef-job-secret"
    signed = CheckpointStore(str(tmp_path), keep_last=5, signing_key=key)
    signed.save({"step": 1, "w": torch.ones(2)})
    assert signed.load_latest()[0]["step"] == 1
    assert "hmac_sha256" in json.loads((tmp_path / "ckpt-000000000001" / "MANIFEST.json").read_text())
    # someone with write access replaces the data and fixes the checksum: the signature no longer matches
    buffer = io.BytesIO()
    torch.save({"step": 99, "w": torch.zeros(2)}, buffer)
    _forge(tmp_path, 1, buffer.getvalue())
    with pytest.raises(CheckpointRefused, match="ckpt-000000000001/MANIFEST.json is signed with another key"):
        signed.load_latest()
    CheckpointStore(str(tmp_path), keep_last=5).save({"step": 2})  # unsigned
    with pytest.raises(CheckpointRefused, match="ckpt-000000000002/MANIFEST.json is not signed"):
        signed.load_latest()
    with pytest.raises(CheckpointRefused, match="signed with another key"):
        CheckpointStore(str(tmp_path), signing_key=b"another key of 16+ bytes").load(1)


@pytest.mark.parametrize("key, message", [(b"short", "got 5 bytes"), ("a str key of 16 chars", "got a str")])
def test_signing_key_validation_never_shows_the_key(key, message):
    from state import CheckpointConfig

    with pytest.raises(ValueError, match=message) as info:
        CheckpointConfig("/x", every_s=1, signing_key=key)
    assert str(key) not in str(info.value)
    assert "signing_key" not in repr(CheckpointConfig("/x", every_s=1, signing_key=b"k" * 16))
