"""Horovod's ``_async`` collectives: a handle now, the result from :func:`synchronize`.

Each ``*_async`` call runs its collective when it is called, in call order, so
the ranks pair their collectives exactly as the synchronous calls do, whatever
the script does between the call and :func:`synchronize` (no background
thread, no reordering, nothing left in flight at a re-form). The handle is
therefore complete on return: :func:`poll` says True, and :func:`synchronize`
returns the output (or raises the error the collective met, at that point, as
Horovod does). What this does not give yet is overlap of the collective with
the caller's work between the two calls.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from . import collectives

_ids = itertools.count(1)


class Handle:
    """The outcome of one ``_async`` call (an output or an exception), taken once by :func:`synchronize`."""

    __slots__ = ("id", "_output", "_error", "_taken")

    def __init__(self, run: Callable[[], Any]) -> None:
        self.id = next(_ids)
        self._output: Any = None
        self._error: BaseException | None = None
        self._taken = False
        try:
            self._output = run()
        except Exception as exc:  # noqa: BLE001 - delivered by synchronize(), as Horovod's handles do
            self._error = exc

    def __repr__(self) -> str:
        return f"Handle({self.id})"


def _check(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(f"expected a handle returned by an _async collective, got {type(handle).__name__}")
    if handle._taken:
        raise ValueError(f"{handle!r} was already synchronized; each handle gives its result once")
    return handle


def poll(handle: Handle) -> bool:
    """Whether the handle's collective is done (always, here: it ran at the call)."""
    _check(handle)
    return True


def synchronize(handle: Handle) -> Any:
    """The output of the handle's collective (raises what it met)."""
    handle = _check(handle)
    handle._taken = True
    if handle._error is not None:
        raise handle._error
    return handle._output


def allreduce_async(tensor: torch.Tensor, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.allreduce(tensor, **kwargs))


def allreduce_async_(tensor: torch.Tensor, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.allreduce_(tensor, **kwargs))


def grouped_allreduce_async(tensors: list[torch.Tensor], **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.grouped_allreduce(tensors, **kwargs))


def grouped_allreduce_async_(tensors: list[torch.Tensor], **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.grouped_allreduce_(tensors, **kwargs))


def allgather_async(tensor: torch.Tensor, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.allgather(tensor, **kwargs))


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.broadcast(tensor, root_rank, **kwargs))


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, **kwargs: Any) -> Handle:
    return Handle(lambda: collectives.broadcast_(tensor, root_rank, **kwargs))
