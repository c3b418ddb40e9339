"""When the driver's loop steps its state, as pure functions of what arrived and of the driver's own clock.

A step of a state costs O(members) (its Context, the silence rule over every member), so the loop must not
step once per message: with N workers heartbeating every ``heartbeat_interval_s`` that is O(N²) work per second
(at 1,024 workers, about 31 cores' demand, measured by ``python -m benchmarks.control_plane --costs``). Every
message is still *applied* to its worker's record at once (O(1)); the state steps at once only for what may
change a decision (:func:`wakes_states`), else at the next tick (:func:`step_due`), as torchft's lighthouse
computes its quorum on a fixed tick; and while such messages keep coming, at most :data:`MAX_STEP_SHARE` of the
time (:func:`step_gap_s`).
"""

from __future__ import annotations

#: The kinds of worker message that ask for no step unless applying them brought a new ring request: a heartbeat
#: (its counter, its ``synced`` flag; or a node's heartbeats in one ``node_hb``), ``synced`` (every member sends one after each round's sync: N at once, and
#: no decision needs it before the next tick), rank 0's reports and timeline batches (the trainer consumes them).
BACKGROUND_KINDS = frozenset({"hb", "node_hb", "synced", "report", "timeline"})


def wakes_states(kind: str, changed: bool) -> bool:
    """Whether a worker's message of ``kind`` (its ``k``), once applied, asks for a step now. ``changed``:
    applying it brought a new ring request (not a counter that advanced: silence is judged at the next step,
    which sees it; nor a worker that now holds the state). Everything else (a ring request, a fault, a checkpoint)
    steps at once."""
    return changed or kind not in BACKGROUND_KINDS


#: The most of its time the loop spends stepping while decision-relevant messages keep coming (a re-form's ring
#: requests, one per survivor). A step holds the GIL for O(members) (3.7 ms at 1,024 members,
#: ``benchmarks.control_plane --costs``); stepping at once for each of 1,023 requests left the inbox thread, which
#: needs the GIL after each pop, one message per step: the last request was applied 1–3 s after the loss.
MAX_STEP_SHARE = 0.25


def step_gap_s(relevant: bool, last_step_s: float, tick_s: float) -> float:
    """How long after the last step began the next one is due: at the tick (the timers: silence, deadlines, drain
    polls), or, when something decision-relevant arrived, once the loop has spent no more than
    :data:`MAX_STEP_SHARE` of the time since stepping (``last_step_s``: what the last step took; never later than
    the tick, so the share holds for steps up to ``MAX_STEP_SHARE * tick_s``, 25 ms). At a few dozen members a step
    takes well under a millisecond and a ring request still steps at once."""
    return min(tick_s, last_step_s / MAX_STEP_SHARE) if relevant else tick_s


def step_due(relevant: bool, since_step_s: float, tick_s: float, last_step_s: float = 0.0) -> bool:
    """Step the state now (``since_step_s``: since the last step began; :func:`step_gap_s`)."""
    return since_step_s >= step_gap_s(relevant, last_step_s, tick_s)


#: A running round's notices are pushed again this long after they were sent, then after twice as long each
#: time, NOTICE_REPEATS times at most (a notice lost on its way, or taken from a queue by a stranger).
NOTICE_REPEAT_S = 2.0
NOTICE_REPEATS = 5


def notice_repeat_due(since_s: float, repeats: int) -> bool:
    """Push the round's notices again now (``since_s``: since they were last sent or pushed again; ``repeats``:
    how often they were pushed again since the last new one). A copy a member already has changes nothing."""
    return repeats < NOTICE_REPEATS and since_s >= NOTICE_REPEAT_S * 2 ** repeats


#: A lost answer is sent again at most after this many doublings of its first wait.
RESEND_DOUBLINGS = 5


def resend_after_s(interval_s: float, inbox_delay_s: float, resends: int) -> float:
    """How long after a ring answer (or its last resend) a heartbeat that still says it waits for that answer
    means the answer got lost. A heartbeat applied now was sent about ``inbox_delay_s`` ago: those queued before
    the answer arrived must not count. Each resend of the same answer waits twice as long (a driver that is
    behind must not answer its own backlog with more of the same)."""
    return (2 * interval_s + inbox_delay_s) * 2 ** min(resends, RESEND_DOUBLINGS)
