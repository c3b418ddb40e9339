"""One FIFO launcher thread per NCCL communicator (the ``thread`` bucket path; CUDA-free, tested on CPU).

The autograd thread must do nothing for a ready gradient bucket but enqueue it: a non-blocking NCCL
communicator answers every collective with ``ncclInProgress`` and starts a thread of its own for the launch,
which the caller then polls (``settle``: about 150 us per bucket on the H100 of 2026-11-22). A
:class:`Launcher` takes that off the caller: :meth:`Launcher.submit` puts a job on a ``SimpleQueue`` (no
Python frame, no lock on the caller's side) and one daemon thread runs the jobs **one at a time, in submission
order** (``run(job)``: one ``ncclAllReduce`` per bucket), so every rank makes the same NCCL calls in the same
order whatever the timing.

**Never batched.** The first version ran the jobs it found queued together in one ``ncclGroupStart/End``. Which
jobs are queued together depends on each rank's timing, and NCCL plans a group as a whole: it sorts the group's
collectives by size, picks the algorithm and protocol from their aggregated size and splits the channels by
the group's total traffic (``ncclPrepareTasks`` / ``scheduleCollTasksToPlan`` in NCCL's ``enqueue.cc``). Two ranks
that grouped the same buckets differently therefore moved them with different protocols or channels: the GPU
run of 2026-11-27 hung until the watchdog (``thread``), or failed with NCCL's "message truncated: receiving
524288 bytes instead of 65536" (a Simple protocol step met an LL one). A group is only safe when every rank
groups the same collectives, which timing never guarantees.

* :meth:`Launcher.drain` returns once every job submitted before it has run (a marker travels through the
  queue): the bucket path's step-end wait, and the communicator before any other collective, so that nothing
  the training thread launches can overtake a queued bucket on one rank and not on another.
* A job that raises stops the launcher from running later jobs (they are dropped: the communicator failed);
  ``on_error(exc)`` runs on the thread (the bucket path fails and aborts the communicator there), and
  :meth:`drain` and :meth:`submit` raise :class:`LauncherFailed` naming it on the caller's thread.
* :meth:`stop` ends the thread after what is queued (the communicator's close or abort); a job submitted after
  it raises. Every wait has a deadline.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from ...core.log import get_logger

_log = get_logger(__name__)

_STOP = object()


class LauncherFailed(RuntimeError):
    """A launch job raised on the launcher thread (the original exception is the ``__cause__``)."""


class Launcher:
    """Runs jobs one at a time in submission order on one thread. ``run(job)`` gets one submitted job (a tuple);
    ``setup()`` runs first on the thread (e.g. makes the CUDA device current)."""

    def __init__(self, name: str, run: Callable[[tuple], None],
                 on_error: Callable[[BaseException], None], setup: Callable[[], None] | None = None) -> None:
        self._run_job, self._on_error, self._setup = run, on_error, setup
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.error: BaseException | None = None
        # Two counters, each written by one side only (no update is lost when a drain on one thread meets a
        # submit on another): jobs submitted (callers), jobs the thread took off the queue (run or dropped).
        self._submitted = 0
        self._taken = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the caller's side
    @property
    def pending(self) -> int:
        """Jobs submitted and not yet run (0: a drain has nothing to wait for)."""
        return self._submitted - self._taken

    def submit(self, job: tuple) -> None:
        """Queue ``job`` after every earlier one; LauncherFailed if a job failed before, RuntimeError once stopped."""
        if self.error is not None:
            raise LauncherFailed(f"an earlier launch failed on the launcher thread: {self.error!r}") from self.error
        if self._stopped:
            raise RuntimeError("the bucket launcher was stopped (its communicator was closed or aborted)")
        self._submitted += 1
        self._queue.put(job)

    def drain(self, timeout_s: float) -> None:
        """Return once every job submitted so far has run; LauncherFailed if one raised, TimeoutError past
        ``timeout_s`` (a launch that does not return: the watchdog aborts the communicator meanwhile)."""
        if self.pending:
            marker = threading.Event()
            self._queue.put(marker)
            if not marker.wait(timeout_s):
                raise TimeoutError(f"the bucket launcher did not launch what was queued within {timeout_s:g} s")
        if self.error is not None:
            raise LauncherFailed(f"a launch failed on the launcher thread: {self.error!r}") from self.error

    def stop(self) -> None:
        """End the thread once what is queued ran (idempotent, any thread, never blocks)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end after :meth:`stop`; whether it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self._fail(exc)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):  # a drain: every job before it ran
                item.set()
                continue
            if self.error is None:
                try:
                    self._run_job(item)  # type: ignore[arg-type]
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                    self._fail(exc)
            self._taken += 1

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        try:
            self._on_error(exc)
        except Exception as handler_error:  # noqa: BLE001 - logged: the thread must go on answering drains
            _log.error("the bucket launcher's error handler failed: %r (after %r)", handler_error, exc)
