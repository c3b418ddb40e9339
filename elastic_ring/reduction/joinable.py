"""What ``join()`` asks of this process's reducers (:mod:`elastic_ring.collectives.join`).

A rank waiting in ``join()`` answers a step's leading check and mirrors its buckets with zeros (the check's
join plan lists them). Once a step's check saw a joined rank, every later step of the ring leads with a check
that is read before any bucket goes out (no trailer, no deferral) until a check sees none; so a step is
joinable if the ring's steps lead with a check when the rank joins (``strict_checks=True``, or before the
ring's first step): :func:`join_blockers` names the optimizers for which they do not, among those still in use
on the ring: an optimizer whose hooks were removed, or that another optimizer of the ring has superseded (stepped
twice since its last step, as after switching optimizers), reduces nothing a joined rank must answer. When a join ends, the
ranks' step counts differ: they are no longer compared on that ring (:func:`after_join`) until the state layer
re-bases them. :class:`JoinAnswering` is a mixin of :class:`elastic_ring.reduction.reducer.GradReducer`.
"""

from __future__ import annotations

import itertools
import weakref

from ..backends.base import Communicator

#: Every live reducer of this process (join() asks them whether a joined rank could answer their steps).
_live: "weakref.WeakSet[JoinAnswering]" = weakref.WeakSet()

#: Numbers the consumed steps of every reducer of this process, in order (which optimizer stepped last).
_sequence = itertools.count(1)


def join_blockers(comm: Communicator) -> list[str]:
    """Why a rank of ``comm`` that joins now could not answer the next step of this process's optimizers
    (their steps on ``comm`` ride in the last bucket or are deferred); empty when it could. Only optimizers in
    use count: their gradient hooks are installed, and no other optimizer of ``comm`` stepped twice since their
    last step (optimizers stepped in turn, as a GAN's, all count; one left behind after a switch does not)."""
    bound = [r for r in list(_live) if r._comm_ref is not None and r._comm_ref() is comm]
    blockers = []
    for reducer in bound:
        reason = reducer.join_blocker(comm)
        if reason is None or not reducer._hooks:
            continue
        last = reducer._join_steps[1]
        if any(other is not reducer and other._join_steps[0] > last for other in bound):
            continue  # superseded on this ring
        blockers.append(reason)
    return blockers


def after_join(comm: Communicator) -> None:
    """Every rank of ``comm`` returned from join(): their applied-step counts differ now; stop comparing them
    on this ring (a sync or restore re-bases them), and check the next step before its buckets."""
    for reducer in list(_live):
        reducer.joined_on(comm)


class JoinAnswering:
    """A reducer's answers to join(): whether a joining rank could answer its next step, and a join's end."""

    def _track_for_join(self) -> None:
        """Make this reducer one that :func:`join_blockers` and :func:`after_join` ask (held weakly), and number
        its consumed steps (``_join_steps``: the numbers of its last two)."""
        _live.add(self)
        self._join_steps = (0, 0)
        me = weakref.ref(self)

        def heard(passes: int, applied: bool) -> None:
            reducer = me()
            if reducer is not None:
                reducer._join_steps = (reducer._join_steps[1], next(_sequence))

        self.step_listeners.append(heard)

    def join_blocker(self, comm: Communicator) -> str | None:
        """Why a rank that joins ``comm`` now could not answer this optimizer's next step (None: it could)."""
        if self._strict or self._join_active or self._comm_ref is None or self._comm_ref() is not comm:
            return None
        lean = self._agreed_digest == self._digest and (self._tuner is None or self._tuner.done) and self._trailer_fits()
        if not lean and not self._deferred(comm):
            return None  # its next step leads with a check that is read before any bucket goes out
        return (f"this process has a DistributedOptimizer (strict_checks=False, {len(self._params)} parameters) "
                f"that stepped on this ring (one no longer used stops counting once another optimizer has stepped "
                f"twice since its last step)")

    def joined_on(self, comm: Communicator) -> None:
        """A join ended on ``comm`` (see :func:`after_join`)."""
        if self._comm_ref is not None and self._comm_ref() is comm:
            self._step_armed = False
            self._join_active = True
            if not self._touched:  # the next step leads with a check: not the lean step the last one armed
                self._lean = None
                self._in_bucket = self._verified = False
