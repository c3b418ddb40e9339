"""The communicator contract that every backend implements.

A communicator serves exactly one round of the ring (one :class:`RingSpec`).
Its life is: *configure* (the constructor forms the group on the round's
prefixed store keys, or raises :class:`CommError`), *use* (asynchronous
collectives that return a :class:`Work`), then either *close* (the round ended
normally) or *abort* (it failed or was abandoned; never blocks on a dead peer).

Any failure of a collective marks the communicator ``errored``, aborts it so
that peers blocked on it fail fast instead of waiting for their timeout, and
raises :class:`CommError`. Every later call on an errored communicator raises
:class:`CommError` at once: the only way forward is a new round.

A round can also be given up from outside: :meth:`Communicator.fail` may be
called from any thread (``runtime.abort_round`` does, when the driver declares a
member of the round lost). A collective blocked in ``Work.wait`` on another
thread then raises :class:`CommError` naming that first cause, without waiting
for the lost peer or its timeout (gloo: within ``WAIT_SLICE_S``; NCCL: the
abort ends the kernel). Configuring is interruptible too (see
:mod:`elastic_ring.backends.formation`).

Backends only move bytes: SUM/MIN/MAX allreduce, broadcast, same-size allgather
and barrier on contiguous tensors. Averaging, fusion, compression and
cross-rank checks live in :mod:`elastic_ring.collectives.tensors`.
"""

from __future__ import annotations

import abc
import threading

import torch

from ..core import timeline
from ..core.errors import CommError
from ..core.ops import ReduceOp
from ..core.spec import RingSpec


#: What a backend raises when a collective fails: torch/gloo raise RuntimeError
#: (or DistStoreError, a RuntimeError), sockets OSError, our watchdogs CommError.
_BACKEND_FAILURES = (RuntimeError, OSError, CommError)


class Work(abc.ABC):
    """A collective in flight."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the collective is done; raise :class:`CommError` if it failed."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Whether the collective finished (or failed): :meth:`wait` will not block."""


class Communicator(abc.ABC):
    """One round's communicator. Subclasses implement the ``_``-prefixed methods."""

    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._payloads = 0
        #: ``WeakMethod``s called before every checked collective (signature.PendingCheck): a DistributedOptimizer
        #: whose ready buckets wait for a step check's answer on the helper thread launches them first, so that a
        #: collective the loop calls between backward() and step() comes after them on every rank.
        self.before_check: list = []
        #: Callables run before every collective is issued, on the issuing thread: the ``_async`` queue's
        #: (:mod:`elastic_ring.collectives.ordered`) makes a collective of another thread wait until the queue
        #: ran what was called before it, so that every rank issues its collectives in the same order.
        self.before_issue: list = []

    # ------------------------------------------------------------ properties
    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device of the tensors this communicator moves."""

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def size(self) -> int:
        return self.spec.world_size

    # ------------------------------------------------------------ collectives
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp, timeout_s: float | None = None) -> Work:
        """In-place SUM, MIN, MAX or PRODUCT of a contiguous tensor over all ranks."""
        if op is ReduceOp.AVERAGE:
            raise ValueError("backends reduce with SUM, MIN or MAX; averaging is done by elastic_ring.collectives.tensors")
        return self._guarded(self._allreduce, tensor, op, self._timeout(timeout_s))

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> Work:
        """In-place broadcast of a contiguous tensor from ``root``."""
        if not 0 <= root < self.size:
            raise ValueError(f"root_rank={root} is not a rank of this ring (world size {self.size})")
        return self._guarded(self._broadcast, tensor, root, self._timeout(timeout_s))

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float | None = None) -> Work:
        """Gather equal-sized ``tensor`` of every rank into ``output`` of shape ``(size, *tensor.shape)``."""
        return self._guarded(self._allgather, output, tensor, self._timeout(timeout_s))

    def barrier(self, timeout_s: float | None = None) -> None:
        self._guarded(self._barrier, self._timeout(timeout_s)).wait()

    def bucket_path(self, mode: str | None = None) -> "BucketPath":
        """Where a DistributedOptimizer's gradient buckets go on this ring (:class:`BucketPath`). ``mode`` names a
        backend's optional path (NCCL: ``constants.NCCL_BUCKET_PATHS``); the default is :meth:`allreduce`."""
        return BucketPath(self)

    # ------------------------------------------------------------ lifecycle
    def abort(self) -> None:
        """Tear down without waiting for peers; safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._abort()

    def close(self) -> None:
        """End a healthy round. Backends whose teardown can block abort instead."""
        self.abort()

    def release(self) -> None:
        """Free a communicator a later round was derived from (NCCL shrink or grow keeps the parent alive
        until the child formed). Called once it is never used again; idempotent."""

    def fail(self, cause: BaseException) -> CommError:
        """Record ``cause``, abort, and return the CommError to raise. Thread-safe: when the
        communicator already failed (e.g. ``runtime.abort_round`` from another thread failed it,
        which is what ended a collective blocked on it), the error names that first cause."""
        with self._lock:
            first = self._error
            if first is None:
                self._error = cause
        self.abort()
        if first is not None and first is not cause:
            if isinstance(first, CommError):  # it names the rank, the round and the cause already
                return CommError(str(first))
            return CommError(f"[{self.spec.identity}] collective failed: {_first_line(first)}")
        if isinstance(cause, CommError):
            return cause
        return CommError(f"[{self.spec.identity}] collective failed: {_first_line(cause)}")

    def payload_name(self, kind: str) -> str:
        """A name for the next object-collective payload, unique in the job: round and a per-round
        sequence number (every rank makes the same object collectives in the same order, which the
        signature check enforces, so the numbers agree). Payload MACs bind to it, so a genuine payload
        cannot be replayed into another collective or round."""
        self._payloads += 1
        return f"{self.spec.store_prefix}{kind}#{self._payloads}"

    @property
    def auth_key(self) -> bytes:
        key = self.spec.auth_key
        if key is None:
            raise CommError(f"[{self.spec.identity}] this ring has no auth_key; form it with elastic_ring.init(spec)")
        return key

    def check_usable(self) -> None:
        if self._error is not None:
            raise CommError(
                f"[{self.spec.identity}] the communicator failed earlier ({_first_line(self._error)}); "
                "form a new round with elastic_ring.init(spec)"
            )
        if self._closed:
            raise CommError(f"[{self.spec.identity}] the communicator was closed; form a new round first")

    # ------------------------------------------------------------ internals
    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return float(self.spec.collective_timeout_s)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        return float(timeout_s)

    def run_before_issue(self) -> None:
        """Run the ``before_issue`` hooks (on the issuing thread, before a collective goes out); every path that
        issues a collective, the bucket lanes included, calls it."""
        for hook in self.before_issue:
            hook()

    def _guarded(self, fn, *args) -> Work:
        self.check_usable()
        self.run_before_issue()
        name = fn.__name__.lstrip("_")
        event = timeline.begin_async(name, "collective", bytes=_bytes_of(args)) if timeline.is_enabled() else None
        try:
            work = fn(*args)
        except _BACKEND_FAILURES as exc:
            timeline.end_async(event, name, "collective", failed=True)
            raise self.fail(exc) from exc
        return _GuardedWork(self, work, event, name)

    @abc.abstractmethod
    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, timeout_s: float) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Work: ...

    @abc.abstractmethod
    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> Work: ...

    @abc.abstractmethod
    def _barrier(self, timeout_s: float) -> Work: ...

    @abc.abstractmethod
    def _abort(self) -> None: ...


class BucketPath:
    """A ring's lane for a DistributedOptimizer's gradient buckets: in-place SUM allreduces launched in order, all
    waited for at the step's end, and the step's trailer (:mod:`elastic_ring.reduction.step_trailer`) written
    before the last one and read after it. This default goes through :meth:`Communicator.allreduce`; a backend
    may return a leaner one from :meth:`Communicator.bucket_path` (the same failures: ``CommError``, the
    communicator failed and aborted)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._host: torch.Tensor | None = None

    def launch(self, tensor: torch.Tensor) -> Work:
        return self.comm.allreduce(tensor, ReduceOp.SUM)

    def wait(self, works: list[Work]) -> None:
        """Wait for every bucket of the step (in launch order)."""
        for work in works:
            work.wait()

    def fill_trailer(self, trailer: torch.Tensor, values: list[float]) -> None:
        """Write this rank's trailer ``values`` into ``trailer`` (ordered before the last bucket's launch)."""
        host = torch.tensor(values, dtype=trailer.dtype)
        if trailer.device.type == "cuda":  # no host wait: from pinned memory, ordered before the bucket's launch
            host = host.pin_memory()
            trailer.copy_(host, non_blocking=True)
            self._host = host  # alive until the copy ran (the step's end waits on the device anyway)
        else:
            trailer.copy_(host)

    def read_trailer(self, trailer: torch.Tensor) -> list[float]:
        """The reduced trailer, after :meth:`wait`."""
        return trailer.tolist()


class _GuardedWork(Work):
    """Turns a backend failure during ``wait`` into CommError and an abort."""

    __slots__ = ("_comm", "_work", "_event", "_name")

    def __init__(self, comm: Communicator, work: Work, event: int | None = None, name: str = "") -> None:
        self._comm = comm
        self._work = work
        self._event, self._name = event, name  # timeline async event, ended by the first wait

    def wait(self) -> None:
        if self._comm.errored or self._comm.closed:
            self._end(failed=True)
            self._comm.check_usable()
        try:
            self._work.wait()
        except _BACKEND_FAILURES as exc:
            self._end(failed=True)
            raise self._comm.fail(exc) from exc
        self._end(failed=False)

    def is_completed(self) -> bool:
        return self._comm.errored or self._comm.closed or self._work.is_completed()

    def _end(self, failed: bool) -> None:
        if self._event is not None:
            timeline.end_async(self._event, self._name, "collective", failed=failed)
            self._event = None


def _bytes_of(args: tuple) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
