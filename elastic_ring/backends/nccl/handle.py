"""The life of one non-blocking NCCL communicator handle: create, settle, finalize, abort.

Kept free of CUDA and torch so that its decisions are tested on CPU with a fake
library (``tests/test_nccl.py``); the caller makes the right CUDA device
current around :func:`create`, :func:`finalize_and_destroy` and :func:`abort`.

Rules:

* a handle is used under its lock, and :meth:`CommHandle.detach` takes the
  pointer away under that lock: an abort never frees a communicator under a
  running call (calls are short: the communicator is non-blocking);
* a creation that fails or outlives its deadline is *aborted*, never destroyed
  (``ncclCommDestroy`` can block on a peer; ``ncclCommAbort`` interrupts an
  in-progress creation from NCCL 2.25 on);
* ``ncclCommDestroy`` runs only after ``ncclCommFinalize`` completed.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ...core.errors import CommError
from ...core.log import get_logger
from .lib import IN_PROGRESS, RESULT_NAMES, SUCCESS, NcclError

_log = get_logger(__name__)

INVALID_USAGE = 5


class CommHandle:
    """One ``ncclComm_t`` of a library ``lib`` (an :class:`~elastic_ring.backends.nccl.lib.NcclLibrary` or a fake)."""

    def __init__(self, lib, ptr: int) -> None:
        self.lib = lib
        self._ptr: int | None = ptr
        self._lock = threading.Lock()
        #: Buffers NCCL's asynchronous job may still use (a child communicator's :class:`~elastic_ring.backends.nccl.lib.OutComm`).
        self.keep: object = None

    @property
    def alive(self) -> bool:
        return self._ptr is not None

    def call(self, what: str, fn: Callable[..., int], *args) -> int:
        """``fn(ptr, *args)``: success or in-progress status; NcclError otherwise or when detached."""
        with self._lock:
            if self._ptr is None:
                raise NcclError(what, INVALID_USAGE, "the communicator was aborted or destroyed")
            status = fn(self._ptr, *args)
            if status not in (SUCCESS, IN_PROGRESS):
                raise NcclError(what, status, self.lib.last_error(self._ptr) or self.lib.error_string(status))
            return status

    def derive(self, what: str, fn: Callable[[int], object]) -> object:
        """``fn(ptr)`` under the lock, returning what it returns (a new communicator from this one:
        shrink, grow, its grow id); NcclError when detached."""
        with self._lock:
            if self._ptr is None:
                raise NcclError(what, INVALID_USAGE, "the communicator was aborted or destroyed")
            return fn(self._ptr)

    def state(self) -> int | None:
        """``ncclCommGetAsyncError``'s result, or None once detached."""
        with self._lock:
            if self._ptr is None:
                return None
            return self.lib.async_error(self._ptr)

    def describe(self, status: int) -> str:
        with self._lock:
            detail = self.lib.last_error(self._ptr) if self._ptr is not None else ""
        return f"{RESULT_NAMES.get(status, status)}: {detail or self.lib.error_string(status)}"

    def detach(self) -> int | None:
        """Take the pointer (the first caller gets it; later calls fail with 'aborted')."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
            return ptr


def settle(handle: CommHandle, what: str, deadline: float, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until the communicator is no longer ``ncclInProgress``.

    NcclError on an error state or a detached (aborted) handle; TimeoutError
    past ``deadline``. Polls with a backoff from 50 us to 2 ms: a collective's
    launch settles in well under a millisecond; creation and finalization may
    take seconds."""
    delay = 50e-6
    while True:
        status = handle.state()
        if status is None:
            raise NcclError(what, INVALID_USAGE, "the communicator was aborted while waiting")
        if status == SUCCESS:
            return
        if status != IN_PROGRESS:
            raise NcclError(what, status, handle.describe(status))
        if clock() > deadline:
            raise TimeoutError(f"{what} still in progress at its deadline")
        sleep(delay)
        delay = min(delay * 2, 2e-3)


def create(lib, world_size: int, unique_id: bytes, rank: int, deadline: float, identity: str,
           connect_timeout_s: float, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> CommHandle:
    """A formed communicator, or CommError (the half-formed one aborted)."""
    ptr, status = lib.init_rank_nonblocking(world_size, unique_id, rank)
    if ptr is None or status not in (SUCCESS, IN_PROGRESS):
        if ptr is not None:
            lib.abort(ptr)
        detail = lib.last_error(None) or lib.error_string(status)
        raise CommError(f"[{identity}] NCCL communicator creation failed ({RESULT_NAMES.get(status, status)}: "
                        f"{detail})")
    def failed(exc: NcclError) -> str:
        hint = ""
        if exc.status == INVALID_USAGE:
            hint = ("; if two ranks of the ring share a GPU, give each worker its own GPU (gpus_per_worker=1), or "
                    "see docs/gpu.md for the NCCL_HOSTID recipe the GPU tests use")
        return f"NCCL communicator creation failed: {exc}{hint}"

    return settle_or_abort(CommHandle(lib, ptr), "ncclCommInitRankConfig", deadline, identity,
                           f"NCCL communicator not formed within connect_timeout_s={connect_timeout_s}; "
                           "a peer did not join (the creation was aborted)", failed, clock, sleep)


def settle_or_abort(handle: CommHandle, what: str, deadline: float, identity: str, late: str,
                    failed: Callable[[NcclError], str], clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> CommHandle:
    """A new communicator, settled; else aborted (never destroyed) and CommError: ``late`` past ``deadline``,
    ``failed(error)`` on an error state."""
    try:
        settle(handle, what, deadline, clock, sleep)
    except TimeoutError:
        abort(handle, identity)
        raise CommError(f"[{identity}] {late}") from None
    except NcclError as exc:
        abort(handle, identity)
        raise CommError(f"[{identity}] {failed(exc)}") from exc
    return handle


def finalize_and_destroy(handle: CommHandle, deadline: float, identity: str,
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep) -> None:
    """Graceful close: ``ncclCommFinalize`` (flushes outstanding work), wait for it, then
    ``ncclCommDestroy``. Raises NcclError or TimeoutError, leaving the handle to the
    caller's :func:`abort`; destroys only after a completed finalize."""
    handle.call("ncclCommFinalize", handle.lib.finalize)
    settle(handle, "ncclCommFinalize", deadline, clock, sleep)
    ptr = handle.detach()
    if ptr is not None:
        status = handle.lib.destroy(ptr)  # after a finalize: frees local resources only
        if status != SUCCESS:
            _log.warning("[%s] ncclCommDestroy after finalize returned %s", identity, RESULT_NAMES.get(status, status))


def abort(handle: CommHandle, identity: str) -> bool:
    """``ncclCommAbort`` once (idempotent, any thread); True if this call aborted it."""
    ptr = handle.detach()
    if ptr is None:
        return False
    status = handle.lib.abort(ptr)
    if status != SUCCESS:
        _log.warning("[%s] ncclCommAbort returned %s", identity, RESULT_NAMES.get(status, status))
    return True
