"""The lease on a checkpoint location, with real processes.

Local and network file systems (a path): an OS file lock. A second live job is refused within the
acquire's wait, a SIGKILLed holder's lock is free at once, the holder's record is readable by any
process. Object stores (``objdir://``, a real directory posing as one, and ``memory://``): renewed
generations; a crashed holder's lease expires after its TTL; contenders never both win."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from state import CheckpointError
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.lease import read_holder
from state.checkpoints.lease_file import FileLease
from state.checkpoints.lease_object_store import ObjectStoreLease
from state.checkpoints.store import CheckpointStore
from state.checkpoints.transport import Location
from state.errors import CheckpointLeaseLost
from tests.object_dir_fs import object_uri

ROOT = pathlib.Path(__file__).resolve().parents[1]
TTL = 2.0

JOB = textwrap.dedent('''
    import sys, time, torch
    import tests.object_dir_fs  # registers objdir://
    from state import CheckpointError
    from state.checkpoints.lease import CheckpointLease
    from state.checkpoints.store import CheckpointStore
    uri, run_id, mode, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    wait = float(sys.argv[5]) if len(sys.argv) > 5 else None
    started = time.monotonic()
    print("WAITING", flush=True)
    try:
        lease = CheckpointLease(uri, run_id, ttl_s=ttl).acquire(timeout_s=wait)
    except CheckpointError as exc:
        print("REFUSED", round(time.monotonic() - started, 2), exc, flush=True)
        sys.exit(3)
    print("HELD", round(time.monotonic() - started, 2), time.time(), flush=True)
    store = CheckpointStore(uri, keep_last=1, run_id=run_id)
    loaded = store.load_latest()
    step = loaded[0]["step"] if loaded else 0
    print("RESUMED", step, flush=True)
    store.save({"step": step + 1, "w": torch.full((10,), float(step + 1))})
    print("SAVED", step + 1, flush=True)
    if mode == "hold":
        time.sleep(600)
    lease.release()
    print("RELEASED", flush=True)
''')


@pytest.fixture
def job_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return script


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _start(script, uri, run_id, mode, *extra, ttl=TTL):
    return subprocess.Popen([sys.executable, str(script), uri, run_id, mode, str(ttl), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env())


def _run(script, uri, run_id, mode):
    return subprocess.run([sys.executable, str(script), uri, run_id, mode, str(TTL)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=_env())


def _read_until(proc, word, timeout_s=60):
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(word):
            return line, lines
    raise AssertionError(f"no {word} line within {timeout_s} s:\n" + "".join(lines))


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("kind", ["file", pytest.param("object", marks=pytest.mark.slow)])  # object: ~10 s
def test_two_live_jobs_refused_then_a_crashed_holder_is_taken_over(tmp_path, job_script, kind):
    uri = str(tmp_path / "ckpt") if kind == "file" else object_uri(tmp_path / "ckpt")
    first = _start(job_script, uri, "run-first", "hold")
    try:
        _read_until(first, "SAVED")
        holder = read_holder(Location(uri))  # what a checkpoint writer on another node reads
        assert holder["run_id"] == "run-first" and holder["pid"] == first.pid and not holder["released"], holder
        second = _run(job_script, uri, "run-second", "hold")
        assert second.returncode == 3, second.stdout + second.stderr
        seconds = float(second.stdout.split("REFUSED")[1].split()[0])
        assert seconds < TTL, second.stdout  # the lock (file) or a renewal (object) is seen well within the TTL
        assert uri in second.stdout and "'run-first'" in second.stdout and "in use by run" in second.stdout
        first.send_signal(signal.SIGKILL)  # the holder crashes: no release
        first.wait(30)
        started = time.monotonic()
        third = _run(job_script, uri, "run-third", "release")
        took = time.monotonic() - started
        assert third.returncode == 0, third.stdout + third.stderr
        assert "RESUMED 1" in third.stdout and "SAVED 2" in third.stdout  # resumed the crashed run's checkpoint
        held_after = float(third.stdout.split("HELD")[1].split()[0])
        if kind == "file":
            assert held_after < 1.0, third.stdout  # the kernel released the dead holder's lock: no TTL to wait
        else:
            assert TTL <= held_after < TTL + 2, third.stdout  # waited out the TTL of silence, not more
        assert took < 30
        # it held the lease, so it pruned the dead run's checkpoint (keep_last=1)
        store = CheckpointStore(uri)
        assert store.complete() == [2] and store.load_latest()[1]["run_id"] == "run-third"
        assert read_holder(Location(uri))["released"] is True
        # released: the next run takes over at once
        fourth = _run(job_script, uri, "run-fourth", "release")
        assert fourth.returncode == 0 and float(fourth.stdout.split("HELD")[1].split()[0]) < 1.0, fourth.stdout
        assert "RESUMED 2" in fourth.stdout
    finally:
        _kill(first)


def test_a_waiting_process_takes_the_lock_the_moment_its_holder_is_sigkilled(tmp_path, job_script):
    uri = str(tmp_path / "ckpt")
    ttl = 10.0  # what an object-store lease would make it wait, at least
    holder = _start(job_script, uri, "run-a", "hold", ttl=ttl)
    waiter = None
    try:
        _read_until(holder, "SAVED")
        waiter = _start(job_script, uri, "run-b", "release", 60, ttl=ttl)  # waits up to 60 s for the lock
        _read_until(waiter, "WAITING")
        time.sleep(0.5)  # in the lock's wait now
        assert waiter.poll() is None
        holder.send_signal(signal.SIGKILL)
        killed = time.time()
        holder.wait(30)
        line, lines = _read_until(waiter, "HELD", 30)
        after_kill = float(line.split()[2]) - killed  # the waiter's clock at the take-over (the same host)
        assert after_kill < 3.0, (after_kill, lines)  # a poll (0.05 s) and the scheduler, not the TTL: the OS freed it
        _read_until(waiter, "RELEASED", 30)
        assert waiter.wait(30) == 0
        record = read_holder(Location(uri))
        assert record["run_id"] == "run-b" and record["generation"] == 2 and record["released"] is True, record
    finally:
        _kill(holder)
        if waiter is not None:
            _kill(waiter)


def test_the_kind_follows_the_protocol(tmp_path):
    assert type(CheckpointLease(str(tmp_path), "run")) is FileLease
    assert type(CheckpointLease(f"file://{tmp_path}", "run")) is FileLease
    assert type(CheckpointLease(object_uri(tmp_path), "run")) is ObjectStoreLease
    assert type(CheckpointLease(f"memory://lease-{uuid.uuid4().hex}", "run")) is ObjectStoreLease


def test_contending_threads_on_a_file_lock_one_wins(tmp_path):
    results, leases = [], []

    def contend(i):
        lease = CheckpointLease(str(tmp_path), f"run-{i}", ttl_s=5.0)
        try:
            lease.acquire(timeout_s=0.5)
            leases.append(lease)
            results.append("won")
        except CheckpointError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert results.count("won") == 1, results
        assert all("in use by run" in r and "LEASE.lock" in r for r in results if r != "won"), results
        assert read_holder(Location(str(tmp_path)))["run_id"] == leases[0].run_id
    finally:
        for lease in leases:
            assert lease.release()


def test_contenders_for_a_stale_object_store_lease_never_both_win(tmp_path):
    uri = object_uri(tmp_path)
    (tmp_path / "LEASE-000000000001.json").write_text(json.dumps(
        {"format": "elastic_ring.lease/1", "run_id": "dead", "counter": 7, "ttl_s": 0.5, "released": False}))
    results, leases = [], []

    def contend(i):
        lease = CheckpointLease(uri, f"run-{i}", ttl_s=0.5)
        try:
            lease.acquire(timeout_s=20)
            leases.append(lease)
            results.append("won")
        except CheckpointError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert results.count("won") == 1, results
        assert all("in use by run" in r for r in results if r != "won"), results
        assert sorted(p.name for p in tmp_path.glob("LEASE-*")) == ["LEASE-000000000002.json"]  # old one cleaned
    finally:
        for lease in leases:
            lease.release()


def test_a_holder_that_stalls_past_the_ttl_learns_it_lost_the_lease(tmp_path):
    uri = object_uri(tmp_path)
    a = CheckpointLease(uri, "run-a", ttl_s=0.5).acquire()
    a._stop.set()  # stall its renewals (as if the process were paused)
    a._thread.join(5)
    b = CheckpointLease(uri, "run-b", ttl_s=0.5).acquire(timeout_s=10)
    try:
        with pytest.raises(CheckpointError, match=r"run 'run-a' lost the lease .* to run 'run-b'"):
            a.renew()
        with pytest.raises(CheckpointLeaseLost, match="took it over as generation 2") as info:
            a.check()  # the same loss, recorded
        assert info.value.reason == "taken_over" and info.value.other_run == "run-b" and not a.held
        a._lost = None
        # a store of the stalled run may no longer write there
        with pytest.raises(CheckpointError, match=r"leased by run 'run-b'.*not by this run 'run-a'"):
            CheckpointStore(uri, run_id="run-a").save({"x": torch.zeros(1)})
        CheckpointStore(uri, run_id="run-b").save({"x": torch.zeros(1)})
    finally:
        b.release()


def test_renewal_errors_are_captured_and_surface_after_the_ttl(tmp_path, monkeypatch):
    lease = CheckpointLease(object_uri(tmp_path), "run-a", ttl_s=0.5).acquire()

    def broken(*args, **kwargs):
        raise PermissionError("storage said no")

    monkeypatch.setattr(lease.loc, "write_small", broken)
    deadline = time.monotonic() + 10
    while lease.held and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(CheckpointLeaseLost, match=r"could not be renewed for .*PermissionError: storage said no") \
            as info:
        lease.check()
    assert isinstance(lease.last_error, PermissionError)
    assert info.value.reason == "expired" and info.value.attempts >= 3  # retried with backoff, not once per 0.1 s
    assert lease.release() is False  # nothing left to release; it does not raise


def test_an_object_store_takeover_is_seen_at_the_next_renewal(tmp_path):
    uri = object_uri(tmp_path)
    holder = CheckpointLease(uri, "run-a", ttl_s=2.0).acquire()
    # another run took the location over (it could not see this holder's renewals, say through a partition)
    taker = CheckpointLease(uri, "run-b", ttl_s=2.0)
    assert Location(uri).create_exclusive(str(tmp_path / "LEASE-000000000002.json"), taker._body(2))
    started = time.monotonic()
    deadline = started + 5
    while holder.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert time.monotonic() - started < holder.renew_every_s + 0.5  # one renewal (0.4 s), not a TTL
    with pytest.raises(CheckpointLeaseLost, match=r"run 'run-a' lost the lease on checkpoint location .* to run "
                                                  r"'run-b' .*generation 2 \(this run held 1.*Stop this run") as info:
        holder.check()
    assert info.value.reason == "taken_over" and info.value.other_run == "run-b" and info.value.attempts == 0
    assert holder.release() is False  # the other run's lease is left alone
    assert json.loads((tmp_path / "LEASE-000000000002.json").read_text())["run_id"] == "run-b"


def test_a_file_lock_holder_sees_another_runs_record_at_the_next_check(tmp_path):
    """Two holders at once happen only where locks are local to a node (NFS with nolock): the record says so."""
    holder = CheckpointLease(str(tmp_path), "run-a", ttl_s=2.0).acquire()
    other = {**json.loads((tmp_path / "LEASE.json").read_text()), "run_id": "run-b", "token": "t", "pid": 1}
    (tmp_path / "LEASE.json").write_text(json.dumps(other))  # as a driver on another node would
    started = time.monotonic()
    while holder.held and time.monotonic() - started < 5:
        time.sleep(0.02)
    assert time.monotonic() - started < holder.renew_every_s + 0.5
    with pytest.raises(CheckpointLeaseLost, match=r"run 'run-a' lost the lease .*: run 'run-b' .*wrote its lease "
                                                  r"record while this run held the lock .*nolock") as info:
        holder.check()
    assert info.value.reason == "taken_over" and info.value.other_run == "run-b"
    assert holder.release() is False  # unlocked, and the other run's record is left alone
    assert json.loads((tmp_path / "LEASE.json").read_text())["run_id"] == "run-b"
    CheckpointLease(str(tmp_path), "run-c", ttl_s=2.0).acquire(timeout_s=0).release()  # the lock was released


def test_a_removed_lock_file_loses_the_lease_and_a_lost_record_is_rewritten(tmp_path):
    lease = CheckpointLease(str(tmp_path), "run-a", ttl_s=1.0).acquire()
    try:
        (tmp_path / "LEASE.json").unlink()
        time.sleep(3 * lease.renew_every_s)
        assert lease.held and read_holder(Location(str(tmp_path)))["run_id"] == "run-a"  # written again
        (tmp_path / "LEASE.lock").unlink()  # someone cleaned the location: another run could lock a new file
        started = time.monotonic()
        while lease.held and time.monotonic() - started < 5:
            time.sleep(0.02)
        with pytest.raises(CheckpointLeaseLost, match=r"lock file .*LEASE.lock was removed or replaced") as info:
            lease.check()
        assert info.value.reason == "lock_file_replaced"
    finally:
        lease.release()


def test_a_file_system_without_locks_is_refused_with_the_fix(tmp_path, monkeypatch):
    lease = CheckpointLease(str(tmp_path), "run-a")

    def no_flock(*args, **kwargs):
        raise OSError(38, "Function not implemented")  # what flock(2) says on such a file system

    monkeypatch.setattr(lease._file_lock, "acquire", no_flock)
    with pytest.raises(CheckpointError, match=r"does not support file locks .*mount it with locking \(NFS: without "
                                              r"nolock or local_lock\), or use an object store URL"):
        lease.acquire()
    assert not lease.held


@pytest.mark.parametrize("kind", ["file", "object"])
def test_defaults_match_the_trainer_and_release_says_whether_it_released(tmp_path, kind):
    lease = CheckpointLease(str(tmp_path) if kind == "file" else object_uri(tmp_path), "run-d")
    assert (lease.ttl_s, lease.renew_every_s) == (15.0, 3.0)  # ElasticTrainer lease_ttl_s=15, renewed every ttl/5
    lease.acquire()
    assert lease.held and lease.release() is True and not lease.held
    assert lease.release() is False


def test_lease_validation_and_release_on_exit(tmp_path):
    with pytest.raises(ValueError, match="relative path"):
        CheckpointLease("ckpt", "run")
    with pytest.raises(ValueError, match="run_id=''"):
        CheckpointLease(str(tmp_path), "")
    with pytest.raises(ValueError, match="ttl_s=0"):
        CheckpointLease(str(tmp_path), "run", ttl_s=0)
    with pytest.raises(ValueError, match="renew_every_s=5"):
        CheckpointLease(str(tmp_path), "run", ttl_s=5, renew_every_s=5)
    with pytest.raises(ValueError, match="timeout_s=-1"):
        CheckpointLease(str(tmp_path), "run").acquire(timeout_s=-1)
    with CheckpointLease(str(tmp_path), "run-x", ttl_s=1) as lease:
        assert lease.held and lease.generation == 1
    assert json.loads((tmp_path / "LEASE.json").read_text())["released"] is True
    started = time.monotonic()
    with CheckpointLease(str(tmp_path), "run-y", ttl_s=1) as lease:
        assert lease.generation == 2 and time.monotonic() - started < 0.5


def test_lease_on_an_fsspec_memory_location():
    uri = f"memory://lease-{uuid.uuid4().hex}"
    a = CheckpointLease(uri, "run-a", ttl_s=0.5).acquire()
    try:
        with pytest.raises(CheckpointError, match="in use by run 'run-a'"):
            CheckpointLease(uri, "run-b", ttl_s=0.5).acquire()
    finally:
        a.release()
    CheckpointLease(uri, "run-b", ttl_s=0.5).acquire().release()
