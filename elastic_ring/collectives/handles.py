"""Horovod's ``_async`` collectives: a handle now, the result from :func:`synchronize`.

Each ``*_async`` call checks its signature with the peers and *launches* its
collective when it is called, in call order, so the ranks pair their
collectives exactly as the synchronous calls do (ordered by call, not matched by
name as Horovod's coordinator does: two ranks must make their calls in the same
order). The allreduces then run while the caller works (on buffers of their
own, never the ring's pooled ones); :func:`poll` says whether they finished and
:func:`synchronize` waits and returns the output, or raises the error the
collective met, at that point, as Horovod does. The other ``_async`` calls
(allgather, broadcast, reducescatter, alltoall, and allreduces through autograd
or a widened dtype) complete at the call. A re-form fails what is in flight:
its ``synchronize`` raises ``CommError``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from . import tensors as collectives

_ids = itertools.count(1)


class Handle:
    """The outcome of one ``_async`` call (an output or an exception), taken once by :func:`synchronize`.
    ``start()`` either returns the output, or a :class:`~elastic_ring.collectives.tensors.Pending` collective in flight."""

    __slots__ = ("id", "_output", "_error", "_taken", "_pending")

    def __init__(self, start: Callable[[], Any]) -> None:
        self.id = next(_ids)
        self._output: Any = None
        self._error: BaseException | None = None
        self._taken = False
        self._pending: collectives.Pending | None = None
        try:
            out = start()
        except Exception as exc:  # noqa: BLE001 - delivered by synchronize(), as Horovod's handles do
            self._error = exc
        else:
            if isinstance(out, collectives.Pending):
                self._pending = out
            else:
                self._output = out

    def done(self) -> bool:
        return self._pending is None or self._pending.done()

    def result(self) -> Any:
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


def _single(pending: Any) -> Any:
    """A one-tensor call's output: the first result of its grouped form."""
    return _First(pending) if isinstance(pending, collectives.Pending) else pending[0]


class _First(collectives.Pending):
    def __init__(self, inner: collectives.Pending) -> None:
        super().__init__([], lambda: inner.finish()[0])
        self._inner = inner

    def done(self) -> bool:
        return self._inner.done()


def allreduce_async(tensor: torch.Tensor, op=collectives.Average, name: str | None = None,
                    compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return Handle(lambda: _single(collectives.start_grouped_allreduce([tensor], op, name, compression, timeout_s,
                                                                      False, "allreduce")))


def allreduce_async_(tensor: torch.Tensor, op=collectives.Average, name: str | None = None,
                     compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return Handle(lambda: _single(collectives.start_grouped_allreduce([tensor], op, name, compression, timeout_s,
                                                                      True, "allreduce_")))


def grouped_allreduce_async(tensors: list[torch.Tensor], op=collectives.Average, name: str | None = None,
                            compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return Handle(lambda: collectives.start_grouped_allreduce(tensors, op, name, compression, timeout_s, False,
                                                              "grouped_allreduce"))


def grouped_allreduce_async_(tensors: list[torch.Tensor], op=collectives.Average, name: str | None = None,
                             compression=collectives.Compression.none, timeout_s: float | None = None) -> Handle:
    return Handle(lambda: collectives.start_grouped_allreduce(tensors, op, name, compression, timeout_s, True,
                                                              "grouped_allreduce_"))


def allgather_async(tensor: torch.Tensor, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.allgather(tensor, **kwargs))


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.broadcast(tensor, root_rank, **kwargs))


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.broadcast_(tensor, root_rank, **kwargs))
