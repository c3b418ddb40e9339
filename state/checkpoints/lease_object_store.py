"""The lease on an object-store location (``s3://``, ``gs://``, ``memory://``): renewed generations.

Local and network file systems use an OS lock instead (``lease_file.py``). Here the lease is a file
``LEASE-<generation>.json`` at the location's root; the highest generation is the current one. Its
holder (the driver process of a run) rewrites it every ``renew_every_s`` seconds with a larger
``counter``. A contender never compares clocks across hosts: it reads the
current generation, then watches it on its own monotonic clock. If the bytes change within the
holder's ``ttl_s`` the holder is alive and the contender refuses with an error naming the location
and the run. If nothing changes for ``ttl_s`` (the holder died) or the lease says ``released``,
the contender takes over by creating the next generation with a conditional create, so that of two
contenders exactly one wins.

Both sides agree on one rule: **a lease is gone after ``ttl_s`` without a successful renewal.** The
holder times each renewal from the moment it *starts* (never later than the moment a contender can
see it), retries failed renewals with backoff (``renew_every_s / 10`` doubling up to
``renew_every_s / 4``), and counts the lease lost once ``ttl_s`` passed since the start of its last
successful renewal, even while a renewal write is still blocked in slow storage; a contender takes
over only after watching the file unchanged for at least that long. So a holder never believes it
holds a lease that a contender may already have taken, and a storage outage shorter than about
``0.75 * ttl_s`` (the renewal cadence and the retry pause eat the rest) never loses it. The holder
also loses the lease, at its next renewal, when it finds a newer generation (it was taken over).
:meth:`CheckpointLease.check` raises :class:`~state.errors.CheckpointLeaseLost`, which
says which case, for how long, and the last error.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

from elastic_ring.core.log import get_logger

from ..errors import CheckpointError, CheckpointLeaseLost
from .faults import backoff_delay, is_transient
from .faults import describe as _describe
from .lease_base import DEFAULT_TTL_S, MAX_TTL_S, LeaseBase, in_use_error
from .transport import Location

_log = get_logger(__name__)

LEASE_FORMAT = "elastic_ring.lease/1"
_LEASE = re.compile(r"^LEASE-(\d{12})\.json$")


def _generations(loc: Location) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_LEASE.match, loc.names()) if m)


def _path(loc: Location, generation: int) -> str:
    return loc.path(f"LEASE-{generation:012d}.json")


def _read_raw(loc: Location, generation: int) -> bytes | None:
    try:
        return loc.read_bytes(_path(loc, generation), limit=64 << 10)
    except FileNotFoundError:
        return None


def _parse(raw: bytes | None) -> dict | None:
    """A lease's content, or None if it is absent or not (yet) a whole lease."""
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        return None
    return info if isinstance(info, dict) and info.get("format") == LEASE_FORMAT else None


def read_current(loc: Location) -> dict | None:
    """The current lease's content (``run_id``, ``host``, ``pid``, ``released``...), or None if there is none
    (or it is being written)."""
    generations = _generations(loc)
    return _parse(_read_raw(loc, generations[-1])) if generations else None


class ObjectStoreLease(LeaseBase):
    """The generation lease (module docstring). ``acquire()`` raises :class:`CheckpointError` naming the
    location and the other run if that run is alive (seen renewing within its ``ttl_s``); the lease
    then renews itself from a background thread, retrying failures with backoff; :meth:`check`
    raises :class:`CheckpointLeaseLost` once it is lost (no successful renewal for ``ttl_s``, or taken
    over by another run). If the holder dies, a contender takes over after ``ttl_s`` of silence."""

    def __init__(self, uri: str, run_id: str, *, ttl_s: float = DEFAULT_TTL_S, renew_every_s: float | None = None,
                 poll_s: float | None = None) -> None:
        super().__init__(uri, run_id, ttl_s=ttl_s, renew_every_s=renew_every_s, poll_s=poll_s)
        self._counter = 0
        self._lock = threading.Lock()   # one lease write at a time (renew, release); held during I/O
        self._last_renewed = 0.0        # monotonic start of the last successful renewal (or of the acquire)
        self._failing = 0               # renewals failed since then
        self._writing_since: float | None = None  # a renewal write in progress started then

    # ------------------------------------------------------------ state
    def _loss(self) -> CheckpointLeaseLost | None:
        """The loss, deciding it on the clock if ``ttl_s`` passed without a successful renewal."""
        with self._state:
            if self._lost is None and self._generation is not None:
                silent = time.monotonic() - self._last_renewed
                if silent > self.ttl_s:
                    self._set_lost(self._expired(silent))
            return self._lost

    def _expired(self, silent: float) -> CheckpointLeaseLost:
        """No renewal succeeded for ``ttl_s``: ``_failing`` failed (the last with ``_last_error``), and a renewal
        write may have been in flight since ``_writing_since``."""
        writing_s = None if self._writing_since is None else time.monotonic() - self._writing_since
        attempts = self._failing
        error = _describe(self._last_error) if attempts and self._last_error is not None else None
        detail = f"{attempts} renewal attempt(s) failed, the last with {error}" if attempts else "no renewal failed"
        if writing_s is not None:
            detail += f"; a renewal write has been in flight for {writing_s:.1f} s (storage slow or hanging)"
        elif not attempts:
            detail += ": this process or its renewal thread was paused"
        return CheckpointLeaseLost(
            f"this run {self.run_id!r} lost the lease on checkpoint location {self.uri}: the lease could not be "
            f"renewed for {silent:.1f} s, its whole ttl_s of {self.ttl_s:g} s ({detail}), so another run may take the "
            "location over now and this run must stop writing there. Fix the storage (space, permissions, "
            "reachability), or give the lease a ttl_s (ElasticTrainer lease_ttl_s) longer than the outages it must "
            "ride out, then run again to resume from the newest checkpoint", reason="expired", uri=self.uri,
            run_id=self.run_id, silent_s=round(silent, 3), attempts=attempts, last_error=error)

    def _body(self, generation: int, released: bool = False) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, "run_id": self.run_id, "generation": generation,
                           "counter": self._counter, "ttl_s": self.ttl_s, "host": socket.gethostname(),
                           "pid": os.getpid(), "token": self._token, "released": released}).encode()

    # ------------------------------------------------------------ acquire
    def acquire(self, timeout_s: float | None = None) -> "ObjectStoreLease":
        """Hold the location for this run, or raise :class:`CheckpointError` if another run is live there.

        Takes at most about ``ttl_s`` (the holder's) when the previous holder died without releasing;
        transient storage errors (full disk, timeouts) are retried with backoff; ``timeout_s`` (default
        ``3 * ttl_s + 5``) bounds the whole attempt."""
        if self._generation is not None:
            raise CheckpointError(f"the lease on {self.uri} is already held by this object (run {self.run_id!r})")
        limit = 3 * self.ttl_s + 5 if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        failures, error = 0, None
        while time.monotonic() < deadline:
            try:
                if self._try_acquire(deadline):
                    return self
            except CheckpointError:
                raise
            except Exception as exc:  # storage errors: retried while transient, within the deadline
                if not is_transient(exc):
                    raise CheckpointError(f"cannot take the lease on checkpoint location {self.uri}: {_describe(exc)}; "
                                          "fix the storage (permissions, path) or set another checkpoint_uri") from exc
                failures, error = failures + 1, exc
                pause = min(backoff_delay(failures, 0.1, 2.0), max(0.0, deadline - time.monotonic()))
                _log.warning("taking the lease on %s failed (%s); retrying in %.1f s", self.uri, _describe(exc), pause)
                time.sleep(pause)
        raise CheckpointError(f"could not acquire the lease on checkpoint location {self.uri} within {limit:.1f} s: "
                              + (f"the storage kept failing ({failures} attempts, the last {_describe(error)}); fix it "
                                 "or set another checkpoint_uri" if error is not None else
                                 "other runs keep taking it over; make sure one job uses this location"))

    def _try_acquire(self, deadline: float) -> bool:
        generations = _generations(self.loc)
        target = 1
        if generations:
            if not self._wait_until_free(generations[-1], deadline):
                return False  # a newer generation appeared, or the lease vanished: look again
            target = generations[-1] + 1
        self._counter = 0
        started = time.monotonic()  # the lease counts from before its file can be seen
        if not self.loc.create_exclusive(_path(self.loc, target), self._body(target), durable=False):
            return False  # another contender created it first: the next round watches the winner
        with self._state:
            self._generation, self._last_renewed, self._failing, self._lost = target, started, 0, None
        self._stop.clear()
        self._cleanup(target)
        self._thread = threading.Thread(target=self._renew_loop, name="elastic-ring-checkpoint-lease", daemon=True)
        self._thread.start()
        _log.info("holding the lease on %s (run %s, generation %d, ttl %g s)", self.uri, self.run_id, target,
                  self.ttl_s)
        return True

    def _wait_until_free(self, generation: int, deadline: float) -> bool:
        """True once lease ``generation`` is released or stale; False if it changed under us (look again).
        Raises if its holder is seen alive."""
        first = _read_raw(self.loc, generation)
        info = _parse(first)
        if first is None:
            return False
        if info is not None and info.get("released"):
            return True
        declared = info.get("ttl_s") if info is not None else None
        ttl = min(MAX_TTL_S, max(self.ttl_s, declared if isinstance(declared, (int, float)) else 0))
        started = time.monotonic()  # after the read: the holder renewed no later than this
        while time.monotonic() - started < ttl:
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
            if _generations(self.loc)[-1:] != [generation]:
                return False
            now = _read_raw(self.loc, generation)
            if now is None:
                return False
            if now != first:
                current = _parse(now)
                if current is not None and current.get("released"):
                    return True
                if current is None:
                    continue  # being rewritten (object stores never show this; a torn local write might)
                raise in_use_error(self.uri, self.run_id, current, "which renewed its lease while")
        holder = info.get("run_id") if info is not None else "unknown"
        _log.warning("the lease on %s of run %s was not renewed for %.1f s: its holder is gone; taking over",
                     self.uri, holder, ttl)
        return True

    def _cleanup(self, generation: int) -> None:
        """Remove older generations and temporary files of earlier holders (failures are logged)."""
        for name in self.loc.names():
            m = _LEASE.match(name)
            if (m and int(m.group(1)) < generation) or (name.startswith("LEASE-") and ".tmp-" in name):
                try:
                    self.loc.remove(self.loc.path(name))
                except OSError as exc:
                    _log.warning("could not remove the old lease file %s: %s", self.loc.url(self.loc.path(name)), exc)

    # ------------------------------------------------------------ renew
    def renew(self) -> None:
        """Renew once (the background thread does this every ``renew_every_s``). Raises
        :class:`CheckpointLeaseLost` if the lease is lost (taken over, or renewed too late), the
        storage's error if the write failed (the caller retries)."""
        with self._lock:
            generation = self._held_generation()
            started = time.monotonic()
            newest = _generations(self.loc)[-1:]
            if newest and newest[0] > generation:
                raise self._taken_over(generation, newest[0])
            with self._state:
                self._writing_since = started
            try:
                self._counter += 1
                self.loc.write_small(_path(self.loc, generation), self._body(generation), durable=False)
            finally:
                with self._state:
                    self._writing_since = None
            with self._state:
                silent = time.monotonic() - self._last_renewed
                if self._lost is None and silent > self.ttl_s:  # done, but too late: a contender may have taken it
                    self._set_lost(self._expired(silent))
                if self._lost is not None:
                    raise self._lost
                self._last_renewed, self._failing = started, 0

    def _taken_over(self, generation: int, newest: int) -> CheckpointLeaseLost:
        """Run ``other["run_id"]`` created generation ``newest`` above this run's ``generation``."""
        other = _parse(_read_raw(self.loc, newest)) or {}
        with self._state:
            silent, attempts = time.monotonic() - self._last_renewed, self._failing
            error = _describe(self._last_error) if attempts and self._last_error is not None else None
            return self._set_lost(CheckpointLeaseLost(
                f"this run {self.run_id!r} lost the lease on checkpoint location {self.uri} to run "
                f"{other.get('run_id')!r} (host {other.get('host')}, pid {other.get('pid')}), which took it over as "
                f"generation {newest} (this run held {generation}; its last successful renewal began {silent:.1f} s "
                f"ago, {attempts} failed since, last error {error or 'none'}): the other run saw no renewal for its "
                "ttl_s (this process paused, or storage unreachable from it). Stop this run: its checkpoints would "
                "now mix with the other's", reason="taken_over", uri=self.uri, run_id=self.run_id,
                silent_s=round(silent, 3), attempts=attempts, last_error=error, other_run=other.get("run_id")))

    def _renew_loop(self) -> None:
        delay = self.renew_every_s
        try:
            while not self._stop.wait(delay):
                try:
                    self.renew()
                    delay = self.renew_every_s
                except CheckpointLeaseLost:
                    return  # recorded and logged; check() raises it
                except Exception as exc:  # storage errors of any backend: retried with backoff until ttl_s passed
                    with self._state:
                        self._last_error = exc
                        self._failing += 1
                        self.failed_renewals += 1
                        failing, silent = self._failing, time.monotonic() - self._last_renewed
                    if self._loss() is not None:
                        return
                    retry = backoff_delay(failing, self.renew_every_s / 10, self.renew_every_s / 4)
                    delay = min(retry, self.ttl_s - silent + 0.01)  # wake at the deadline at the latest
                    _log.warning("renewing the lease on %s failed (%s); %.1f s since the last renewal of %g s allowed; "
                                 "retrying in %.2f s", self.uri, _describe(exc), silent, self.ttl_s, delay)
        except BaseException as exc:  # surfaced by check(): the lease is no longer renewed
            with self._state:
                self._last_error = exc
                self._set_lost(CheckpointLeaseLost(
                    f"the lease renewal thread of run {self.run_id!r} for checkpoint location {self.uri} died: "
                    f"{_describe(exc)}; the lease is no longer renewed, so this run must stop (a bug: report it)",
                    reason="renewal_thread_died", uri=self.uri, run_id=self.run_id,
                    silent_s=round(time.monotonic() - self._last_renewed, 3), attempts=self._failing,
                    last_error=_describe(exc)))
                self._lost.__cause__ = exc

    # ------------------------------------------------------------ release
    def release(self, timeout_s: float = 10.0) -> bool:
        """Stop renewing and mark the lease released, so that the next run takes over at once.

        Returns True if the lease was marked released. It never raises for storage trouble: if the
        renewal thread is stuck in a write, or the mark cannot be written within ``timeout_s``, it logs
        why and returns False; the lease then expires by itself after ``ttl_s``."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                with self._state:
                    self._generation = None
                _log.error("the lease renewal thread for %s did not stop within %g s (a renewal write hangs in the "
                           "storage); the lease is not marked released and expires by itself after %g s", self.uri,
                           timeout_s, self.ttl_s)
                return False
        with self._lock:
            with self._state:
                generation, self._generation = self._generation, None
                lost = self._lost
            if generation is None or lost is not None:
                return False
            return self._write_released(generation, deadline)

    def _write_released(self, generation: int, deadline: float) -> bool:
        failures = 0
        while True:
            try:
                if _generations(self.loc)[-1:] != [generation]:
                    _log.warning("not releasing the lease on %s: generation %d is no longer the current one", self.uri,
                                 generation)
                    return False
                self._counter += 1
                self.loc.write_small(_path(self.loc, generation), self._body(generation, released=True), durable=False)
                _log.info("released the lease on %s (run %s)", self.uri, self.run_id)
                return True
            except Exception as exc:  # retried while transient and time is left; then logged
                failures += 1
                pause = backoff_delay(failures, 0.1, 1.0)
                if not is_transient(exc) or time.monotonic() + pause > deadline:
                    _log.warning("could not mark the lease on %s released (%s, %d attempts); the next run takes it "
                                 "over after %g s instead", self.uri, _describe(exc), failures, self.ttl_s)
                    return False
                time.sleep(pause)
