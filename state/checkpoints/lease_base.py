"""What the two kinds of checkpoint lease share (``lease_file.py``, ``lease_object_store.py``)."""

from __future__ import annotations

import abc
import re
import threading
import uuid
from typing import Any

from elastic_ring.core.log import get_logger

from ..errors import CheckpointError, CheckpointLeaseLost
from .transport import Location
from .config import check_checkpoint_uri

_log = get_logger(__name__)

#: The most a contender waits on a holder's declared ttl_s (a bad value must not hang it).
MAX_TTL_S = 120.0
#: The default ttl_s (ElasticTrainer's ``lease_ttl_s`` default too).
DEFAULT_TTL_S = 15.0


def uses_file_lock(loc: Location) -> bool:
    """True if the lease on ``loc`` is an OS file lock (local and network file systems)."""
    return loc.local


def in_use_error(uri: str, run_id: str, holder: dict | None, how: str) -> CheckpointError:
    """The refusal of a contender: ``uri`` is held by ``holder``'s run (``how`` says how that was seen)."""
    holder = holder or {}
    return CheckpointError(
        f"checkpoint location {uri} is in use by run {holder.get('run_id', 'unknown')!r} (host "
        f"{holder.get('host')}, pid {holder.get('pid')}), {how} this run {run_id!r}; two jobs on one location would "
        "resume each other's state and prune each other's checkpoints. Stop that run first, or give this one its "
        "own checkpoint_uri")


class LeaseBase(abc.ABC):
    """What both kinds of lease share: the arguments, the loss, ``check()``, the context manager."""

    def __init__(self, uri: str, run_id: str, *, ttl_s: float = DEFAULT_TTL_S, renew_every_s: float | None = None,
                 poll_s: float | None = None) -> None:
        self.uri = check_checkpoint_uri(uri, "CheckpointLease uri")
        if not isinstance(run_id, str) or not re.fullmatch(r"[\w.\-]{1,128}", run_id):
            raise ValueError(f"CheckpointLease run_id={run_id!r} must be 1-128 letters, digits, '_', '-' or '.' "
                             "(the job id)")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0.2 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"CheckpointLease ttl_s={ttl_s!r} must be seconds in [0.2, {MAX_TTL_S}] "
                             "(how long a dead holder blocks an object-store location)")
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
        self._state = threading.Lock()  # the fields below; never held during I/O, so check() never blocks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: CheckpointLeaseLost | None = None
        self._last_error: BaseException | None = None
        self.failed_renewals = 0        # every failed renewal (or verification) of this lease (diagnostics)

    # ------------------------------------------------------------ state
    @property
    def held(self) -> bool:
        return self._generation is not None and self._loss() is None

    @property
    def generation(self) -> int | None:
        return self._generation

    @property
    def last_error(self) -> BaseException | None:
        """The last renewal error seen (kept after later renewals succeed, for diagnostics)."""
        return self._last_error

    def check(self) -> None:
        """Raise :class:`CheckpointLeaseLost` if this lease was lost. Never blocks."""
        lost = self._loss()
        if lost is not None:
            raise lost

    def _held_generation(self) -> int:
        """The generation this run holds; raises if it holds none or lost it (what every renewal checks first)."""
        with self._state:
            generation, lost = self._generation, self._lost
        if generation is None:
            raise CheckpointError(f"the lease on {self.uri} is not held")
        if lost is not None:
            raise lost
        return generation

    def _loss(self) -> CheckpointLeaseLost | None:
        with self._state:
            return self._lost

    def _set_lost(self, lost: CheckpointLeaseLost) -> CheckpointLeaseLost:
        """Record the loss (the first one stays); call with ``_state`` held."""
        if self._lost is None:
            self._lost = lost
            _log.error("%s", lost)
        return self._lost

    # ------------------------------------------------------------ the kinds' part
    @abc.abstractmethod
    def acquire(self, timeout_s: float | None = None) -> "LeaseBase":
        """Hold the location for this run, or raise :class:`CheckpointError` naming the run that holds it."""

    @abc.abstractmethod
    def renew(self) -> None:
        """Renew (object stores) or verify (file locks) once; raises :class:`CheckpointLeaseLost` if lost."""

    @abc.abstractmethod
    def release(self, timeout_s: float = 10.0) -> bool:
        """Let the next run take over at once; True if done. Never raises for storage trouble."""

    def __enter__(self) -> "LeaseBase":
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
