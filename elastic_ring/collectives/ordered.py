"""One ordered queue per communicator: the ``_async`` collectives run on it, in call order, in the background.

An ``_async`` call puts its whole collective (argument checks, the cross-rank signature check, the data) on the
queue of the communicator it runs on (the ring's, or a process set's sub-ring) and returns at once; one thread
per queue runs them in the order they were called, so the ranks pair them by call order exactly as they pair
their synchronous calls. ``poll()`` is False until the collective ran and its data arrived.

The synchronous calls share the queue's order without going through it: the queue installs a hook that the
communicator runs before it issues any collective (``Communicator.before_issue``); on any other thread, it
waits there until the queue has run everything called before (:meth:`OrderedQueue.settle`), so a synchronous
call, ``join()``'s probes and a ``DistributedOptimizer``'s buckets come after the ``_async`` calls made before
them, on every rank. One thread is exempt: the step check's helper (:mod:`elastic_ring.reduction.verdict`),
whose bucket launches are pinned before the next check by the communicator's ``before_check`` hooks (a queued
collective's check waits for them). A communicator no ``_async`` call ever used has no queue and no hook: the
synchronous path is unchanged; one that has a queue pays a counter read per collective while the queue is idle.

Failures and deadlines are the collectives' own: each queued collective has its timeout, a failed or aborted
communicator (``runtime.abort_round``) makes the one in flight raise ``CommError`` within ``WAIT_SLICE_S`` and
every later one at once, and the error is delivered by ``synchronize()``. The thread ends after
:data:`IDLE_S` without work (a queue of a torn-down round ends with it).
"""

from __future__ import annotations

import collections
import contextvars
import threading
import weakref
from typing import Callable

from ..backends.base import Communicator
from ..core.errors import CommError
from ..core.log import get_logger
from ..ring import process_sets

_log = get_logger(__name__)

#: A queue's thread ends after this long without work (the next call starts another).
IDLE_S = 2.0
#: Threads whose collectives never wait for the queue: the step check's helper launches the gradient buckets a
#: queued collective's check waits for (``before_check``), so waiting there would deadlock.
EXEMPT_THREADS = frozenset({"elastic-ring-step-check"})

_lock = threading.Lock()
_queues: "weakref.WeakKeyDictionary[Communicator, OrderedQueue]" = weakref.WeakKeyDictionary()


class OrderedQueue:
    """The ``_async`` collectives of one communicator, run in call order on a thread of their own."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = weakref.ref(comm)
        self._cond = threading.Condition()
        self._items: collections.deque = collections.deque()
        #: called and not yet finished (read without the lock by settle(): one int read is atomic)
        self._outstanding = 0
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        comm.before_issue.append(self._before_issue)

    def submit(self, run: Callable[[Communicator], None]) -> None:
        """Queue ``run(comm)`` after everything called before; it runs in the caller's context (its
        ``contextvars``) with the communicator as the process-set scope."""
        context = contextvars.copy_context()
        with self._cond:
            self._outstanding += 1
            self._items.append((run, context))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="elastic-ring-async", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self) -> None:
        """Wait until everything queued so far has run (a collective another thread issues then comes after it
        on every rank). A no-op on the queue's own thread and while the queue is idle."""
        if self._outstanding == 0 or threading.get_ident() == self._thread_id:
            return
        with self._cond:
            while self._outstanding:
                self._cond.wait(1.0)  # each queued collective has its own deadline; this only sleeps

    def _before_issue(self) -> None:
        if self._outstanding and threading.current_thread().name not in EXEMPT_THREADS:
            self.settle()

    @property
    def idle(self) -> bool:
        return self._outstanding == 0

    def _loop(self) -> None:
        self._thread_id = threading.get_ident()
        while True:
            with self._cond:
                if not self._items and not self._cond.wait_for(lambda: self._items, IDLE_S):
                    self._thread = self._thread_id = None  # (under the lock: the next submit starts a new thread)
                    return
                run, context = self._items.popleft()
            try:
                comm = self._comm()
                if comm is None:
                    raise CommError("the ring this _async collective was called on is gone")
                if comm.spec.backend == "nccl" and comm.spec.cuda_device is not None:
                    import torch  # the current CUDA device is per thread

                    torch.cuda.set_device(comm.spec.cuda_device)
                with process_sets.scope_of(comm):
                    context.run(run, comm)
            except BaseException as exc:  # noqa: BLE001 - `run` stores its own errors; this is a last resort
                _log.error("an _async collective's runner failed: %s: %s", type(exc).__name__, exc)
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()


def queue_of(comm: Communicator) -> OrderedQueue:
    """The communicator's queue, made (and its hook installed) on first use."""
    with _lock:
        queue = _queues.get(comm)
        if queue is None:
            queue = _queues[comm] = OrderedQueue(comm)
        return queue


def existing(comm: Communicator) -> OrderedQueue | None:
    """The communicator's queue, if an ``_async`` call ever made one."""
    with _lock:
        return _queues.get(comm)


__all__ = ["IDLE_S", "OrderedQueue", "existing", "queue_of"]
