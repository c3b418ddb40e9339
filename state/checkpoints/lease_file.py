"""The lease on a local or network file system: an OS file lock, with the holder's record beside it.

The driver process holds ``filelock.FileLock`` (``flock(2)``) on ``LEASE.lock`` at the location's
root for the whole run, and writes ``LEASE.json`` (run id, host, pid, generation, ``released``),
which :func:`read_record` returns to any process, e.g. a checkpoint writer on another node. The
kernel releases the lock when the holder process dies, however it dies, so a crashed run's
successor takes over at once (no TTL to wait out); a second live run is refused within the
acquire's wait, naming the holding run from its record.

On NFS, Linux emulates ``flock`` with byte-range locks that the server arbitrates (NFSv4, or NFSv3
with lockd), so the lock holds across nodes; a holder whose node died keeps it until the server's
lease on that client expires (NFSv4: 90 s by default). A mount with ``nolock`` or ``local_lock=``
keeps locks local to each node: two drivers on two nodes may then both take the lock. The holder's
watcher thread notices that another run rewrote the record and :meth:`FileLease.check` raises
:class:`~state.errors.CheckpointLeaseLost` (``taken_over``), so one of them stops.
A file system without ``flock`` is refused with an error saying so (never a silent soft lock).
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import socket
import threading
import time

import filelock

from elastic_ring.core.log import get_logger

from ..errors import CheckpointError, CheckpointLeaseLost
from .faults import backoff_delay, is_transient
from .faults import describe as _describe
from .lease_base import DEFAULT_TTL_S, LeaseBase, in_use_error

_log = get_logger(__name__)

RECORD_FORMAT = "elastic_ring.lease-record/1"
LOCK_NAME, RECORD_NAME = "LEASE.lock", "LEASE.json"
#: filelock >= 4 would fall back to a soft (pid file) lock where flock is missing; a soft lock outlives a
#: crashed holder, so it is refused: ``preserve_lock_file=True`` turns that fallback off (older filelock has none).
_NATIVE_ONLY = {"preserve_lock_file": True} if "preserve_lock_file" in inspect.signature(
    filelock.FileLock.__init__).parameters else {}


def read_record(loc) -> dict | None:
    """The holder's record at ``loc`` (``run_id``, ``host``, ``pid``, ``generation``, ``released``...), or
    None if there is none. It stays after the holder ends: ``released`` says whether it released."""
    try:
        raw = loc.read_bytes(loc.path(RECORD_NAME), limit=64 << 10)
    except FileNotFoundError:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    return info if isinstance(info, dict) and info.get("format") == RECORD_FORMAT else None


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class FileLease(LeaseBase):
    """The file-lock lease (module docstring). ``ttl_s`` only sets ``renew_every_s`` (``ttl_s / 5``):
    how long ``acquire()`` waits for a holder that is releasing, and how often the watcher thread
    checks that the record and the lock file are still this run's."""

    def __init__(self, uri: str, run_id: str, *, ttl_s: float = DEFAULT_TTL_S, renew_every_s: float | None = None,
                 poll_s: float | None = None) -> None:
        super().__init__(uri, run_id, ttl_s=ttl_s, renew_every_s=renew_every_s, poll_s=poll_s)
        self.lock_path = os.path.join(self.loc.root, LOCK_NAME)
        self._record_path = self.loc.path(RECORD_NAME)
        self._file_lock = filelock.FileLock(self.lock_path, thread_local=False, **_NATIVE_ONLY)
        self._lock_identity: tuple[int, int] | None = None

    def _body(self, generation: int, released: bool = False) -> bytes:
        return json.dumps({"format": RECORD_FORMAT, "run_id": self.run_id, "generation": generation,
                           "ttl_s": self.ttl_s, "host": socket.gethostname(), "pid": os.getpid(),
                           "token": self._token, "lock": LOCK_NAME, "released": released}).encode()

    # ------------------------------------------------------------ acquire
    def acquire(self, timeout_s: float | None = None) -> "FileLease":
        """Hold the location for this run, or raise :class:`CheckpointError` naming the run that holds it.

        Waits up to ``timeout_s`` (default ``renew_every_s``) for the lock; a holder that died has no lock."""
        if self._generation is not None:
            raise CheckpointError(f"the lease on {self.uri} is already held by this object (run {self.run_id!r})")
        wait = self.renew_every_s if timeout_s is None else timeout_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
            raise ValueError(f"CheckpointLease.acquire timeout_s={timeout_s!r} must be seconds >= 0")
        try:
            self._file_lock.acquire(timeout=wait, poll_interval=min(0.05, self.poll_s))
        except filelock.Timeout:
            raise self._refusal(wait) from None
        except (OSError, NotImplementedError) as exc:
            raise self._cannot_lock(exc) from exc
        try:
            previous = read_record(self.loc)
            generation = int(previous.get("generation", 0)) + 1 if previous else 1
            self._lock_identity = _identity(self.lock_path)
            self._write_record(self._body(generation), time.monotonic() + max(wait, 10.0))
        except BaseException as exc:
            self._file_lock.release()
            if isinstance(exc, Exception):
                raise CheckpointError(f"took the lock {self.lock_path} but could not write the lease record "
                                      f"{self.loc.url(self._record_path)}: {_describe(exc)}; fix the storage "
                                      "(space, permissions) or set another checkpoint_uri") from exc
            raise
        if previous is not None and not previous.get("released"):
            _log.warning("run %r (host %s, pid %s) held %s without releasing it; its process is gone (the OS released "
                         "its lock): taking over", previous.get("run_id"), previous.get("host"), previous.get("pid"),
                         self.uri)
        with self._state:
            self._generation, self._lost = generation, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="elastic-ring-checkpoint-lease", daemon=True)
        self._thread.start()
        _log.info("holding the lease on %s (run %s, generation %d, lock %s)", self.uri, self.run_id, generation,
                  self.lock_path)
        return self

    def _refusal(self, waited: float) -> CheckpointError:
        try:
            holder = read_record(self.loc)
        except OSError as exc:  # the refusal stands; the record only names the holder
            _log.warning("could not read the lease record of %s: %s", self.uri, _describe(exc))
            holder = None
        if holder is None or holder.get("released"):
            holder = {"run_id": "unknown (its record is not written yet, or it is an older elastic_ring)"}
        return in_use_error(self.uri, self.run_id, holder,
                            f"which holds the lock {self.lock_path} (waited {waited:.1f} s); seen by")

    def _cannot_lock(self, exc: BaseException) -> CheckpointError:
        if isinstance(exc, NotImplementedError) or getattr(exc, "errno", None) in (errno.ENOSYS, errno.ENOLCK):
            return CheckpointError(
                f"the file system of checkpoint location {self.uri} does not support file locks (flock on "
                f"{self.lock_path}: {_describe(exc)}), so its lease cannot keep a second run out; mount it with "
                "locking (NFS: without nolock or local_lock), or use an object store URL (s3://, gs://)")
        return CheckpointError(f"cannot take the lease on checkpoint location {self.uri}: locking {self.lock_path} "
                               f"failed: {_describe(exc)}; fix the storage (permissions, path) or set another "
                               "checkpoint_uri")

    def _write_record(self, body: bytes, deadline: float) -> None:
        """Write the record, retrying transient errors (full disk, timeouts) with backoff until ``deadline``."""
        failures = 0
        while True:
            try:
                self.loc.write_small(self._record_path, body)
                return
            except Exception as exc:  # retried while transient and time is left; then raised
                failures += 1
                pause = backoff_delay(failures, 0.1, 1.0)
                if not is_transient(exc) or time.monotonic() + pause > deadline:
                    raise
                _log.warning("writing the lease record of %s failed (%s); retrying in %.1f s", self.uri,
                             _describe(exc), pause)
                time.sleep(pause)

    # ------------------------------------------------------------ verify
    def renew(self) -> None:
        """Verify once that this run still holds the location (the watcher thread does this every
        ``renew_every_s``): the lock file is the one locked, the record names this run. Raises
        :class:`CheckpointLeaseLost` if not, the storage's error if the record cannot be read."""
        generation = self._held_generation()
        if _identity(self.lock_path) != self._lock_identity:
            raise self._lose(f"its lock file {self.lock_path} was removed or replaced while this run held it (the "
                             "location was cleaned?), so another run may lock the new file", "lock_file_replaced")
        record = read_record(self.loc)
        if record is None:  # deleted (or overwritten with garbage): this run holds the lock, so it writes it again
            _log.warning("the lease record of %s vanished; writing it again", self.uri)
            self.loc.write_small(self._record_path, self._body(generation))
        elif record.get("token") != self._token:
            raise self._lose(
                f"run {record.get('run_id')!r} (host {record.get('host')}, pid {record.get('pid')}) wrote its lease "
                f"record while this run held the lock {self.lock_path}: the lock is not exclusive across the nodes "
                "sharing this location (an NFS mount with nolock or local_lock), or the NFS server dropped this "
                "node's lock. Stop this run: its checkpoints would now mix with the other's; mount the location "
                "with working locks or use an object store URL", "taken_over", record.get("run_id"))

    def _lose(self, why: str, reason: str, other_run: str | None = None) -> CheckpointLeaseLost:
        with self._state:
            return self._set_lost(CheckpointLeaseLost(
                f"this run {self.run_id!r} lost the lease on checkpoint location {self.uri}: {why}",
                reason=reason, uri=self.uri, run_id=self.run_id, silent_s=0.0, attempts=self.failed_renewals,
                last_error=_describe(self._last_error) if self._last_error is not None else None,
                other_run=other_run))

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self.renew_every_s):
                try:
                    self.renew()
                except CheckpointLeaseLost:
                    return  # recorded and logged; check() raises it
                except Exception as exc:  # a read that failed: the kernel still holds the lock; look again later
                    with self._state:
                        self._last_error = exc
                        self.failed_renewals += 1
                    _log.warning("verifying the lease on %s failed (%s); the lock is still held, retrying in %g s",
                                 self.uri, _describe(exc), self.renew_every_s)
        except BaseException as exc:  # surfaced by check(): nothing verifies the lease any more
            with self._state:
                self._last_error = exc
            self._lose(f"its watcher thread died: {_describe(exc)} (a bug: report it)", "renewal_thread_died")

    # ------------------------------------------------------------ release
    def release(self, timeout_s: float = 10.0) -> bool:
        """Mark the record released and unlock, so that the next run takes over at once.

        Returns True if both were done. It never raises for storage trouble: a record that cannot be
        written within ``timeout_s`` is logged (the lock is released anyway); a lost lease is only unlocked."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._state:
            generation, self._generation = self._generation, None
            lost = self._lost
        if generation is None:
            return False
        marked = False
        if lost is None:
            try:
                self._write_record(self._body(generation, released=True), deadline)
                marked = True
            except Exception as exc:  # the lock below is what keeps runs apart; the record only names them
                _log.warning("could not mark the lease record of %s released (%s); stores of other runs refuse to "
                             "write there until the next run takes the location", self.uri, _describe(exc))
        try:
            self._file_lock.release()
        except OSError as exc:  # the descriptor is closed by the OS when this process ends
            _log.error("unlocking %s failed (%s); the lock is released when this process ends", self.lock_path,
                       _describe(exc))
            return False
        if marked:
            _log.info("released the lease on %s (run %s)", self.uri, self.run_id)
        return marked
