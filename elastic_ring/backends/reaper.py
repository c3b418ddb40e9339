"""Tear down an old round's group off the critical path.

Destroying a gloo group joins its threads and closes one pair of sockets per
peer; measured on 2 cores, that took about 10 ms per peer (20 ms at 2 ranks,
80 ms at 8, 160 ms at 16), paid by every survivor at every failure and every
re-form, before it could form the next ring. :func:`drop` hands the group to a
short-lived daemon thread of its own, which lets it go there (torch releases
the GIL while it destroys a process group). One thread per group, so a
teardown that has to wait (a collective still in flight finishes or times out
first) never holds up the next one.

Ownership moves in a one-element list: the caller puts its only reference in
the box and keeps none, the thread pops it, so the object dies on that thread
and :func:`drain` returns only once it is gone.

Everything the thread meets is caught: logged with the group's label, kept in
``failures``, and the pending count is released in ``finally``, so nothing that
waits on it (:func:`drain`, which has a deadline) can wait for a dead thread.
A destructor cannot raise into the thread itself (Python hands such errors to
``sys.unraisablehook``, which prints them).

At exit, pending teardowns get until the latest of their own deadlines (each
group's collective timeout, plus a margin), so the interpreter does not shut
down under a thread that is inside a destructor; what is still pending then is
logged by label. A forked child starts with a fresh reaper: it must not destroy
its parent's groups (their threads do not exist in the child).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
from typing import Any

_log = logging.getLogger(__name__)

#: The least the exit hook waits for pending teardowns, and the margin it adds to their own deadlines.
EXIT_DRAIN_S = 2.0


class Reaper:
    """Drops the objects it is handed, each on a daemon thread of its own."""

    def __init__(self, name: str = "elastic-ring-reaper") -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[str, float]] = {}  # ticket -> (label, deadline on the monotonic clock)
        self._tickets = itertools.count(1)
        self._name = name
        self.failures: list[str] = []  # what went wrong, newest last (also logged)

    def drop(self, box: list, label: str, within_s: float) -> None:
        """Release the one object in ``box`` (the caller's only reference) on a new daemon thread.

        ``label`` names it in logs; ``within_s`` is how long its teardown may legitimately take
        (a collective still in flight finishes or times out first): the exit hook waits that long.
        """
        if len(box) != 1:
            raise ValueError(f"reaper.drop takes a list holding exactly one object, got {len(box)}")
        ticket = next(self._tickets)
        with self._cond:
            self._pending[ticket] = (label, time.monotonic() + within_s)
        threading.Thread(target=self._run, args=(box, ticket, label), name=self._name, daemon=True).start()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything handed over so far is released; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def drain_at_exit(self, least_s: float = EXIT_DRAIN_S) -> bool:
        """Wait for pending teardowns up to the latest of their deadlines (at least ``least_s``);
        log the labels of those still pending. True if none is."""
        with self._cond:
            deadlines = [deadline for _, deadline in self._pending.values()]
        if not deadlines:
            return True
        wait_s = max(least_s, max(deadlines) - time.monotonic() + least_s)
        if self.drain(wait_s):
            return True
        with self._cond:
            labels = [label for label, _ in self._pending.values()]
        _log.warning("exiting while %d group teardown(s) still run after %.1f s: %s", len(labels), wait_s,
                     "; ".join(labels))
        return False

    @property
    def pending(self) -> list[str]:
        """Labels of the teardowns still running."""
        with self._cond:
            return [label for label, _ in self._pending.values()]

    def _run(self, box: list, ticket: int, label: str) -> None:
        try:
            started = time.monotonic()
            obj = box.pop()
            del obj  # the last reference: the destructor runs here, on this thread
            _log.debug("tore down %s in %.3f s", label, time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - logged and kept; drain must still be released
            self.failures.append(f"{label}: {type(exc).__name__}: {exc}")
            _log.warning("tearing down %s failed: %s: %s", label, type(exc).__name__, exc)
        finally:
            with self._cond:
                self._pending.pop(ticket, None)
                self._cond.notify_all()


_reaper = Reaper()


def drop(box: list, label: str, within_s: float) -> None:
    """Release the one object in ``box`` on a reaper thread (see the module docstring)."""
    _reaper.drop(box, label, within_s)


def drain(timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) for every teardown handed over so far."""
    return _reaper.drain(timeout_s)


def _at_exit() -> None:
    _reaper.drain_at_exit()


def _after_fork_in_child() -> None:
    # What the parent was tearing down belongs to the parent; the child leaks its copies.
    global _reaper
    _reaper = Reaper()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
