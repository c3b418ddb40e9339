"""The NCCL backend's lean lanes for DistributedOptimizer's gradient buckets (``ELASTIC_RING_NCCL_BUCKETS``).

The default, ``collective``, sends each bucket as one checked collective (:meth:`Communicator.allreduce`): a
device context, ``wait_stream`` (a new event), ``record_stream``, a new blocking event and a watchdog entry with
its lock per bucket, then a host wait on every bucket's event in ``synchronize()``. The two paths here share:

* **pooled events**: per launch of a step, a *ready* event (recorded on the caller's current stream once the
  bucket is complete) and a *done* event (recorded on the side stream after its collective), made once and
  reused every step; the side stream waits with ``wait_event`` on the ready one;
* **one watchdog entry per step** (:class:`~elastic_ring.backends.nccl.watchdog.OrderedWatch`): buckets run in
  order on one stream, so the last launched one is the one to watch, with the same deadline and the same abort;
* **the step's trailer** is written from a persistent pinned buffer and read back through another one: its
  device-to-host copy is queued on the side stream right after the last bucket's collective, so reading it
  after the wait needs no second synchronization;
* **one host wait per step**: :meth:`NcclBucketPath.wait` sleeps on the last bucket's done event only (a
  blocking-sync event; the watchdog's abort ends it), then torch's current stream waits on that event.

``inline`` launches on the caller's thread (the autograd thread): ``ncclAllReduce`` on the non-blocking
communicator, then ``settle`` until NCCL's own launch thread enqueued the kernel. ``thread`` leaves the caller
only the ready event and a ``SimpleQueue.put``: the communicator's :class:`~elastic_ring.backends.nccl.launcher.Launcher`
thread launches the buckets one at a time, in order. Both make exactly one ``ncclAllReduce`` per bucket, in the
order the reducer launches them (bucket index order, the same on every rank whatever order autograd produced the
gradients in), and never group buckets: NCCL plans a group as a whole (protocol, channels), so a group is safe
only when every rank groups the same buckets, and which buckets are ready together depends on each rank's timing
(the GPU run of 2026-11-27; :mod:`~elastic_ring.backends.nccl.launcher`). Every launch on a communicator goes
through one ordering point (:meth:`NcclCommunicator.drain_launcher`): before anything is launched on the
caller's thread (another collective, an ``inline`` bucket), the buckets the launcher holds go out first.

A failure (an NCCL error, a launch past ``collective_timeout_s``) fails and aborts the communicator: the
caller's next launch or the step's wait raises :class:`~elastic_ring.core.errors.CommError` naming it.
"""

from __future__ import annotations

import time

import torch

from ...core.errors import CommError
from ..base import BucketPath, Communicator, Work
from . import lib as nccl_lib
from .codes import reduce_dtype
from .handle import settle
from .launcher import LauncherFailed
from .lib import NcclError
from .watchdog import OrderedWatch


#: The paths this module implements (``collective`` is the base class's).
MODES = ("inline", "thread")


class _BucketWork(Work):
    """A bucket launched on a path; :meth:`NcclBucketPath.wait` waits for a step's buckets at once."""

    __slots__ = ("_path", "_event")

    def wait(self) -> None:
        self._path.wait([self])

    def is_completed(self) -> bool:
        if self._path.comm.errored:
            return True
        launcher = self._path._launcher  # a queued bucket's pooled event still holds an earlier step's record
        return not (launcher is not None and launcher.pending) and self._event.query()


class NcclBucketPath(BucketPath):
    """``inline`` or ``thread`` (see the module's docstring) for one communicator."""

    def __init__(self, comm: Communicator, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"NCCL bucket path {mode!r} is not one of {MODES}")
        super().__init__(comm)
        self.mode = mode
        self._device = comm.device
        self._stream = comm._stream
        self._timeout_s = float(comm.spec.collective_timeout_s)
        self._ready: list[torch.cuda.Event] = []
        self._done: list[torch.cuda.Event] = []
        self._count = 0  # launches since the last wait
        self.watch = OrderedWatch(comm._watchdog, comm, "gradient bucket allreduce", self._timeout_s)
        self._trailer_in: torch.Tensor | None = None
        self._trailer_out: torch.Tensor | None = None
        self._readback: torch.Tensor | None = None  # the trailer to copy back after the next launch
        self._read_ready = False
        self._launcher = comm.bucket_launcher() if mode == "thread" else None

    # ------------------------------------------------------------ the caller's side
    def launch(self, tensor: torch.Tensor) -> Work:
        comm = self.comm
        if comm._error is not None or comm._closed:
            comm.check_usable()
        if comm.before_issue:  # an _async queue: what was called before this bucket goes out first
            comm.run_before_issue()
        i = self._count
        if i == len(self._done):
            self._ready.append(torch.cuda.Event())
            self._done.append(torch.cuda.Event(blocking=True))
        self._count = i + 1
        ready, done = self._ready[i], self._done[i]
        ready.record(torch.cuda.current_stream(self._device))
        readback, self._readback = self._readback, None
        work = _BucketWork.__new__(_BucketWork)
        work._path, work._event = self, done
        job = (self, tensor, ready, done, readback)
        try:
            if self._launcher is None:
                comm.drain_launcher(self._timeout_s)  # another path's queued buckets go first (one ordering point)
                launch_job(comm, job)
            else:
                self._launcher.submit(job)
        except (NcclError, TimeoutError, LauncherFailed, RuntimeError) as exc:
            raise comm.fail(exc) from exc
        return work

    def wait(self, works: list[Work]) -> None:
        comm = self.comm
        try:
            if self._launcher is not None and self._launcher.pending:
                self._launcher.drain(self._timeout_s)
            for work in works:  # a bucket that went out another way (op Min / Max: a checked collective)
                if type(work) is not _BucketWork:
                    work.wait()
        except (LauncherFailed, TimeoutError) as exc:
            raise comm.fail(exc) from exc
        count, self._count = self._count, 0
        comm.raise_if_failed()
        if count:
            last = self._done[count - 1]
            last.synchronize()  # the one host wait of the step: buckets complete in order on one stream
            comm.raise_if_failed()  # the watchdog aborted it meanwhile: its reason
            torch.cuda.current_stream(self._device).wait_event(last)

    def fill_trailer(self, trailer: torch.Tensor, values: list[float]) -> None:
        host = self._trailer_in
        if host is None or host.dtype != trailer.dtype or host.numel() != trailer.numel():
            host = self._trailer_in = pinned(trailer.numel(), trailer.dtype)
            self._trailer_out = pinned(trailer.numel(), trailer.dtype)
        host.copy_(torch.tensor(values, dtype=trailer.dtype))  # the last step's copy from it ran: its wait came after
        trailer.copy_(host, non_blocking=True)  # on the current stream, before the last bucket's ready event
        self._readback = trailer

    def read_trailer(self, trailer: torch.Tensor) -> list[float]:
        if self._read_ready:  # copied back on the side stream after the last bucket, which wait() waited for
            self._read_ready = False
            return self._trailer_out.tolist()  # type: ignore[union-attr]
        return trailer.tolist()


def pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer (the trailer's way to the device and back without a host wait)."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def launch_job(comm: Communicator, job: tuple) -> None:
    """Launch one bucket ``job`` (``(path, tensor, ready, done, readback)``) on ``comm``'s side stream: wait for its
    ready event, one ``ncclAllReduce`` (never inside a group: see the module's docstring), settle, the trailer's
    copy back if it carries one, its done event; the path's watchdog entry moves to it. On the caller's thread
    (inline) or the launcher's (thread)."""
    handle = comm._handle
    if handle is None:
        raise CommError(f"[{comm.spec.identity}] the NCCL communicator is not formed")
    path, tensor, ready, done, readback = job
    stream = comm._stream
    stream.wait_event(ready)
    tensor.record_stream(stream)  # every launch: an address seen before may be another buffer by now
    status = handle.call("allreduce", handle.lib.all_reduce, tensor.data_ptr(), tensor.numel(),
                         reduce_dtype(tensor.dtype), nccl_lib.SUM, stream.cuda_stream)
    if status == nccl_lib.IN_PROGRESS:  # NCCL enqueues the kernel from its own thread: the events come after
        settle(handle, "allreduce", time.monotonic() + path._timeout_s)
    if readback is not None:
        with torch.cuda.stream(stream):
            path._trailer_out.copy_(readback, non_blocking=True)
        path._read_ready = True
    done.record(stream)
    path.watch.launched(done.query)
