"""The check every collective starts with, with argument errors and join plans folded into it.

:func:`agree` runs the signature check of :mod:`elastic_ring.reduction.signature` so that a bad argument on
*one* rank makes every rank raise (the ring stays usable), and hands the check the call's join plan (what a
rank waiting in ``join()`` mirrors). :func:`refuse` is its form for a rank whose arguments are invalid.
:func:`unanswerable_while_joined` scopes calls whose join plans say "cannot be answered" (the hvd layer's
allgathers and broadcasts, refused while a rank has joined, as Horovod's).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from typing import Any, Iterator, NoReturn, Sequence

import torch

from ..backends.base import Communicator
from ..backends.byte_collectives import allgather_bytes
from ..core.errors import TensorMismatchError
from ..reduction.signature import describe, start_check
from .join_plans import parse as _parse_plan


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layout_of(tensors: Sequence[torch.Tensor]) -> list:
    """Every tensor's dtype and shape, as JSON for a join plan."""
    return [[dtype_name(t.dtype), list(t.shape)] for t in tensors]



def loose_entries(tensors: Any, label: str) -> list[tuple[str, str]]:
    """A signature of what a rank passed when its arguments are invalid (it may not even be tensors)."""
    if isinstance(tensors, torch.Tensor):
        return [(label, describe(tensors))]
    if isinstance(tensors, (list, tuple)):
        return [(f"{label}.{i}", describe(t) if isinstance(t, torch.Tensor) else f"<{type(t).__name__}>")
                for i, t in enumerate(tensors)]
    return [(label, f"<{type(tensors).__name__}>")]


#: Inside :func:`unanswerable_while_joined`: why its calls cannot run while a rank has joined (None: outside).
_UNANSWERABLE: contextvars.ContextVar[str | None] = contextvars.ContextVar("elastic_ring_unanswerable_while_joined",
                                                                           default=None)


@contextlib.contextmanager
def unanswerable_while_joined(reason: str) -> Iterator[None]:
    """Within the block (this thread or task only), every collective's join plan is "cannot be answered": while a
    rank waits in ``join()``, the ranks that call it raise :class:`TensorMismatchError` (a ``RuntimeError``)
    whose message starts with ``reason``, and the joined ranks go on waiting; the ring stays usable. With no
    rank joined the calls run as usual. The hvd layer scopes its allgathers and broadcasts so, as Horovod
    refuses them while a rank has joined (``elastic_ring``'s own answer them)."""
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"unanswerable_while_joined(reason={reason!r}): reason must be a non-empty string")
    token = _UNANSWERABLE.set(reason)
    try:
        yield
    finally:
        _UNANSWERABLE.reset(token)


#: Longest problem text a rank sends its peers.
_PROBLEM_CHARS = 500


def agree(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None,
          problem: BaseException | None, values: Sequence[int] = (), join_plan: Any = None) -> list[int]:
    """The signature check of a collective, with "this rank's arguments are invalid" folded into it.

    ``problem`` is the error this rank found in its own arguments before the check (None: they are valid).
    Every rank makes the check, in which a rank with a problem describes its call as ``kind`` "with invalid
    arguments (the problem)". The other ranks, which made a valid call, therefore see a signature mismatch
    and raise :class:`TensorMismatchError`, whose message names that rank and its problem; the rank with the
    problem raises its own error (from the mismatch). When every rank had the very same problem, the check
    agrees and its flag says so: all ranks swap their problems (plain text) and raise (each its own error,
    or a ``ValueError`` naming the ranks that had one). Nothing else is sent, so the ring stays usable.
    Returns the maxima over ranks of ``values`` (at most three), as
    :func:`~elastic_ring.reduction.signature.start_check`. ``join_plan``: what a rank waiting in ``join()``
    mirrors (None: the call raises on every rank while one has joined; a rank with a problem sends none, nor
    does a call inside :func:`unanswerable_while_joined`).
    """
    flag = 0 if problem is None else 1
    if problem is not None:  # what the peers' mismatch message shows for this rank, when they made a valid call
        kind = f"{kind} with invalid arguments ({type(problem).__name__}: {problem})"[:_PROBLEM_CHARS]
    unanswerable = _UNANSWERABLE.get()
    unmirrorable: list[str] = []  # why this call's plan could not be mirrored by a joined rank (if asked)
    check = start_check(comm, kind, entries, timeout_s, [flag, *values],
                        join_plan=_validated(join_plan, unmirrorable) if problem is None and unanswerable is None
                        else None)
    try:
        got = check.finish()
    except TensorMismatchError as mismatch:
        if problem is not None:
            raise problem from mismatch
        if unmirrorable and check.joined and str(mismatch).startswith(f"{kind} cannot run while"):
            raise TensorMismatchError(
                f"{kind} cannot run while a rank has joined (called join()): {unmirrorable[0]}; it did not run, the "
                "joined ranks wait for the next call and the ring stays usable") from None
        if unanswerable is not None and check.joined and str(mismatch).startswith(f"{kind} cannot run while"):
            who = ", ".join(map(str, check.joined))
            raise TensorMismatchError(
                f"{unanswerable} (rank{'s' if len(check.joined) > 1 else ''} {who} called join()); it did not run, "
                "the joined ranks wait for the next call and the ring stays usable") from None
        raise
    if got[0]:
        reported = _swap_problems(comm, problem, timeout_s)
        if problem is not None:
            raise problem
        raise ValueError(f"{kind}: {reported}; every rank raises (the collective did not run, the ring stays usable)")
    return got[1:]


def _validated(join_plan: Any, problems: list[str]) -> Any:
    """``join_plan`` (a value or a callable giving it), checked when a rank has joined: a plan a joined rank could
    not mirror is sent as None ("cannot be answered", so every caller raises and the joined ranks wait on) and
    the reason goes into ``problems``."""
    if join_plan is None:
        return None

    def plan() -> Any:
        value = join_plan() if callable(join_plan) else join_plan
        if value is None:
            return None
        try:
            _parse_plan(value)
        except TensorMismatchError as exc:
            problems.append(str(exc))
            return None
        return value

    return plan


def refuse(comm: Communicator, kind: str, entries: Sequence[tuple[str, str]], timeout_s: float | None,
           problem: BaseException) -> NoReturn:
    """:func:`agree` for a rank whose arguments are invalid: the check, then every rank raises."""
    agree(comm, kind, entries, timeout_s, problem)
    raise problem  # agree() raised already: a problem is always reported


def _swap_problems(comm: Communicator, problem: BaseException | None, timeout_s: float | None) -> str:
    """Every rank's problem text (as JSON: nothing is unpickled); what the ranks that had one reported."""
    if comm.size == 1:
        return f"rank 0: {type(problem).__name__}: {problem}"
    mine = None if problem is None else f"{type(problem).__name__}: {problem}"[:_PROBLEM_CHARS]
    texts = []
    for rank, data in enumerate(allgather_bytes(comm, json.dumps(mine).encode(), timeout_s)):
        try:
            text = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            text = "(unreadable)"
        if text is not None:
            texts.append(f"rank {rank} passed invalid arguments ({str(text)[:_PROBLEM_CHARS]})")
    return "; ".join(texts) or "a rank passed invalid arguments"
