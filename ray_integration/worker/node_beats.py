"""Heartbeats aggregated per node: one sealed ``node_hb`` message per node and interval instead of one ``hb`` per
worker (``ElasticTrainer(heartbeats="node")``; :mod:`..wire.protocol`).

The workers of one Ray node share a directory on that node, ``<tmp>/elastic_ring-<uid>/<job>/<ray node id>/``
(keyed by the Ray node id, so that beats never cross Ray nodes even when several raylets share a host). Each level
is a real directory (not a symlink: ``lstat``) of this user with mode 0o700, checked before anything is written or
deleted there: a stranger on the host can neither read the beats nor point them, or the clean-up, elsewhere.

* every worker, every heartbeat interval, writes its heartbeat (what its ``hb`` would carry: ``seq``, ``synced``,
  ``waiting``, ``reason``, ``asked``) to its own file ``<worker id>.beat``, sealed with the job's secret under a name that
  binds the job and the worker id, atomically (a temporary file, then ``os.replace``);
* one of them forwards: the one that holds ``leader.lock`` (a ``filelock.FileLock``, ``flock(2)``: the kernel
  releases it when the holder's process dies). Every other worker tries to take it, without waiting, on each of
  its ticks that finds the leader's stamp (below) missing or stale. The leader reads every beat file, keeps those
  whose seal checks (a stranger's or a damaged file is ignored and counted) and whose counter advanced since it
  last forwarded them, and sends them as ONE message;
  then it writes a sealed freshness stamp (``time.monotonic()``: the same host's clock for every process here;
  and who forwards: its worker id and process id);
* a worker that is not the leader and finds the stamp missing or older than :data:`STALE_INTERVALS` intervals (a
  stopped, starved or dying leader) sends its own ``hb`` directly, as in ``heartbeats="worker"``: a stalled leader
  silences its node-mates for about one interval at most, never long enough for the driver's silence rules.

Clean-up: a worker removes its file when it leaves the job; the leader deletes files not rewritten for
:data:`DEAD_FILE_INTERVALS` intervals (their workers died); the last worker out removes the directory; a directory
left behind anyway (a forwarder stopped until killed holds the lock to the end) is deleted by the next worker that
starts on that host, once nobody wrote it for :data:`LEFT_BEHIND_S`.

The driver times silence as "time since the worker's counter last advanced" (it ignores a counter that did not),
so a dead worker's file, forwarded again, keeps nobody alive; and it accepts a ``node_hb`` entry only for workers
its records place on the sender's node (:meth:`~ray_integration.driver.pool.WorkerPool.apply`).
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from dataclasses import dataclass

import filelock

from elastic_ring.core.auth import AuthenticationError, seal_json, unseal_json
from elastic_ring.core.log import get_logger

_log = get_logger(__name__)

#: A leader whose stamp is older than this many heartbeat intervals is taken for stalled: its node-mates beat
#: directly until it forwards again.
STALE_INTERVALS = 1.5
BEAT_SUFFIX = ".beat"
LOCK_NAME, STAMP_NAME = "leader.lock", "stamp"
#: A beat file not rewritten for this many intervals is a dead worker's (a live one rewrites it every interval):
#: the leader deletes it, and it keeps no directory from being cleaned up.
DEAD_FILE_INTERVALS = 4
#: A node directory of any job not written for this long is a finished job's, left behind (its last forwarder was
#: stopped until killed, so nobody could clean up): the next NodeBeats on that host deletes it.
LEFT_BEHIND_S = 3600.0
#: A beat file is a few hundred bytes; anything much larger is not one.
MAX_BEAT_BYTES = 4096


def node_directory(job_id: str, node_id: str, root: str | None = None) -> str:
    """Where the workers of ``job_id`` on Ray node ``node_id`` keep their beats (``root``: the temporary directory)."""
    for what, value in (("job id", job_id), ("node id", node_id)):
        if not value or os.sep in value or value in (".", ".."):
            raise ValueError(f"NodeBeats: {what} {value!r} cannot name a directory")
    return os.path.join(root or tempfile.gettempdir(), f"elastic_ring-{os.getuid()}", job_id, node_id)


def _private_directory(path: str) -> None:
    """Make ``path`` (its parent must exist) a directory of this user's alone, or raise PermissionError: an existing
    one must be a real directory (``lstat``: a symlink is refused), owned by this user, with no group/other bits."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"NodeBeats: {path} is not this user's private directory (a symlink, another owner "
                              f"(uid {info.st_uid}) or mode {oct(info.st_mode & 0o777)}); heartbeats stay per worker")


@dataclass(frozen=True)
class Tick:
    """What a worker sends for one heartbeat interval: its own ``hb`` (``direct``), and/or, as the node's leader, one
    ``node_hb`` with ``forward`` (worker id -> heartbeat); after sending that, call :meth:`NodeBeats.forwarded`."""

    direct: bool
    forward: dict[str, dict] | None = None


class NodeBeats:
    """One worker's part in its node's aggregated heartbeats (module docstring). Not thread-safe: one heartbeat
    thread calls :meth:`tick`, :meth:`forwarded` and :meth:`close`."""

    def __init__(self, job_id: str, node_id: str, worker_id: str, secret: bytes, interval_s: float,
                 root: str | None = None) -> None:
        self.job_id, self.node_id, self.worker_id = job_id, node_id, worker_id
        self._secret, self._interval_s = secret, interval_s
        self.directory = node_directory(job_id, node_id, root)
        self._levels = (os.path.dirname(os.path.dirname(self.directory)), os.path.dirname(self.directory),
                        self.directory)  # this user's root, the job's, the node's
        _private_directory(self._levels[0])  # checked before the sweep deletes anything under it
        _sweep(self._levels[0], keep=self.directory)
        self._make_directory()
        self._file = os.path.join(self.directory, worker_id + BEAT_SUFFIX)
        self._stamp = os.path.join(self.directory, STAMP_NAME)
        # thread_local=False: released by whichever thread closes; separate instances exclude each other even in
        # one process (each opens its own descriptor; filelock 4 makes no singletons unless asked)
        self._lock = filelock.FileLock(os.path.join(self.directory, LOCK_NAME), thread_local=False)
        self.leader = False
        self.rejected = 0  # beat files that failed their seal (or were not beats): ignored
        self._forwarded_seq: dict[str, int] = {}

    def _make_directory(self) -> None:
        for level in self._levels:
            _private_directory(level)

    # ------------------------------------------------------------ names
    def _beat_name(self, worker_id: str) -> str:
        return f"{self.job_id}/beat/{worker_id}"

    def _stamp_name(self) -> str:
        return f"{self.job_id}/stamp/{self.node_id}"

    # ------------------------------------------------------------ one interval
    def tick(self, beat: dict) -> Tick:
        """Publish this worker's ``beat``, and say what to send for this interval."""
        self._write(self._file, seal_json(self._secret, self._beat_name(self.worker_id), beat))
        if not self.leader:
            if not self.leader_stale(time.monotonic()):
                return Tick(direct=False)  # the leader forwards (a fresh stamp: no use trying its lock)
            self.leader = self._try_lead()
            if not self.leader:
                return Tick(direct=True)  # it stalls, or is dying: beat directly meanwhile
            _log.info("worker %s forwards the heartbeats of node %s", self.worker_id, self.node_id[:12])
        return Tick(direct=False, forward=self.collect())

    def forwarded(self) -> None:
        """The leader sent its ``node_hb``: its node-mates need not beat directly."""
        self._write(self._stamp, seal_json(self._secret, self._stamp_name(),
                                           {"at": time.monotonic(), "worker": self.worker_id, "pid": os.getpid()}))

    def _try_lead(self) -> bool:
        try:
            self._lock.acquire(blocking=False)
        except filelock.Timeout:
            return False
        self._forwarded_seq.clear()  # a new leader forwards every live beat once
        return True

    def leader_stale(self, now: float) -> bool:
        """Whether the leader's last forward is missing or older than STALE_INTERVALS intervals."""
        try:
            with open(self._stamp, "rb") as f:
                stamp = unseal_json(self._secret, self._stamp_name(), f.read(MAX_BEAT_BYTES))
            at = float(stamp["at"])
        except (OSError, AuthenticationError, ValueError, TypeError, KeyError):
            return True
        age = now - at  # (a stamp from the future: this host's processes do not share a clock after all; safe side)
        return age > STALE_INTERVALS * self._interval_s or age < -self._interval_s

    def collect(self) -> dict[str, dict]:
        """Every node-mate's beat whose seal checks and whose ``seq`` advanced since this leader forwarded it."""
        beats: dict[str, dict] = {}
        for worker_id, path in self._beat_files():
            try:
                with open(path, "rb") as f:
                    beat = unseal_json(self._secret, self._beat_name(worker_id), f.read(MAX_BEAT_BYTES))
            except FileNotFoundError:
                continue  # its worker closed meanwhile
            except (OSError, AuthenticationError, ValueError):
                self.rejected += 1
                continue
            if not isinstance(beat, dict) or not isinstance(beat.get("seq"), int):
                self.rejected += 1
                continue
            if beat["seq"] > self._forwarded_seq.get(worker_id, 0):
                self._forwarded_seq[worker_id] = beat["seq"]
                beats[worker_id] = beat
        return beats

    def _beat_files(self) -> list[tuple[str, str]]:
        """(worker id, path) of every beat file written within DEAD_FILE_INTERVALS intervals; older ones (their
        workers died) are deleted. (Their age is read on this host's clock, the one that wrote them.)"""
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(BEAT_SUFFIX)]
        except FileNotFoundError:
            return []
        files, oldest = [], time.time() - DEAD_FILE_INTERVALS * self._interval_s
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                if os.stat(path).st_mtime < oldest:
                    os.remove(path)
                    self._forwarded_seq.pop(name[: -len(BEAT_SUFFIX)], None)
                    continue
            except FileNotFoundError:
                continue
            files.append((name[: -len(BEAT_SUFFIX)], path))
        return files

    def _write(self, path: str, text: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the directory went (the last worker of a finished job cleaned up): again
            self._make_directory()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    # ------------------------------------------------------------ the end
    def close(self) -> None:
        """Remove this worker's beat, give up leading, and remove the directory if nobody else beats there."""
        for path in (self._file, f"{self._file}.{os.getpid()}.tmp"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        if self.leader:
            try:  # its node-mates take over at their next beat, not 1.5 intervals later
                os.remove(self._stamp)
            except FileNotFoundError:
                pass
        if self.leader or self._try_lead():
            try:
                if not self._beat_files():
                    for name in (STAMP_NAME, LOCK_NAME):
                        try:
                            os.remove(os.path.join(self.directory, name))
                        except FileNotFoundError:
                            pass
                    os.rmdir(self.directory)
                    os.rmdir(os.path.dirname(self.directory))  # the job's, once its last node here is gone
            except OSError:
                pass  # someone else arrived meanwhile (they clean up later), or another node's directory is left
            finally:
                self._lock.release(force=True)
                self.leader = False


def _ours(name: str) -> bool:
    return name.endswith((BEAT_SUFFIX, ".tmp")) or name in (STAMP_NAME, LOCK_NAME)


def _sweep(top: str, keep: str) -> None:
    """Delete the node directories under ``top`` (this user's private root: every job's) that nobody wrote for
    LEFT_BEHIND_S: a live one is written every interval (each beat replaces its file there). Symlinks are never
    followed, and only NodeBeats' own file names are deleted; errors are ignored."""
    oldest = time.time() - LEFT_BEHIND_S
    try:
        jobs = [e for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for job in jobs:
        try:
            for node in os.scandir(job.path):
                info = node.stat(follow_symlinks=False)
                if (node.path == keep or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                        or info.st_mtime >= oldest):
                    continue
                for entry in os.scandir(node.path):
                    if _ours(entry.name) and not entry.is_dir(follow_symlinks=False):
                        os.remove(entry.path)
                os.rmdir(node.path)  # (fails if something not ours is left in it: kept)
            os.rmdir(job.path)  # (fails while another node directory of the job is left: fine)
        except OSError:
            continue


__all__ = ["NodeBeats", "STALE_INTERVALS", "Tick", "node_directory"]
