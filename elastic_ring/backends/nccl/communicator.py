"""The NCCL backend: CUDA tensors over a non-blocking NCCL communicator.

Contract, per round:

* Forming is a :class:`~elastic_ring.backends.formation.Formation`: every rank passes
  the round's arrival barrier, then exchanges the unique id, both on a helper
  thread that is abandoned when the round is aborted (``runtime.abort_round``).
  The creation's polling treats a cancellation as its deadline, and a
  cancellation during the warm-up collective aborts the communicator, so an
  aborted round stops forming within milliseconds at every stage.
* The round's rank 0 creates the NCCL unique id (128 raw bytes) and publishes
  it with ``store.set(prefix + "nccl/unique_id", bytes)``; the other ranks read
  it with ``store.get``. Nothing is pickled.
* The communicator is created *non-blocking* (:mod:`elastic_ring.backends.nccl.lib`):
  the handle exists at once and creation is polled until ``connect_timeout_s``;
  a creation that outlives it is *aborted*, never destroyed. Connections are
  made eagerly: ``NCCL_RUNTIME_CONNECT=0`` is set (unless the user set it)
  before the first communicator, and a one-element allreduce runs under the
  watchdog before the constructor returns, so a missing peer fails the
  formation (``connect_timeout_s``), not the first training collective.
* Collectives run on one persistent high-priority side stream per device (never
  destroyed, so ``record_stream`` on it is always safe). The side stream first
  waits for torch's current stream; torch's current stream later waits on an
  event recorded after the collective.
* The process's :mod:`watchdog <elastic_ring.backends.nccl.watchdog>` keeps every
  collective's deadline (``collective_timeout_s``) and watches NCCL's
  asynchronous errors. It aborts a hung or broken communicator, which makes
  every host call blocked on it return; ``Work.wait`` waits on the event (no
  polling on the calling thread) and then raises :class:`CommError` if the
  watchdog failed the communicator.
* ``close()`` (a healthy round ends) finalizes (``ncclCommFinalize``: flushes
  outstanding work) and then destroys; if that fails or outlives
  ``collective_timeout_s``, it aborts. ``abort()`` aborts. After an abort,
  ``torch.cuda.empty_cache()`` returns the memory the next communicator needs.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch

from ...core.errors import CommError
from ...core.log import get_logger
from ...core.ops import ReduceOp
from ...core.spec import RingSpec
from ...core.constants import NCCL_BUCKET_PATHS, NCCL_BUCKETS
from ..base import BucketPath, Communicator, Work
from ..formation import Formation
from . import handle as nccl_handle, lib as nccl_lib, reform as nccl_reform
from .bucket_path import NcclBucketPath, launch_job
from .codes import check_unique_id, reduce_dtype, reduce_op
from .process_env import check_nonblocking_allowed, set_eager_connect, shared_gpu_env  # noqa: F401 (re-exported)
from .handle import CommHandle, settle
from .launcher import Launcher
from .lib import NcclError, NcclUnavailable
from .watchdog import Watchdog, process_watchdog

_log = get_logger(__name__)

UNIQUE_ID_KEY = "nccl/unique_id"


def nccl_available() -> bool:
    """True when CUDA and an NCCL library (>= 2.25) can be used in this process."""
    if not torch.cuda.is_available():
        return False
    try:
        nccl_lib.load()
    except NcclUnavailable:
        return False
    return True


# ---------------------------------------------------------------- pure helpers
# ---------------------------------------------------------------- streams
_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's persistent collective stream of ``device`` (created once, never destroyed)."""
    with _streams_lock:
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device=device, priority=-1)
        return stream


# ---------------------------------------------------------------- work
class _NcclWork(Work):
    __slots__ = ("_comm", "_event")

    def __init__(self, comm: "NcclCommunicator", event: torch.cuda.Event) -> None:
        self._comm, self._event = comm, event

    def wait(self) -> None:
        self._comm.raise_if_failed()
        # Blocks (yielding the CPU) until the collective is done. The watchdog keeps the
        # deadline: it aborts a hung communicator, the NCCL kernel exits, and this returns.
        self._event.synchronize()
        self._comm.raise_if_failed()
        torch.cuda.current_stream(self._comm.device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._comm.errored or self._event.query()


# ---------------------------------------------------------------- communicator
class NcclCommunicator(Communicator):
    """Communicator of one round over NCCL. ``store`` offers ``set(key, bytes)`` / ``get(key)``."""

    _lent = False  # handed to the next round to shrink or grow (lend)
    _launcher: Launcher | None = None  # the FIFO bucket launcher of the "thread" bucket path (made at its first use)

    def __init__(self, spec: RingSpec, store, watchdog: Watchdog | None = None,
                 formation: Formation | None = None, parent: "NcclCommunicator | None" = None) -> None:
        super().__init__(spec)
        self._handle: CommHandle | None = None
        self._watchdog: Watchdog | None = None
        #: How this round's communicator was made: "init", "shrink" or "grow" (nccl_reform).
        self.formed_by = nccl_reform.INIT
        if not torch.cuda.is_available():
            raise RuntimeError(
                "backend='nccl' needs CUDA and NCCL: run on a GPU machine with elastic-ring[gpu] installed "
                "(nvidia-nccl-cu12 >= 2.25), or use backend='gloo'"
            )
        try:
            lib = nccl_lib.load()
        except NcclUnavailable as exc:
            raise RuntimeError(f"backend='nccl' needs CUDA and NCCL: {exc}") from exc
        self._lib = lib
        index = spec.cuda_device if spec.cuda_device is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"RingSpec.cuda_device={index} is not a CUDA device of this process (it sees {count}); "
                             "pick an index below torch.cuda.device_count()")
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        check_nonblocking_allowed()
        set_eager_connect()
        self._watchdog = watchdog or process_watchdog()
        self._stream = side_stream(self._device)
        formation = formation if formation is not None else Formation(spec, store)
        deadline = formation.deadline
        reads = formation.interruptible_store()  # waits for rank 0's id end when the round is aborted
        plan = self._publish_reform_token(store, parent)
        path, unique_id = formation.run(lambda seconds_left: self._agree(reads, plan, parent, seconds_left), None,
                                        "NCCL unique id exchange")
        if path == nccl_reform.INIT:
            self._handle = self._create(unique_id, deadline, formation)
        else:
            self._handle = self._derive(path, plan, parent, unique_id, deadline, formation)
            self.formed_by = path
        formation.on_cancel(lambda reason: self.watchdog_failed(formation.cancelled_error("during the warm-up")))
        try:
            self._warm_up(deadline, formation)
        except BaseException:
            self._abort_nccl()
            raise

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def identity(self) -> str:
        return self.spec.identity

    # ------------------------------------------------------------ forming
    def _reform_wanted(self) -> bool:
        spec = self.spec
        return spec.nccl_reform == "shrink_grow" and spec.parent_ranks is not None

    def _publish_reform_token(self, store, parent: "NcclCommunicator | None") -> nccl_reform.Plan | None:
        """Before the arrival barrier: publish whether this rank can shrink or grow (nccl_reform)."""
        if not self._reform_wanted():
            return None
        spec = self.spec
        if parent is not None and parent.spec.round_id != spec.parent_round:
            parent = None
        usable = parent is not None and parent.usable_as_parent() and not nccl_reform.shares_resources(os.environ)
        return nccl_reform.publish_token(store, spec, parent.spec.world_size if parent is not None else None,
                                         parent.spec.rank if parent is not None else None, usable, self._lib.has)

    def _agree(self, store, plan: nccl_reform.Plan | None, parent: "NcclCommunicator | None",
               seconds_left: float) -> tuple[str, bytes | None]:
        """After the barrier: the path every rank takes, and the id it needs (a full init's or a grow's)."""
        spec = self.spec
        if self._reform_wanted():
            def grow_id() -> bytes:
                handle = parent.reform_handle() if parent is not None else None
                if handle is None:
                    raise CommError(f"[{spec.identity}] the communicator of round {spec.parent_round} to grow "
                                    "was aborted meanwhile")
                return nccl_reform.grow_id(handle, spec.identity)

            path, unique_id = nccl_reform.agree(store, spec, plan, grow_id, seconds_left)
            if path != nccl_reform.INIT:
                return path, (None if unique_id is None else check_unique_id(unique_id, spec.identity))
        return nccl_reform.INIT, self._exchange_unique_id(store, seconds_left)

    def _derive(self, path: str, plan: nccl_reform.Plan, parent: "NcclCommunicator | None", unique_id: bytes | None,
                deadline: float, formation: Formation) -> CommHandle:
        """This round's communicator by shrink or grow of ``parent``'s (the newcomer of a grow has none)."""
        spec = self.spec

        def clock() -> float:  # a cancelled formation is past its deadline: the new communicator is aborted
            return float("inf") if formation.cancelled else time.monotonic()

        who = f"{spec.identity} on {self._device}"
        member = spec.parent_ranks[spec.rank] >= 0  # type: ignore[index]
        handle = parent.reform_handle() if parent is not None else None
        if member and handle is None:
            raise CommError(f"[{who}] cannot {path} round {spec.parent_round}: its communicator was aborted "
                            "meanwhile; the next round forms by a full init")
        try:
            with torch.cuda.device(self._device):
                if path == nccl_reform.SHRINK:
                    return nccl_reform.shrink(handle, plan.exclude, deadline, who,  # type: ignore[arg-type]
                                              spec.connect_timeout_s, clock=clock)
                return nccl_reform.grow(self._lib, handle, spec.world_size, unique_id, spec.rank, deadline, who,
                                        spec.connect_timeout_s, clock=clock)
        except CommError as exc:
            if formation.cancelled:
                raise formation.cancelled_error(f"the NCCL {path} was aborted") from exc
            raise

    def lend(self) -> None:
        """The runtime hands this communicator to the next round (a shrink or grow may derive from it): from
        now on a failure recorded on it (``fail``, ``abort_round``, the watchdog) no longer aborts it under the
        derivation; :meth:`release` does, once the next round formed or gave up."""
        with self._lock:
            self._lent = True
        if self._watchdog is not None:
            self._watchdog.forget(self)

    def usable_as_parent(self) -> bool:
        """Healthy, alive and idle: every collective it launched has completed (nothing for a shrink to
        abort), and nothing failed."""
        if self._error is not None or self.reform_handle() is None:
            return False
        try:
            with torch.cuda.device(self._device):
                return bool(self._stream.query())
        except RuntimeError:  # a CUDA error: not a communicator to derive from
            return False

    def reform_handle(self) -> CommHandle | None:
        """The live handle a next round may shrink or grow (None once aborted)."""
        handle = self._handle
        return handle if handle is not None and handle.alive else None

    def _exchange_unique_id(self, store, seconds_left: float | None = None) -> bytes:
        key = self.spec.store_prefix + UNIQUE_ID_KEY
        if self.spec.rank == 0:
            unique_id = self._lib.unique_id()
            store.set(key, unique_id)
            return unique_id
        try:
            if seconds_left is not None:
                store.wait([key], datetime.timedelta(seconds=seconds_left))
            value = store.get(key)
        except RuntimeError as exc:  # torch's store raises DistStoreError (a RuntimeError) on its timeout
            raise CommError(
                f"[{self.spec.identity}] rank 0 did not publish the NCCL unique id within "
                f"connect_timeout_s={self.spec.connect_timeout_s}: {exc}"
            ) from exc
        return check_unique_id(value, self.spec.identity)

    def _create(self, unique_id: bytes, deadline: float, formation: Formation) -> CommHandle:
        spec = self.spec

        def clock() -> float:  # a cancelled formation is past its deadline: the creation is aborted at once
            return float("inf") if formation.cancelled else time.monotonic()

        try:
            with torch.cuda.device(self._device):
                return nccl_handle.create(self._lib, spec.world_size, unique_id, spec.rank, deadline,
                                          f"{spec.identity} on {self._device}", spec.connect_timeout_s, clock=clock)
        except CommError as exc:
            if formation.cancelled:
                raise formation.cancelled_error("the NCCL communicator's creation was aborted") from exc
            raise

    def _warm_up(self, deadline: float, formation: Formation) -> None:
        """One tiny allreduce under the watchdog: every peer connected, or CommError."""
        timeout_s = max(deadline - time.monotonic(), 1.0)
        probe = torch.zeros(1, dtype=torch.int32, device=self._device)
        try:
            self._guarded(self._allreduce, probe, ReduceOp.SUM, timeout_s).wait()
        except CommError as exc:
            if formation.cancelled:
                raise formation.cancelled_error("the NCCL warm-up collective was aborted") from exc
            raise CommError(f"[{self.spec.identity}] the NCCL ring did not connect within connect_timeout_s="
                            f"{self.spec.connect_timeout_s}: {exc}") from exc

    # ------------------------------------------------------------ watchdog target
    def async_error(self) -> str | None:
        handle = self._handle
        status = handle.state() if handle is not None else None
        if status is None or status in (nccl_lib.SUCCESS, nccl_lib.IN_PROGRESS):
            return None
        return handle.describe(status)

    def watchdog_failed(self, error: CommError) -> None:
        if self._error is None:
            self._error = error
        if not self._lent:  # a lent communicator is aborted by release(), after the derivation
            self._abort_nccl()

    def raise_if_failed(self) -> None:
        """Raise a CommError naming the first failure (e.g. the watchdog's) if there was one."""
        error = self._error
        if error is not None:
            raise CommError(str(error) if isinstance(error, CommError) else
                            f"[{self.spec.identity}] the communicator failed: {error!r}")

    # ------------------------------------------------------------ collectives
    def _check_cuda(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self._device:
                raise ValueError(
                    f"the NCCL backend of this rank moves tensors on {self._device}, got one on {t.device}; "
                    "move it to the rank's device (torch.cuda.current_device())"
                )
            if not t.is_contiguous():
                raise ValueError("NCCL collectives need contiguous tensors")

    # ------------------------------------------------------------ gradient buckets
    def bucket_path(self, mode: str | None = None) -> BucketPath:
        """``collective`` (the default of ``ELASTIC_RING_NCCL_BUCKETS``: :meth:`allreduce` per bucket), ``inline``
        or ``thread`` (:mod:`elastic_ring.backends.nccl.bucket_path`)."""
        mode = NCCL_BUCKETS if mode is None else mode
        if mode not in NCCL_BUCKET_PATHS:
            raise ValueError(f"NCCL bucket path {mode!r} is not one of {', '.join(NCCL_BUCKET_PATHS)} "
                             "(ELASTIC_RING_NCCL_BUCKETS)")
        return BucketPath(self) if mode == "collective" else NcclBucketPath(self, mode)

    def bucket_launcher(self) -> Launcher:
        """This communicator's launcher thread (the ``thread`` bucket path), started at the first call."""
        self.check_usable()
        with self._lock:
            if self._launcher is None:
                device = self._device
                self._launcher = Launcher(f"elastic-ring-nccl-launcher-{self.spec.identity}",
                                          run=lambda job: launch_job(self, job),
                                          on_error=self.fail, setup=lambda: torch.cuda.set_device(device))
            return self._launcher

    def drain_launcher(self, timeout_s: float) -> None:
        """The one ordering point of every launch on this communicator: before the calling thread launches
        anything itself (another collective, an ``inline`` bucket), the buckets the launcher thread still holds go
        out, so that they precede it on every rank. LauncherFailed if one of them failed, TimeoutError past
        ``timeout_s``."""
        launcher = self._launcher
        if launcher is not None and launcher.pending:
            launcher.drain(timeout_s)

    def _stop_launcher(self) -> None:
        launcher = self._launcher
        if launcher is not None:
            launcher.stop()

    def _launch(self, op: str, tensors: tuple[torch.Tensor, ...], call, args: tuple, timeout_s: float) -> Work:
        handle = self._handle
        if handle is None:
            raise CommError(f"[{self.spec.identity}] the NCCL communicator is not formed")
        self.drain_launcher(timeout_s)  # queued buckets go first, on every rank
        stream = self._stream
        with torch.cuda.device(self._device):
            stream.wait_stream(torch.cuda.current_stream(self._device))
            if call is not None:
                try:
                    status = handle.call(op, call, *args, stream.cuda_stream)
                    if status == nccl_lib.IN_PROGRESS:
                        # Non-blocking: NCCL enqueues the kernel from its own thread. The event below
                        # must come after the kernel on the stream, so wait for the enqueue first.
                        settle(handle, op, time.monotonic() + timeout_s)
                except TimeoutError:
                    raise CommError(f"[{self.spec.identity}] NCCL {op} was not launched within "
                                    f"collective_timeout_s={timeout_s:g}") from None
                except NcclError:
                    self.raise_if_failed()  # the watchdog aborted it meanwhile: report its reason
                    raise
            for t in tensors:
                t.record_stream(stream)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        self._watchdog.watch(self, op, event.query, timeout_s)
        return _NcclWork(self, event)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, timeout_s: float) -> Work:
        self._check_cuda(tensor)
        dtype, nccl_op = reduce_dtype(tensor.dtype), reduce_op(op)
        call = self._lib.all_reduce if tensor.numel() else None
        return self._launch("allreduce", (tensor,), call, (tensor.data_ptr(), tensor.numel(), dtype, nccl_op),
                            timeout_s)

    # Broadcast and allgather copy bytes: any dtype (bool, complex, float8) moves as uint8.
    def _broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Work:
        self._check_cuda(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        call = self._lib.broadcast if nbytes else None
        return self._launch("broadcast", (tensor,), call, (tensor.data_ptr(), nbytes, nccl_lib.UINT8, root),
                            timeout_s)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> Work:
        self._check_cuda(output, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if output.numel() * output.element_size() != nbytes * self.size or output.dtype != tensor.dtype:
            raise ValueError(f"allgather output must be of shape ({self.size}, *{tuple(tensor.shape)}) and dtype "
                             f"{tensor.dtype}, got {tuple(output.shape)} {output.dtype}")
        call = self._lib.all_gather if nbytes else None
        return self._launch("allgather", (output, tensor), call,
                            (tensor.data_ptr(), output.data_ptr(), nbytes, nccl_lib.UINT8), timeout_s)

    def _barrier(self, timeout_s: float) -> Work:
        return self._allreduce(torch.zeros(1, dtype=torch.int32, device=self._device), ReduceOp.SUM, timeout_s)

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """End a healthy round: finalize (flush), then destroy; abort if that fails or outlives
        ``collective_timeout_s``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        launcher = self._launcher
        if launcher is not None:  # what it still has queued goes out before the finalize flushes
            launcher.stop()
            launcher.join(min(5.0, self.spec.collective_timeout_s))
        if self._error is not None:
            self._abort_nccl()
            return
        try:
            self._finalize(time.monotonic() + self.spec.collective_timeout_s)
        except (RuntimeError, TimeoutError) as exc:  # NcclError, a CUDA error, or the deadline
            _log.warning("[%s] graceful NCCL close failed (%s); aborting instead", self.spec.identity, exc)
            self._abort_nccl()

    def _finalize(self, deadline: float) -> None:
        handle = self._handle
        if handle is None:
            return
        with torch.cuda.device(self._device):
            nccl_handle.finalize_and_destroy(handle, deadline, self.spec.identity)
        if self._watchdog is not None:
            self._watchdog.forget(self)

    def _abort(self) -> None:
        if not self._lent:  # a lent communicator is aborted by release(), after the derivation
            self._abort_nccl()

    def release(self) -> None:
        """After a shrink or grow (or an attempt), free the parent's handle: it is aborted, not finalized,
        since a shrink's parent has ranks that are gone. Idempotent; nothing to do once aborted or closed."""
        with self._lock:
            self._closed = True
            self._lent = False
        if self.reform_handle() is not None:
            self._abort_nccl()

    def _abort_nccl(self) -> None:
        """Abort (idempotent, from any thread): never ``ncclCommDestroy`` on a live ring."""
        handle = self._handle
        if handle is not None:
            self._abort_handle(handle)

    def _abort_handle(self, handle: CommHandle) -> None:
        self._stop_launcher()
        if self._watchdog is not None:
            self._watchdog.forget(self)
        with torch.cuda.device(self._device):
            aborted = nccl_handle.abort(handle, self.spec.identity)
        if aborted:
            torch.cuda.empty_cache()  # the next communicator's buffers need the memory torch's cache may hold
