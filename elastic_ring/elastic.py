"""The elastic loop: run a training function, and on failure roll back, re-form, sync and go on.

``@elastic_ring.elastic.run`` wraps ``loop(state, ...)`` the way Horovod's
``hvd.elastic.run`` does:

* ``state.sync()`` first (every rank gets root's state; a fresh job may resume
  from a durable checkpoint there), then ``loop(state)``;
* on :class:`CommError` (a collective failed): ``state.restore()`` to the last
  commit, obtain the next ring from the rendezvous, re-form, call the state's
  reset callbacks, sync, and call ``loop(state)`` again;
* on :class:`MembershipChanged` (raised by every rank at the same commit): the
  same without the rollback.

This module knows nothing of the ``state`` package: any object with
``sync()``, ``restore()`` and ``on_reset()`` works. How the next ring is
obtained is pluggable: the Ray worker runtime installs its rendezvous with
:func:`set_rendezvous`; tests install a local one.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Protocol

from . import runtime, timeline
from .errors import CommError, MembershipChanged
from .log import get_logger
from .spec import RingSpec

_log = get_logger(__name__)


class ElasticState(Protocol):
    """What the loop needs of a state. It may also have a ``committed`` attribute: False while
    the process holds no commit yet (then a failure has nothing to roll back on this rank)."""

    def sync(self) -> None: ...

    def restore(self) -> None: ...

    def on_reset(self) -> None: ...


class Rendezvous(Protocol):
    """Hands out the next round's :class:`RingSpec` for this process."""

    def next_ring(self, reason: str) -> RingSpec:
        """Block until the next ring is decided; ``reason`` is ``"start"``, ``"failure"`` or ``"membership"``."""
        ...

    # Optional: ``synced()``, called after every completed ``state.sync()``; a driver uses it to
    # pick the next ring's root among ranks that hold the committed state.


_rendezvous: Rendezvous | None = None


def set_rendezvous(rendezvous: Rendezvous | None) -> None:
    """Install how this process obtains its next ring (the worker runtime or a test does this)."""
    global _rendezvous
    _rendezvous = rendezvous


def _notify(what: str) -> None:
    """Tell the rendezvous (if it listens) that this rank now holds the ring's committed state
    ("synced"), so that a driver picks the next ring's root among ranks that do."""
    listener = getattr(_rendezvous, what, None)
    if listener is not None:
        listener()


def _reform(reason: str) -> None:
    if _rendezvous is None:
        raise RuntimeError(
            f"the ring must be re-formed ({reason}) but no rendezvous is installed; run inside "
            "ElasticTrainer(...).run(fn), or call elastic_ring.elastic.set_rendezvous(...) first"
        )
    started = time.monotonic()
    with timeline.span("reform", "membership", reason=reason):
        spec = _rendezvous.next_ring(reason)
        runtime.init(spec)
    _log.info("re-formed the ring after %s in %.3f s", reason, time.monotonic() - started)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: make ``func(state, *args, **kwargs)`` survive failures and membership changes."""

    @functools.wraps(func)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> Any:
        reason = None if runtime.is_initialized() else "start"
        while True:
            try:
                if reason is not None:
                    _reform(reason)
                    state.on_reset()
                    reason = None
                state.sync()
                _notify("synced")
                return func(state, *args, **kwargs)
            except CommError as exc:
                timeline.instant("collective_failed", "membership", error=str(exc)[:200])
                if getattr(state, "committed", True):
                    _log.warning("collective failed (%s); rolling back to the last commit", exc)
                    state.restore()
                else:  # a joiner whose first sync failed: a survivor gives it the state at the next sync
                    _log.warning("collective failed (%s) before this rank held any committed state; "
                                 "it receives the state at the next sync", exc)
                reason = "failure"
            except MembershipChanged:
                _log.info("membership changes at this commit; re-forming without rolling back")
                timeline.instant("membership_changed", "membership")
                reason = "membership"

    return wrapper
