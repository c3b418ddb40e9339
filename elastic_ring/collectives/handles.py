"""Horovod's ``_async`` collectives: a handle now, the result from :func:`synchronize`.

Each ``*_async`` call returns at once. Its whole collective (argument checks, the cross-rank signature check, the
data) runs on its communicator's ordered queue (:mod:`elastic_ring.collectives.ordered`), in call order, so
the ranks pair their ``_async`` calls by call order, as they pair their synchronous calls, and a synchronous
call comes after every ``_async`` one called before it. :func:`poll` is False while the collective waits on
the queue or its data is in flight; :func:`synchronize` waits and returns the output, or raises the error the
collective met, at that point, as Horovod does. The allreduces run on buffers of their own (never the ring's
pooled ones). A re-form fails what is in flight: its ``synchronize`` raises ``CommError``.

A handle can also be *parked*: made without running anything, run later by whoever resolves it (the pairing of
named operations by name, :mod:`elastic_ring.collectives.negotiation`, which ``ray_integration.horovod`` uses).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import torch

from ..backends.base import Communicator
from ..ring import process_sets
from . import ordered
from . import tensors as collectives

_ids = itertools.count(1)

#: How often a thread waiting in synchronize() for a queued collective wakes (each collective has its own
#: deadline; the slices only keep the wait interruptible).
_WAIT_SLICE_S = 0.5


class Handle:
    """The outcome of one ``_async`` call (an output or an exception), taken once by :func:`synchronize`.
    ``start()`` returns the output, or a :class:`~elastic_ring.collectives.tensors.Pending` collective in
    flight. ``Handle(start)`` runs it now; :meth:`queued` runs it on the communicator's ordered queue;
    :meth:`parked` leaves it for ``resolve(handle)`` to run."""

    __slots__ = ("id", "_output", "_error", "_taken", "_pending", "_ran", "_resolve", "__weakref__")

    def __init__(self, start: Callable[[], Any] | None = None) -> None:
        self.id = next(_ids)
        self._output: Any = None
        self._error: BaseException | None = None
        self._taken = False
        self._pending: collectives.Pending | None = None
        self._ran = threading.Event()  # set once start() ran (its data may still be in flight)
        self._resolve: Callable[[Handle], None] | None = None  # parked: what runs it
        if start is not None:
            self.run(start)

    @classmethod
    def queued(cls, comm: Communicator, start: Callable[[], Any]) -> "Handle":
        """A handle whose ``start`` runs on ``comm``'s ordered queue, after everything called before it."""
        handle = cls()
        ordered.queue_of(comm).submit(lambda _comm: handle.run(start))
        return handle

    @classmethod
    def parked(cls, resolve: Callable[["Handle"], None]) -> "Handle":
        """A handle that runs nothing until ``resolve(handle)`` (called by :func:`synchronize`) runs it."""
        handle = cls()
        handle._resolve = resolve
        return handle

    def run(self, start: Callable[[], Any]) -> None:
        """Run ``start`` and keep its output, its collective in flight or its error; once."""
        try:
            out = start()
        except Exception as exc:  # noqa: BLE001 - delivered by synchronize(), as Horovod's handles do
            self._error = exc
        else:
            if isinstance(out, collectives.Pending):
                self._pending = out
            else:
                self._output = out
        finally:
            self._resolve = None
            self._ran.set()

    def fail(self, error: BaseException) -> None:
        """A parked handle that will never run: ``synchronize`` raises ``error``."""
        if not self._ran.is_set():
            self._error = error
            self._resolve = None
            self._ran.set()

    @property
    def started(self) -> bool:
        """Its collective ran (or failed); its data may still be in flight."""
        return self._ran.is_set()

    def done(self) -> bool:
        if not self._ran.is_set():
            return False
        pending = self._pending
        return pending is None or pending.done()

    def result(self) -> Any:
        if not self._ran.is_set():
            resolve = self._resolve
            if resolve is not None:
                resolve(self)  # a parked operation: run it now (its resolver decides how, and when it fails)
            while not self._ran.wait(_WAIT_SLICE_S):
                pass  # queued: the queue runs it in its turn, each collective before it within its own deadline
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                self._output = pending.finish()
            except Exception as exc:  # noqa: BLE001 - raised below, once
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._output

    def __repr__(self) -> str:
        return f"Handle({self.id})"


def _check(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(f"expected a handle returned by an _async collective, got {type(handle).__name__}")
    if handle._taken:
        raise ValueError(f"{handle!r} was already synchronized; each handle gives its result once")
    return handle


def poll(handle: Handle) -> bool:
    """Whether the handle's collective is done (:func:`synchronize` will not block)."""
    return _check(handle).done()


def synchronize(handle: Handle) -> Any:
    """Wait for the handle's collective; its output (a list for the grouped calls), or the error it met."""
    handle = _check(handle)
    handle._taken = True
    return handle.result()


def submit(start: Callable[[], Any]) -> Handle:
    """Run ``start`` on the ordered queue of the communicator a collective called here would use (the process
    set's, inside ``process_sets.scope``): the ``_async`` form of any collective call."""
    return Handle.queued(process_sets.current(), start)


def single(pending: Any) -> Any:
    """A one-tensor call's output: the first result of its grouped form."""
    return _First(pending) if isinstance(pending, collectives.Pending) else pending[0]


class _First(collectives.Pending):
    def __init__(self, inner: collectives.Pending) -> None:
        super().__init__([], lambda: inner.finish()[0])
        self._inner = inner

    def done(self) -> bool:
        return self._inner.done()


def _allreduce_start(tensors: list[torch.Tensor], op: Any, name: str | None, compression: Any,
                     timeout_s: float | None, inplace: bool, kind: str, one: bool) -> Callable[[], Any]:
    def start() -> Any:
        pending = collectives.start_grouped_allreduce(tensors, op, name, compression, timeout_s, inplace, kind)
        return single(pending) if one else pending

    return start


def allreduce_async(tensor: torch.Tensor, op=collectives.Average, name: str | None = None,
                    compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return submit(_allreduce_start([tensor], op, name, compression, timeout_s, False, "allreduce", True))


def allreduce_async_(tensor: torch.Tensor, op=collectives.Average, name: str | None = None,
                     compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return submit(_allreduce_start([tensor], op, name, compression, timeout_s, True, "allreduce_", True))


def grouped_allreduce_async(tensors: list[torch.Tensor], op=collectives.Average, name: str | None = None,
                            compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return submit(_allreduce_start(tensors, op, name, compression, timeout_s, False, "grouped_allreduce", False))


def grouped_allreduce_async_(tensors: list[torch.Tensor], op=collectives.Average, name: str | None = None,
                             compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return submit(_allreduce_start(tensors, op, name, compression, timeout_s, True, "grouped_allreduce_", False))


def allgather_async(tensor: torch.Tensor, **kwargs: Any) -> Handle:
    return submit(lambda: collectives.allgather(tensor, **kwargs))


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return submit(lambda: collectives.broadcast(tensor, root_rank, **kwargs))


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return submit(lambda: collectives.broadcast_(tensor, root_rank, **kwargs))
