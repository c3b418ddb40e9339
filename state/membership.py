"""The pending-membership-change flag that the worker runtime raises and ``commit()`` consumes.

The Ray worker runtime (or a test) calls :func:`request_membership_change` on a
rank, from any thread, when the driver decides the ring must change (a worker
joins, a node drains). At its next ``commit()`` every rank learns of it in the
same small collective and raises :class:`elastic_ring.MembershipChanged`.
"""

from __future__ import annotations

import threading

_pending = threading.Event()
_persist = threading.Event()
_stop = threading.Event()


class TrainingStopped(Exception):
    """Raised by ``commit()`` on every rank when the job was asked to stop (e.g. the
    driver got SIGTERM): the commit is complete and, with checkpoints enabled,
    durable. The elastic loop lets it through; the worker runtime ends quietly."""


def request_stop() -> None:
    """Ask every rank to stop at the next commit, after writing it durably (thread-safe)."""
    _stop.set()


def stop_requested() -> bool:
    return _stop.is_set()


def request_membership_change(persist: bool = False) -> None:
    """Ask every rank to re-form at the next commit (thread-safe). With ``persist``,
    that commit is also written durably before re-forming (e.g. a node drains and
    the remaining ring would fall below ``min_workers``)."""
    if persist:
        _persist.set()
    _pending.set()


def membership_change_requested() -> bool:
    return _pending.is_set()


def persist_requested() -> bool:
    return _persist.is_set()


def clear_membership_change() -> None:
    _pending.clear()
    _persist.clear()
    _stop.clear()
