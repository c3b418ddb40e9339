"""The elastic loop: run a training function, and on failure re-form, sync and go on.

``@elastic_ring.ring.elastic.run`` wraps ``loop(state, ...)`` the way Horovod's
``hvd.elastic.run`` does:

* ``state.sync()`` first (every rank gets the job's state; a fresh job may
  resume from a durable checkpoint there), then ``loop(state)``;
* on :class:`CommError` (a collective failed): tell the state
  (``state.on_failure(exc)``, or ``state.restore()`` for a state without that
  method), obtain the next ring from the rendezvous, re-form, run the state's
  reset callbacks, sync, and call ``loop(state)`` again. A state with
  ``on_failure`` decides at the sync whether the ring continues from the live
  state of a rank whose state is whole or rolls back to the last commit
  (``CommError.live_state_consistent`` says where the failure surfaced);
* on :class:`MembershipChanged` (raised by every rank at the same commit, or at
  the same step boundary: see ``state.step_link``): the same without touching
  the state.
* before every run of ``loop``, torch ``DistributedSampler`` objects the loop
  can reach are pointed at the current ring (:mod:`elastic_ring.ring.distributed_samplers`).

Failures while re-forming, in reset callbacks or in the sync leave the state as
it was, so they are marked ``live_state_consistent``.

This module knows nothing of the ``state`` package: any object with
``sync()``, ``restore()`` and ``on_reset()`` works. How the next ring is
obtained is pluggable: the Ray worker runtime installs its rendezvous with
:func:`set_rendezvous`; tests install a local one. Installing a rendezvous also
lets the first call that needs the ring (``er.rank()``, a collective) form it
before the loop starts; a failure there is not recovered.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Protocol

from ..core import timeline
from ..core.errors import CommError, ElasticRingError, MembershipChanged, RendezvousError
from ..core.log import get_logger
from ..core.spec import RingSpec
from . import distributed_samplers, runtime

_log = get_logger(__name__)


class ElasticState(Protocol):
    """What the loop needs of a state. Optional: ``on_failure(exc)`` (decide how to recover instead
    of restoring at once), ``commit()`` (called right after a sync when the rendezvous says the job
    stops in this round), and ``committed`` (False while this process holds no state yet)."""

    def sync(self) -> None: ...

    def restore(self) -> None: ...

    def on_reset(self) -> None: ...


class Rendezvous(Protocol):
    """Hands out the next round's :class:`RingSpec` for this process."""

    def next_ring(self, reason: str) -> RingSpec:
        """Block until the next ring is decided; ``reason`` is ``"start"``, ``"failure"`` or ``"membership"``.
        Raise :class:`~elastic_ring.RingStopped` when this process is not in any next ring, and
        :class:`~elastic_ring.RendezvousError` when no answer can be had."""
        ...

    # Optional: ``synced()``, called after every completed ``state.sync()`` (a driver picks roots among
    # ranks that hold the state); ``reform_after_sync() -> bool``: True when the current round only hands
    # the state over (the loop re-forms right after the sync, for a membership change); ``stop_pending()
    # -> bool``: True when the job stops in the current round (the loop then commits at once after the
    # sync, and the state's commit ends the run).


_rendezvous: Rendezvous | None = None
#: Called as ``listener(reason)`` on every rank right after each new ring formed (``runtime.init``), before the
#: state's reset callbacks and sync: the same point on every rank of the ring, whichever loop re-formed it.
_reform_listeners: list[Callable[[str], None]] = []


def add_reform_listener(listener: Callable[[str], None]) -> None:
    """Call ``listener(reason)`` right after every ring this process forms (``reason``: ``"start"``,
    ``"failure"`` or ``"membership"``), on every rank at the same point, before the state's reset callbacks and
    sync; it may run collectives on the new ring, and a :class:`CommError` it raises is a failure of the re-form."""
    if not callable(listener):
        raise TypeError(f"reform listener {listener!r} is not callable")
    _reform_listeners.append(listener)


def remove_reform_listener(listener: Callable[[str], None]) -> None:
    if listener in _reform_listeners:
        _reform_listeners.remove(listener)


def set_rendezvous(rendezvous: Rendezvous | None) -> None:
    """Install how this process obtains its next ring (the worker runtime or a test does this)."""
    global _rendezvous
    _rendezvous = rendezvous
    runtime.set_ring_provider(None if rendezvous is None else functools.partial(_reform, "start"))


def _ask(what: str, default: Any = None) -> Any:
    listener = getattr(_rendezvous, what, None)
    return listener() if listener is not None else default


def _reform(reason: str) -> None:
    if _rendezvous is None:
        raise RuntimeError(
            f"the ring must be re-formed ({reason}) but no rendezvous is installed; run inside "
            "ElasticTrainer(...).run(fn), or call elastic_ring.ring.elastic.set_rendezvous(...) first"
        )
    started = time.monotonic()
    with timeline.span("reform", "membership", reason=reason):
        try:
            spec = _rendezvous.next_ring(reason)
        except ElasticRingError:
            raise
        except Exception as exc:  # anything else from the rendezvous: say where it came from
            raise RendezvousError(f"the rendezvous failed while asking for the next ring ({reason}): "
                                  f"{type(exc).__name__}: {exc}") from exc
        runtime.init(spec)
        for listener in list(_reform_listeners):
            listener(reason)
    _log.info("re-formed the ring after %s in %.3f s", reason, time.monotonic() - started)


def _on_failure(state: ElasticState, exc: CommError) -> None:
    timeline.instant("collective_failed", "membership", error=str(exc)[:200],
                     live_state=bool(getattr(exc, "live_state_consistent", False)))
    handler = getattr(state, "on_failure", None)
    if handler is not None:
        _log.warning("collective failed (%s); re-forming", exc)
        handler(exc)
    elif getattr(state, "committed", True):
        _log.warning("collective failed (%s); rolling back to the last commit", exc)
        state.restore()
    else:  # a joiner whose first sync failed: a survivor gives it the state at the next sync
        _log.warning("collective failed (%s) before this rank held any state; it receives the state at the "
                     "next sync", exc)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: make ``func(state, *args, **kwargs)`` survive failures and membership changes."""

    @functools.wraps(func)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> Any:
        reason = None if runtime.is_initialized() else "start"
        ring: tuple[int, int] | None = None  # (rank, size) of the ring the loop last ran in
        while True:
            try:
                try:  # re-forming and syncing leave the state as it was: a failure here is at a whole state
                    if reason is not None:
                        _reform(reason)
                        state.on_reset()
                        reason = None
                    state.sync()
                except CommError as exc:
                    exc.live_state_consistent = True
                    raise
                _ask("synced")
                if _ask("reform_after_sync", False):  # a handover round: its leavers gave the state, now they go
                    reason = "membership"
                    continue
                if _ask("stop_pending", False):
                    state.commit()  # the state's commit persists and ends the run on every rank of this round
                comm = runtime.current_or_none()
                if comm is not None:  # torch DistributedSamplers the loop split for its last ring follow this one
                    if ring is not None:  # every re-entry after a re-form, also one with this rank's split unchanged
                        distributed_samplers.retarget_reachable(func, (state, *args), kwargs, comm.rank, comm.size,
                                                                previous=ring)
                    ring = (comm.rank, comm.size)
                return func(state, *args, **kwargs)
            except CommError as exc:
                _on_failure(state, exc)
                reason = "failure"
            except MembershipChanged:
                _log.info("membership changes at this commit; re-forming without rolling back")
                timeline.instant("membership_changed", "membership")
                reason = "membership"

    return wrapper
