"""Horovod's error types (:class:`HorovodInternalError` lives with every public error of ray_integration in
:mod:`ray_integration.errors`), and the translation of a failed collective's ``CommError`` into them."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import elastic_ring as er

from ..errors import HorovodInternalError

#: Horovod's "the hosts changed": the membership changes at a commit (re-form without rolling back).
HostsUpdatedInterrupt = er.MembershipChanged


def _internal_error(exc: er.CommError) -> HorovodInternalError:
    """``exc`` as a :class:`HorovodInternalError` with the same message and attributes (``live_state_consistent``
    and what the loop reads)."""
    if isinstance(exc, HorovodInternalError):
        return exc
    error = HorovodInternalError(*exc.args)
    error.__dict__.update(exc.__dict__)
    return error


@contextlib.contextmanager
def _horovod_errors() -> Iterator[None]:
    """Raise a failed collective's ``CommError`` as :class:`HorovodInternalError`."""
    try:
        yield
    except er.CommError as exc:
        if isinstance(exc, RuntimeError):
            raise
        raise _internal_error(exc) from exc


def _hvd_call(fn: Callable) -> Callable:
    """Decorate a call of this module: a failed collective raises :class:`HorovodInternalError`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _horovod_errors():
            return fn(*args, **kwargs)

    return call


_LAUNCH = ("run the script with `python -m ray_integration.launch [--min-workers N] [--max-workers M] script.py "
           "[args]` (or call it inside ElasticTrainer(...).run(fn)): elastic_ring forms the ring for you")
