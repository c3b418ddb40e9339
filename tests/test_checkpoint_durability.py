"""Durable checkpoints on real files: disk full mid-write, fsync order, verification before pruning,
a process SIGKILLed mid-prune, cleanup of failed writes, stray names, streaming memory."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch

from state import CheckpointError
from state.checkpoints.store import CheckpointStore

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tree(i, n=1000):
    return {"model": {"w": torch.full((n,), float(i))}, "step": i}


class _FlakyFile:
    """A real file whose write() fails with ENOSPC once ``budget`` bytes were written, or flips bits."""

    def __init__(self, f, budget=None, corrupt=False):
        self._f, self._budget, self._corrupt = f, budget, corrupt

    def write(self, data):
        data = bytes(data)
        if self._budget is not None:
            if len(data) > self._budget:
                self._f.write(data[:self._budget])
                self._budget = 0
                raise OSError(errno.ENOSPC, "No space left on device")
            self._budget -= len(data)
        if self._corrupt and len(data) > 100:
            data = data[:50] + bytes([data[50] ^ 0xFF]) + data[51:]
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def _patch_data_writes(monkeypatch, store, **flaky):
    real_open = store.fs.open

    def open_(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        return _FlakyFile(f, **flaky) if mode == "wb" and path.endswith("/data.pt") else f

    monkeypatch.setattr(store.fs, "open", open_)


def _dirs(path):
    return sorted(p.name for p in pathlib.Path(path).iterdir() if p.name.startswith("ckpt-"))


def test_disk_full_while_writing_keeps_the_previous_checkpoint_and_leaves_nothing_behind(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path), keep_last=1)
    store.save(tree(1, 200_000))
    _patch_data_writes(monkeypatch, store, budget=300_000)  # the open succeeds; a write() runs out of space
    with pytest.raises(CheckpointError, match=r"checkpoint 2 under .* failed: .*No space left on device; "
                                              r"checkpoint 1 is still the newest.*Free space"):
        store.save(tree(2, 200_000))
    monkeypatch.undo()
    assert _dirs(tmp_path) == ["ckpt-000000000001"]  # the partial checkpoint 2 was removed, data and all
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    loaded, info = CheckpointStore(str(tmp_path)).load_latest()
    assert loaded["step"] == 1 and info["seq"] == 1
    store.save(tree(3))  # space is back: number 2 never became a checkpoint and is claimed again
    assert _dirs(tmp_path) == ["ckpt-000000000002"] and store.load_latest()[0]["step"] == 3


def test_a_write_that_reads_back_wrong_fails_and_prunes_nothing_even_with_keep_last_1(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path), keep_last=1)
    store.save(tree(1))
    _patch_data_writes(monkeypatch, store, corrupt=True)  # storage that silently flips a bit
    with pytest.raises(CheckpointError, match=r"reads back .* checksum .*checkpoint 1 is still the newest"):
        store.save(tree(2))
    monkeypatch.undo()
    assert _dirs(tmp_path) == ["ckpt-000000000001"]
    assert store.load_latest()[0]["step"] == 1


def test_keep_last_1_with_a_corrupt_newest_on_disk_resumes_the_valid_one_and_keeps_it(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2)
    store.save(tree(1))
    store.save(tree(2))
    data = tmp_path / "ckpt-000000000002" / "data.pt"
    data.write_bytes(data.read_bytes()[:-10] + b"0123456789")  # rots after it was written
    rerun = CheckpointStore(str(tmp_path), keep_last=1)
    with pytest.warns(RuntimeWarning, match="ckpt-000000000002/data.pt is corrupt"):
        assert rerun.load_latest()[0]["step"] == 1
    # the next checkpoint of a run that holds no lease prunes only its own: the valid 1 stays
    rerun.save(tree(3))
    assert _dirs(tmp_path) == ["ckpt-000000000001", "ckpt-000000000002", "ckpt-000000000003"]
    assert rerun.load_latest()[0]["step"] == 3


def test_stray_names_are_ignored_not_fatal(tmp_path):
    (tmp_path / "old-ckpt-000000000005").mkdir()
    (tmp_path / "ckpt-000000000009.bak").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    store = CheckpointStore(str(tmp_path), keep_last=1)
    assert store.save(tree(1)).endswith("ckpt-000000000001")
    store.save(tree(2))
    assert store.complete() == [2] and (tmp_path / "old-ckpt-000000000005").is_dir() and (tmp_path / "notes.txt").exists()


def test_failed_writes_of_a_dead_writer_are_cleaned_by_the_next_prune(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=1, run_id="run-a")
    store.save(tree(1))
    torn = tmp_path / "ckpt-000000000002"  # the same run's writer died mid-write (power loss)
    torn.mkdir()
    (torn / "CLAIM.json").write_text(json.dumps({"run_id": "run-a"}))
    (torn / "data.pt").write_bytes(b"half")
    (torn / "MANIFEST.json.tmp-0123").write_text("{")
    store.save(tree(3))
    assert _dirs(tmp_path) == ["ckpt-000000000003"]


def test_fsync_order_data_then_manifest_then_directories(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)

    store = CheckpointStore(str(tmp_path / "ck"))
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.save(tree(1))
    monkeypatch.undo()
    d = str(tmp_path / "ck" / "ckpt-000000000001")
    names = [(kind, path.replace(str(tmp_path / "ck"), "<root>")) for kind, path in events]
    data_sync = names.index(("fsync", "<root>/ckpt-000000000001/data.pt"))
    rename = names.index(("rename", "<root>/ckpt-000000000001/MANIFEST.json"))
    manifest_sync = [i for i, (k, p) in enumerate(names) if k == "fsync" and ".tmp-" in p and "MANIFEST" in p]
    dir_syncs = [i for i, e in enumerate(names) if e == ("fsync", "<root>/ckpt-000000000001")]
    root_syncs = [i for i, e in enumerate(names) if e == ("fsync", "<root>")]
    assert data_sync < manifest_sync[0] < rename, names
    assert any(data_sync < i < rename for i in dir_syncs) and any(i > rename for i in dir_syncs), names
    assert root_syncs and root_syncs[0] < rename, names  # the checkpoint's directory entry is durable first
    assert os.path.exists(f"{d}/MANIFEST.json")


PRUNE_KILLER = textwrap.dedent('''
    import os, signal, sys, torch
    from state.checkpoints.store import CheckpointStore
    store = CheckpointStore(sys.argv[1], keep_last=1, run_id="run-k")
    real = store.writer._remove_dir
    def die_after_unpublishing(seq):  # the manifest of `seq` is gone; its data not yet
        print("KILLING", seq, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    store.writer._remove_dir = die_after_unpublishing
    store.save({"model": {"w": torch.full((1000,), 3.0)}, "step": 3})
''')


def test_sigkill_mid_prune_leaves_no_manifest_without_its_data_and_the_newest_loads(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=5, run_id="run-k")
    store.save(tree(1))
    store.save(tree(2))
    script = tmp_path.parent / f"{tmp_path.name}-killer.py"
    script.write_text(PRUNE_KILLER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL and "KILLING 1" in proc.stdout, proc.stdout + proc.stderr
    # invariant: a directory with a manifest has its data intact; one without is not a checkpoint
    for d in tmp_path.glob("ckpt-*"):
        if (d / "MANIFEST.json").exists():
            size = json.loads((d / "MANIFEST.json").read_text())["files"]["data.pt"]["bytes"]
            assert (d / "data.pt").stat().st_size == size
    assert (tmp_path / "ckpt-000000000001" / "data.pt").exists()  # killed before the data went
    after = CheckpointStore(str(tmp_path), keep_last=1, run_id="run-k")
    assert after.complete() == [2, 3]
    loaded, info = after.load_latest()
    assert loaded["step"] == 3 and info["seq"] == 3
    after.save(tree(4))  # the next prune finishes the job
    assert _dirs(tmp_path) == ["ckpt-000000000004"]


def test_saving_and_loading_stream_without_a_copy_of_the_file_in_python_memory(tmp_path):
    big = {"w": torch.randn(8_000_000)}  # 32 MB
    store = CheckpointStore(str(tmp_path))
    tracemalloc.start()
    try:
        store.save(big)
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loaded, _ = store.load_latest()
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(loaded["w"], big["w"])
    assert save_peak < 4 << 20 and load_peak < 4 << 20, (save_peak, load_peak)  # no BytesIO, no read() of the file


def test_relative_and_root_locations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="relative path"):
        CheckpointStore("ckpt")
    with pytest.raises(ValueError, match="filesystem root"):
        CheckpointStore("/")
