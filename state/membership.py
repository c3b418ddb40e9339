"""The pending-membership-change flag that the worker runtime raises and ``commit()`` consumes.

The Ray worker runtime (or a test) calls :func:`request_membership_change` on a
rank, from any thread, when the driver decides the ring must change (a worker
joins, a node drains). At its next ``commit()`` every rank learns of it in the
same small collective and raises :class:`elastic_ring.MembershipChanged`.
"""

from __future__ import annotations

import threading

_pending = threading.Event()


def request_membership_change() -> None:
    """Ask every rank to re-form at the next commit (thread-safe)."""
    _pending.set()


def membership_change_requested() -> bool:
    return _pending.is_set()


def clear_membership_change() -> None:
    _pending.clear()
