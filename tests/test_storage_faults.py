"""Full, slow or flaky storage never ends a run: real files, real ENOSPC, real latency.

The full disk is a real 4 MiB tmpfs mounted for the test (root can mount one, also under gVisor)
and filled with a ballast file, so every write gets the kernel's own ENOSPC; deleting the ballast
returns the space. Where mounting is impossible (not root, no mount(8); or forced with
``ELASTIC_RING_TEST_NO_TMPFS=1``), the same tests run on a
real local directory behind :class:`FaultyFileSystem`, an fsspec wrapper of the local filesystem
that raises ``OSError(ENOSPC)`` from every open for writing while its switch file exists. Slow
storage is that wrapper too: opens for writing sleep first (a real directory underneath).
Nothing under test is replaced: the writer, the store and the lease run as in production.

The lease on a local disk is an OS file lock, which a full or slow disk does not touch; the renewed
lease of object stores is tested on the same disk seen as an object store (``faultyobj://``: the
wrapper without the ``file`` protocol, so ``Location.local`` is False).
"""

import errno
import os
import pathlib
import shutil
import subprocess
import threading
import time
import uuid
import weakref

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from state import CheckpointError, flush_checkpoints
from state.checkpoints import hooks as checkpoint_writer
from state.checkpoints.background import BackgroundWriter
from state.checkpoints.faults import is_transient
from state.checkpoints.hooks import set_checkpoint_listener
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.store import CheckpointStore
from state.errors import CheckpointLeaseLost

RUN = "run-faults"


class FaultyFileSystem(LocalFileSystem):
    """The local filesystem, with writes that fail (ENOSPC while ``full_switch`` exists) or take
    longer (``delays``: substring of the file's name -> seconds slept before the open)."""

    protocol = ("faultyfile", "file", "local")  # "file": the checkpoint code treats it as a local disk (fsync...)
    full_switch: pathlib.Path | None = None
    delays: dict = {}

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if any(c in mode for c in "wxa"):
            name = path.rsplit("/", 1)[-1]
            if self.full_switch is not None and self.full_switch.exists():
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            time.sleep(max([s for part, s in self.delays.items() if part in name], default=0.0))
        return super()._open(path, mode, block_size=block_size, **kwargs)


fsspec.register_implementation("faultyfile", FaultyFileSystem, clobber=True)


class FaultyObjectStore(FaultyFileSystem):
    """The same faults on a real directory that the checkpoint code treats as an object store."""

    protocol = ("faultyobj",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, auto_mkdir=True, **kwargs)  # keys have no directories to create first

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        """A PUT stores a new object, then the key names it: on a full disk it fails (an in-place rewrite of a
        small file on tmpfs would reuse the file's own page and succeed)."""
        tmp = f"{path}.put-{uuid.uuid4().hex}"
        try:
            super().pipe_file(tmp, value, mode=mode, **kwargs)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


fsspec.register_implementation("faultyobj", FaultyObjectStore, clobber=True)


@pytest.fixture
def faulty_fs():
    yield FaultyFileSystem
    FaultyFileSystem.full_switch, FaultyFileSystem.delays = None, {}


class Disk:
    """A small disk that can be filled (every write then fails with ENOSPC) and freed."""

    def __init__(self, path: pathlib.Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.uri = str(path) if kind == "tmpfs" else f"faultyfile://{path}"
        self.object_uri = f"faultyobj://{path}"  # the same disk as an object store (the renewed lease)
        self._ballast = path / "BALLAST"
        self._switch = path.parent / "FULL"

    def fill(self) -> None:
        if self.kind != "tmpfs":
            self._switch.touch()
            return
        with open(self._ballast, "ab", buffering=0) as f:
            for chunk in (1 << 16, 1 << 12, 1 << 9):  # to the last byte: even a 200-byte lease write fails
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc

    def free(self) -> None:
        if self.kind == "tmpfs":
            self._ballast.unlink()
        else:
            self._switch.unlink()


def _mount_tmpfs(path: pathlib.Path) -> str | None:
    """Mount a 4 MiB tmpfs on ``path``; None if it worked, else why not."""
    if os.environ.get("ELASTIC_RING_TEST_NO_TMPFS"):
        return "ELASTIC_RING_TEST_NO_TMPFS is set"
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "not root, or no mount(8)"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


@pytest.fixture
def small_disk(tmp_path, faulty_fs):
    path = tmp_path / "disk"
    path.mkdir()
    why_not = _mount_tmpfs(path)
    if why_not is not None:
        print(f"no tmpfs ({why_not}): ENOSPC is injected by FaultyFileSystem on a real directory")
        FaultyFileSystem.full_switch = tmp_path / "FULL"
        yield Disk(path, "injected")
        return
    try:
        yield Disk(path, "tmpfs")
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=20).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


@pytest.fixture
def events():
    seen = []
    set_checkpoint_listener(seen.append)
    yield seen
    set_checkpoint_listener(None)


def _wait_for(predicate, timeout_s, step_s=0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def _assert_whole(store: CheckpointStore) -> None:
    """Every checkpoint directory is complete and loads; no temporary file is left."""
    root = pathlib.Path(store.root)
    dirs = sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("ckpt-"))
    assert dirs == store.complete(), (dirs, store.complete())
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]
    for seq in dirs:
        store.load(seq)


# ------------------------------------------------------------------ a full disk
def test_disk_full_for_a_while_then_space_returns_the_run_goes_on(small_disk, events):
    """Scaled from the users' case (checkpoints every 5 s, disk full for 9 s, lease ttl 15 s) by 1/3:
    every 1 s, full for 3 s, ttl 5 s; the write retry budget (2 s) is shorter than the outage, so a
    write fails and is reported, and the next ones succeed. The lease is a file lock: the full disk
    never touches it."""
    lease = CheckpointLease(small_disk.uri, RUN, ttl_s=5.0).acquire()
    store = CheckpointStore(small_disk.uri, keep_last=2, run_id=RUN)
    writer = BackgroundWriter(store, max_consecutive_failures=3, retry_budget_s=2.0)
    weights = torch.zeros(1 << 16)  # 256 KiB of state
    step, freed_at_step, started = 0, None, time.monotonic()
    filled = False
    try:
        while time.monotonic() - started < 8.0:
            elapsed = time.monotonic() - started
            if not filled and elapsed >= 1.0:
                small_disk.fill()
                filled = True
            if freed_at_step is None and elapsed >= 4.0:
                small_disk.free()
                freed_at_step = step
            step += 1
            weights.fill_(step)
            writer.check()  # what every commit does: never raises during a blip that heals
            lease.check()   # what the driver does every tick
            if step % 20 == 0:  # every 1 s
                writer.submit(lambda s=step: ({"w": weights, "step": s}, {"commits": s}))
            else:
                writer.poll()
            time.sleep(0.05)
        newest = writer.flush(timeout_s=30)
    finally:
        lease.release()
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    written = [e for e in events if e["kind"] == "checkpoint_written"]
    assert failed, (small_disk.kind, events)
    assert all("No space left on device" in e["error"] and e["transient"] for e in failed), failed
    assert max(e["attempts"] for e in failed) >= 2 and max(e["retried_s"] for e in failed) >= 1.0, failed
    assert max(e["consecutive_failures"] for e in failed) < 3, failed  # the blip never stops the run
    after = [e for e in written if e["commits"] > freed_at_step]
    assert after and events.index(after[0]) > events.index(failed[-1]), events  # later checkpoints succeed
    assert newest == written[-1]["uri"] and store.load_latest()[0]["step"] == written[-1]["commits"]
    assert lease.failed_renewals == 0 and lease.last_error is None  # nothing to renew: the kernel holds the lock
    _assert_whole(store)


def test_a_disk_that_stays_full_stops_at_a_commit_and_flush_retries_until_space_returns(small_disk, events,
                                                                                      monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "_writers", weakref.WeakSet())  # flush_checkpoints sees this writer only
    store = CheckpointStore(small_disk.uri, keep_last=1, run_id=RUN)
    writer = BackgroundWriter(store, max_consecutive_failures=2, retry_budget_s=0.5)
    writer.submit(lambda: ({"step": 1, "w": torch.ones(1000)}, {"commits": 1}))
    first = writer.flush(timeout_s=30)
    small_disk.fill()
    for commits in (2, 3):
        writer.submit(lambda c=commits: ({"step": c, "w": torch.ones(1000)}, {"commits": c}))
        assert _wait_for(lambda: not writer.busy, 10)
    with pytest.raises(CheckpointError, match=r"2 checkpoint writes in a row to .* failed; the last: writing .*"
                                              r"No space left on device.*checkpoint 1 is still the newest.*"
                                              r"Free space.*retried for up to 0.5 s.*writes have failed for \d+ s"):
        writer.check()
    assert [e["consecutive_failures"] for e in events if e["kind"] == "checkpoint_failed"] == [1, 2]
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"final checkpoint flush \(within 1 s\) failed: the last checkpoint "
                                              r"write failed: .*No space left on device"):
        flush_checkpoints(timeout_s=1.0)  # the last write is retried until the deadline, then it says why
    assert 0.4 < time.monotonic() - started < 3  # retried (3 attempts), and done before the deadline
    threading.Timer(1.0, small_disk.free).start()  # space returns while the final flush retries
    newest = flush_checkpoints(timeout_s=15)
    assert newest != first and store.load_latest()[0]["step"] == 3  # the newest state, not an older one
    assert writer.consecutive_failures == 0
    writer.check()
    assert events[-1]["kind"] == "checkpoint_written" and events[-1]["attempts"] >= 2
    _assert_whole(store)


# ------------------------------------------------------------------ the lease on a full disk
def test_renewals_failing_for_less_than_the_ttl_keep_the_lease_and_a_contender_refuses(small_disk):
    lease = CheckpointLease(small_disk.object_uri, RUN, ttl_s=3.0).acquire()
    try:
        small_disk.fill()
        refused = {}
        contender = threading.Thread(target=lambda: refused.update(error=_try_acquire(small_disk.object_uri, "run-b",
                                                                                      3.0)))
        contender.start()
        assert _wait_for(lambda: lease.failed_renewals >= 2, 5), lease.failed_renewals
        time.sleep(1.5 - 0.6)
        small_disk.free()
        contender.join(20)
        assert not contender.is_alive()
        lease.check()
        assert lease.held and lease.last_error.errno == errno.ENOSPC
        assert "in use by run 'run-faults'" in str(refused["error"]), refused  # both sides: the holder is alive
        renewed = lease._last_renewed
        assert _wait_for(lambda: lease._last_renewed > renewed, 5)  # renewing on schedule again
    finally:
        assert lease.release()


def _try_acquire(uri, run_id, ttl_s):
    """A contender: on an object store it watches for up to 15 s (refusing once it sees a renewal); a file lock
    it tries for its default wait (``ttl_s / 5``), since a held lock is a live holder."""
    lease = CheckpointLease(uri, run_id, ttl_s=ttl_s)
    try:
        lease.acquire(timeout_s=None if lease.loc.local else 15).release()
    except CheckpointError as exc:
        return exc
    return None


def test_renewals_failing_for_the_whole_ttl_lose_the_lease_and_say_why(small_disk):
    lease = CheckpointLease(small_disk.object_uri, RUN, ttl_s=1.0).acquire()
    started = time.monotonic()
    small_disk.fill()
    assert _wait_for(lambda: not lease.held, 5)
    assert 0.7 <= time.monotonic() - started < 2.5  # ttl_s after the start of the last renewal before the fill
    with pytest.raises(CheckpointLeaseLost, match=r"run 'run-faults' lost the lease on checkpoint location .*: the "
                                                  r"lease could not be renewed for \d\.\d s, its whole ttl_s of 1 s \("
                                                  r"\d+ renewal attempt\(s\) failed, the last with OSError: .*No space "
                                                  r"left on device.*lease_ttl_s") as info:
        lease.check()
    assert info.value.reason == "expired" and info.value.attempts >= 2 and "No space" in info.value.last_error
    assert _wait_for(lambda: not lease._thread.is_alive(), 3)  # it stopped renewing: a contender may take over
    small_disk.free()
    successor = CheckpointLease(small_disk.object_uri, "run-b", ttl_s=1.0).acquire(timeout_s=15)
    try:
        assert successor.generation == 2
        with pytest.raises(CheckpointLeaseLost, match="could not be renewed"):
            lease.check()  # lost stays lost, even once the storage is back
        assert not lease.release()
    finally:
        successor.release()


def test_a_takeover_is_seen_at_once_even_while_renewal_writes_fail(tmp_path, faulty_fs):
    uri = f"faultyobj://{tmp_path / 'ckpt'}"
    lease = CheckpointLease(uri, RUN, ttl_s=3.0).acquire()
    FaultyFileSystem.full_switch = tmp_path / "FULL"
    FaultyFileSystem.full_switch.touch()  # this process's writes fail; listing still works
    assert _wait_for(lambda: lease.failed_renewals >= 1, 5)
    taker = CheckpointLease(uri, "run-b", ttl_s=3.0)
    (tmp_path / "ckpt" / "LEASE-000000000002.json").write_bytes(taker._body(2))  # another host took it over
    started = time.monotonic()
    assert _wait_for(lambda: not lease.held, 5)
    assert time.monotonic() - started < 1.0  # the next retry sees it (retries are faster than renewals), not the TTL
    with pytest.raises(CheckpointLeaseLost, match=r"to run 'run-b'.*\d+ failed since, last error OSError: .*No space") \
            as info:
        lease.check()
    assert info.value.reason == "taken_over" and info.value.attempts >= 1


# ------------------------------------------------------------------ slow storage
@pytest.mark.parametrize("kind", ["file", pytest.param("object", marks=pytest.mark.slow)])  # object: ~13 s
def test_slow_writes_are_not_failures_nothing_queues_up_and_the_lease_is_kept(tmp_path, faulty_fs, events, kind):
    uri = f"faultyfile://{tmp_path}" if kind == "file" else f"faultyobj://{tmp_path}"
    lease = CheckpointLease(uri, RUN, ttl_s=2.0).acquire()
    store = CheckpointStore(uri, keep_last=2, run_id=RUN)
    writer = BackgroundWriter(store, retry_budget_s=0.5)
    FaultyFileSystem.delays = {"data.pt": 3.0, "LEASE-": 0.5}  # each checkpoint takes > the lease's whole TTL
    # (object store: every renewal takes 0.5 s; a file lock writes nothing while held)
    try:
        started, submitted = time.monotonic(), 0
        while time.monotonic() - started < 7.5:
            submitted += 1
            writer.submit(lambda s=submitted: ({"step": s, "w": torch.full((100,), float(s))}, {"commits": s}))
            writer.check()
            lease.check()
            time.sleep(0.25)
        refused = _try_acquire(uri, "run-b", 2.0)  # slow renewals are still renewals; a held file lock is held
        assert refused is not None and "in use by run 'run-faults'" in str(refused), refused
        newest = writer.flush(timeout_s=30)
        lease.check()
    finally:
        FaultyFileSystem.delays = {}
        lease.release()
    written = [e for e in events if e["kind"] == "checkpoint_written"]
    assert not [e for e in events if e["kind"] != "checkpoint_written"], events
    assert 2 <= len(written) <= 5 and all(e["seconds"] >= 3.0 and e["attempts"] == 1 for e in written), written
    assert sum(e["superseded"] for e in written) + len(written) == submitted  # skipped, never queued
    assert written[-1]["commits"] == submitted and newest == written[-1]["uri"]  # the newest state is the last written
    assert lease.failed_renewals == 0
    _assert_whole(store)


def test_a_renewal_stuck_in_a_slow_write_is_reported_by_check_not_a_silent_hang(tmp_path, faulty_fs):
    uri = f"faultyobj://{tmp_path}"
    lease = CheckpointLease(uri, RUN, ttl_s=1.0).acquire()
    FaultyFileSystem.delays = {"LEASE-": 3.0}
    started = time.monotonic()
    assert _wait_for(lambda: not lease.held, 5)
    assert 0.7 <= time.monotonic() - started < 2.0  # decided on the clock while the write still hangs
    with pytest.raises(CheckpointLeaseLost, match=r"could not be renewed for \d\.\d s.*no renewal failed.*a renewal "
                                                  r"write has been in flight for \d\.\d s \(storage slow or hanging\)"):
        lease.check()
    assert lease._thread.is_alive()  # still blocked in the write...
    assert _wait_for(lambda: not lease._thread.is_alive(), 5)  # ...which ends, and does not bring the lease back
    FaultyFileSystem.delays = {}
    assert not lease.held and not lease.release()


# ------------------------------------------------------------------ what is retried
@pytest.mark.parametrize("exc, transient", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EIO, "Input/output error"), True),
    (OSError(errno.EAGAIN, "Resource temporarily unavailable"), True),
    (TimeoutError("read timed out"), True),
    (fsspec.exceptions.FSTimeoutError(), True),
    (ConnectionResetError(), True),
    (type("ReadTimeoutError", (Exception,), {})("botocore"), True),
    (type("SlowDown", (Exception,), {})("s3 throttling"), True),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (OSError(errno.EROFS, "Read-only file system"), False),
    (FileNotFoundError(errno.ENOENT, "No such file"), False),
    (TypeError("cannot pickle"), False),
    (CheckpointError("checkpoint location is leased by run 'x'"), False),
])
def test_which_errors_are_retried(exc, transient):
    assert is_transient(exc) is transient
    wrapped = CheckpointError(f"writing checkpoint 3 failed: {exc}")
    wrapped.__cause__ = exc
    assert is_transient(wrapped) is transient  # the store's wrapper is looked through
