"""What ``join()`` asks of this process's reducers (:mod:`elastic_ring.collectives.join`).

A rank waiting in ``join()`` answers a step's leading check and mirrors its buckets with zeros (the check's
join plan lists them). Once a step's check saw a joined rank, every later step of the ring leads with a check
that is read before any bucket goes out (no trailer, no deferral) until a check sees none; so a step is
joinable if the ring's steps lead with a check when the rank joins (``strict_checks=True``, or before the
ring's first step): :func:`join_blockers` names the optimizers for which they do not. When a join ends, the
ranks' step counts differ: they are no longer compared on that ring (:func:`after_join`) until the state layer
re-bases them. :class:`JoinAnswering` is a mixin of :class:`elastic_ring.reduction.reducer.GradReducer`.
"""

from __future__ import annotations

import weakref

from ..backends.base import Communicator

#: Every live reducer of this process (join() asks them whether a joined rank could answer their steps).
_live: "weakref.WeakSet[JoinAnswering]" = weakref.WeakSet()


def join_blockers(comm: Communicator) -> list[str]:
    """Why a rank of ``comm`` that joins now could not answer the next step of this process's optimizers
    (their steps on ``comm`` ride in the last bucket or are deferred); empty when it could."""
    return [reducer.join_blocker(comm) for reducer in list(_live) if reducer.join_blocker(comm) is not None]


def after_join(comm: Communicator) -> None:
    """Every rank of ``comm`` returned from join(): their applied-step counts differ now; stop comparing them
    on this ring (a sync or restore re-bases them), and check the next step before its buckets."""
    for reducer in list(_live):
        reducer.joined_on(comm)


class JoinAnswering:
    """A reducer's answers to join(): whether a joining rank could answer its next step, and a join's end."""

    def _track_for_join(self) -> None:
        """Make this reducer one that :func:`join_blockers` and :func:`after_join` ask (held weakly)."""
        _live.add(self)

    def join_blocker(self, comm: Communicator) -> str | None:
        """Why a rank that joins ``comm`` now could not answer this optimizer's next step (None: it could)."""
        if self._strict or self._join_active or self._comm_ref is None or self._comm_ref() is not comm:
            return None
        lean = self._agreed_digest == self._digest and (self._tuner is None or self._tuner.done) and self._trailer_fits()
        if not lean and not self._deferred(comm):
            return None  # its next step leads with a check that is read before any bucket goes out
        return (f"this process has a DistributedOptimizer (strict_checks=False, {len(self._params)} parameters) "
                f"that stepped on this ring")

    def joined_on(self, comm: Communicator) -> None:
        """A join ended on ``comm`` (see :func:`after_join`)."""
        if self._comm_ref is not None and self._comm_ref() is comm:
            self._step_armed = False
            self._join_active = True
