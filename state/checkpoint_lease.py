"""A lease on a checkpoint location: one live run per location, taken over when its holder dies.

The lease is a file ``LEASE-<generation>.json`` at the location's root; the highest generation is
the current one. Its holder (the driver process of a run) rewrites it every ``renew_every_s``
seconds with a larger ``counter``. A contender never compares clocks across hosts: it reads the
current generation, then watches it on its own monotonic clock. If the bytes change within the
holder's ``ttl_s`` the holder is alive and the contender refuses with an error naming the location
and the run. If nothing changes for ``ttl_s`` (the holder died) or the lease says ``released``,
the contender takes over by creating the next generation with a conditional create, so that of two
contenders exactly one wins. A holder that finds a newer generation than its own has lost the lease
and says so (:meth:`CheckpointLease.check`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Any

from elastic_ring.log import get_logger

from .checkpoint_errors import CheckpointError
from .checkpoint_io import Location
from .checkpoint_policy import check_checkpoint_uri

_log = get_logger(__name__)

LEASE_FORMAT = "elastic_ring.lease/1"
_LEASE = re.compile(r"^LEASE-(\d{12})\.json$")
#: The most a contender waits on a holder's declared ttl_s (a bad value must not hang it).
MAX_TTL_S = 120.0


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


def read_holder(loc: Location) -> dict | None:
    """The current lease's content (``run_id``, ``host``, ``pid``, ``released``...), or None if there is none
    (or it is being written)."""
    generations = _generations(loc)
    return _parse(_read_raw(loc, generations[-1])) if generations else None


class CheckpointLease:
    """Exclusive use of the checkpoint location ``uri`` by the run ``run_id``, held by one process.

    ``acquire()`` returns once this run holds the lease; it raises :class:`CheckpointError` naming
    the location and the other run if that run is alive (seen renewing within its ``ttl_s``). The
    lease then renews itself from a background thread; :meth:`check` raises if it was lost (renewal
    failing for ``ttl_s``, or taken over after this process stalled). ``release()`` lets the next run
    take over at once. If the holder dies, a contender takes over after ``ttl_s`` of silence."""

    def __init__(self, uri: str, run_id: str, *, ttl_s: float = 5.0, renew_every_s: float | None = None,
                 poll_s: float | None = None) -> None:
        self.uri = check_checkpoint_uri(uri, "CheckpointLease uri")
        if not isinstance(run_id, str) or not re.fullmatch(r"[\w.\-]{1,128}", run_id):
            raise ValueError(f"CheckpointLease run_id={run_id!r} must be 1-128 letters, digits, '_', '-' or '.' "
                             "(the job id)")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0.2 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"CheckpointLease ttl_s={ttl_s!r} must be seconds in [0.2, {MAX_TTL_S}] "
                             "(how long a dead holder blocks the location)")
        renew = ttl_s / 5 if renew_every_s is None else renew_every_s
        if isinstance(renew, bool) or not isinstance(renew, (int, float)) or not 0 < renew <= ttl_s / 2:
            raise ValueError(f"CheckpointLease renew_every_s={renew_every_s!r} must be > 0 and <= ttl_s / 2 "
                             f"= {ttl_s / 2} (a live holder must be seen renewing within ttl_s)")
        self.run_id, self.ttl_s, self.renew_every_s = run_id, float(ttl_s), float(renew)
        self.poll_s = min(0.2, ttl_s / 10) if poll_s is None else float(poll_s)
        self.loc = Location(self.uri)
        try:
            self.loc.makedirs(self.loc.root)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint directory {self.uri}: {exc}") from exc
        self._token = uuid.uuid4().hex
        self._generation: int | None = None
        self._counter = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: CheckpointError | None = None
        self._last_error: BaseException | None = None
        self._last_renewed = 0.0

    # ------------------------------------------------------------ state
    @property
    def held(self) -> bool:
        return self._generation is not None and self._lost is None

    @property
    def generation(self) -> int | None:
        return self._generation

    @property
    def last_error(self) -> BaseException | None:
        """The last renewal error (transient ones are retried until ``ttl_s`` has passed)."""
        return self._last_error

    def check(self) -> None:
        """Raise :class:`CheckpointError` if this lease was lost (taken over, or renewal failing for ``ttl_s``)."""
        if self._lost is not None:
            raise self._lost

    def _body(self, generation: int, released: bool = False) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, "run_id": self.run_id, "generation": generation,
                           "counter": self._counter, "ttl_s": self.ttl_s, "host": socket.gethostname(),
                           "pid": os.getpid(), "token": self._token, "released": released}).encode()

    # ------------------------------------------------------------ acquire
    def acquire(self, timeout_s: float | None = None) -> "CheckpointLease":
        """Hold the location for this run, or raise :class:`CheckpointError` if another run is live there.

        Takes at most about ``ttl_s`` (the holder's) when the previous holder died without releasing;
        ``timeout_s`` (default ``3 * ttl_s + 5``) bounds the whole attempt."""
        if self._generation is not None:
            raise CheckpointError(f"the lease on {self.uri} is already held by this object (run {self.run_id!r})")
        limit = 3 * self.ttl_s + 5 if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            generations = _generations(self.loc)
            target = 1
            if generations:
                free = self._wait_until_free(generations[-1], deadline)
                if not free:
                    continue  # a newer generation appeared, or the lease vanished: look again
                target = generations[-1] + 1
            self._counter = 0
            if self.loc.create_exclusive(_path(self.loc, target), self._body(target), durable=False):
                self._generation, self._last_renewed = target, time.monotonic()
                self._cleanup(target)
                self._thread = threading.Thread(target=self._renew_loop, name="elastic-ring-checkpoint-lease",
                                                daemon=True)
                self._thread.start()
                _log.info("holding the lease on %s (run %s, generation %d)", self.uri, self.run_id, target)
                return self
            # another contender created it first: the next round watches the winner
        raise CheckpointError(f"could not acquire the lease on checkpoint location {self.uri} within {limit:.1f} s: "
                              "other runs keep taking it over; make sure one job uses this location")

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
        started = time.monotonic()
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
                raise CheckpointError(
                    f"checkpoint location {self.uri} is in use by run {current.get('run_id')!r} (host "
                    f"{current.get('host')}, pid {current.get('pid')}), which renewed its lease while this run "
                    f"{self.run_id!r} watched; two jobs on one location would resume each other's state and prune "
                    "each other's checkpoints. Stop that run first, or give this one its own checkpoint_uri")
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
        """Renew once (the background thread does this every ``renew_every_s``)."""
        with self._lock:
            if self._generation is None:
                raise CheckpointError(f"the lease on {self.uri} is not held")
            newest = _generations(self.loc)[-1:]
            if newest and newest[0] > self._generation:
                other = _parse(_read_raw(self.loc, newest[0])) or {}
                raise CheckpointError(
                    f"this run {self.run_id!r} lost the lease on checkpoint location {self.uri} to run "
                    f"{other.get('run_id')!r}: its renewals stalled for over {self.ttl_s} s (process paused, storage "
                    "unreachable); stop this run, its checkpoints would now mix with the other's")
            self._counter += 1
            self.loc.write_small(_path(self.loc, self._generation), self._body(self._generation), durable=False)
            self._last_renewed = time.monotonic()

    def _renew_loop(self) -> None:
        try:
            while not self._stop.wait(self.renew_every_s):
                try:
                    self.renew()
                    self._last_error = None
                except CheckpointError as exc:
                    self._last_error, self._lost = exc, exc
                    _log.error("%s", exc)
                    return
                except Exception as exc:  # storage errors of any backend: retried until ttl_s has passed
                    self._last_error = exc
                    silent = time.monotonic() - self._last_renewed
                    _log.warning("renewing the lease on %s failed (%s: %s); %.1f s since the last renewal",
                                 self.uri, type(exc).__name__, exc, silent)
                    if silent > self.ttl_s:
                        self._lost = CheckpointError(
                            f"the lease on checkpoint location {self.uri} could not be renewed for {silent:.1f} s "
                            f"(last error {type(exc).__name__}: {exc}); another run may take it over: stop this run "
                            "and check the storage")
                        self._lost.__cause__ = exc
                        _log.error("%s", self._lost)
                        return
        except BaseException as exc:  # surfaced by check(): the lease is no longer renewed
            self._last_error = exc
            self._lost = CheckpointError(f"the lease renewal thread for {self.uri} died: {type(exc).__name__}: {exc}")
            self._lost.__cause__ = exc
            _log.error("%s", self._lost)

    # ------------------------------------------------------------ release
    def release(self, timeout_s: float = 10.0) -> None:
        """Stop renewing and mark the lease released, so that the next run takes over at once."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                raise CheckpointError(f"the lease renewal thread for {self.uri} did not stop within {timeout_s} s "
                                      "(storage hanging?); the lease expires by itself after ttl_s")
        with self._lock:
            generation, self._generation = self._generation, None
            if generation is None or self._lost is not None:
                return
            self._counter += 1
            try:
                self.loc.write_small(_path(self.loc, generation), self._body(generation, released=True), durable=False)
            except OSError as exc:
                raise CheckpointError(f"could not release the lease on {self.uri}: {exc}; the next run takes it "
                                      f"over after {self.ttl_s} s instead") from exc
        _log.info("released the lease on %s (run %s)", self.uri, self.run_id)

    def __enter__(self) -> "CheckpointLease":
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
