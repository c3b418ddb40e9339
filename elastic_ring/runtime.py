"""The process's current ring: form a round, reconfigure to the next, shut down.

``init(spec)`` is the single entry point of the worker runtime (and of tests
that run without Ray): it aborts the previous round's communicator, if any, and
forms the new one on the round's prefixed store keys. Round ids must increase
per store, so a stale round's keys can never be mistaken for the new round's.

Connections to rendezvous stores are kept for the life of the process and
shared by all rounds that use the same store. Every round's communicator sees
the store through :class:`~elastic_ring.auth.AuthenticatedStore` under the
spec's ``auth_key``, so gloo's and NCCL's rendezvous values are authenticated.

When no ring is formed yet and a *ring provider* is installed (the elastic
loop installs one with its rendezvous), the first call that needs the ring
(``er.rank()``, a collective, ...) forms it through the provider. That is how
code before ``@er.elastic.run`` inside ``ElasticTrainer`` works; a failure
there is not recovered (only the elastic loop recovers), and its error says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time

import torch.distributed as dist

from typing import Callable

from . import identity as ring_identity
from .auth import AuthenticatedStore, new_secret
from .communicator import Communicator
from .errors import CommError, NotInitializedError
from .log import get_logger
from .spec import RingSpec, StoreAddress

_log = get_logger(__name__)

_lock = threading.RLock()
_current: Communicator | None = None
_stores: dict[StoreAddress, dist.TCPStore] = {}
_last_round: dict[tuple[StoreAddress, str], int] = {}
_ring_provider: Callable[[], None] | None = None
_teardown_hooks: list[Callable[[], None]] = []


def set_ring_provider(provider: Callable[[], None] | None) -> None:
    """Install what forms the first ring on demand (``provider()`` must call :func:`init`); None removes it."""
    global _ring_provider
    _ring_provider = provider


def add_teardown_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever a round's communicator is torn down (e.g. to release pooled buffers)."""
    if hook not in _teardown_hooks:
        _teardown_hooks.append(hook)


def _store_client(address: StoreAddress, timeout_s: float) -> dist.TCPStore:
    store = _stores.get(address)
    if store is None:
        try:
            store = dist.TCPStore(
                address.host,
                address.port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise CommError(
                f"cannot reach the rendezvous store at {address.host}:{address.port} "
                f"within connect_timeout_s={timeout_s}: {exc}"
            ) from exc
        _stores[address] = store
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def _create(spec: RingSpec, store: dist.Store) -> Communicator:
    if spec.backend == "gloo":
        from .gloo_communicator import GlooCommunicator

        return GlooCommunicator(spec, store)
    from .nccl_communicator import NcclCommunicator

    return NcclCommunicator(spec, store)


def init(spec: RingSpec) -> Communicator:
    """Form the communicator of ``spec``'s round and make it the current ring.

    Aborts the previous round's communicator first. Raises :class:`CommError` if
    the ring cannot be formed within ``spec.connect_timeout_s`` (a peer is
    missing), and ``ValueError`` if ``spec.round_id`` does not increase.
    """
    global _current
    if not isinstance(spec, RingSpec):
        raise TypeError(f"elastic_ring.init expects a RingSpec, got {type(spec).__name__}")
    if spec.auth_key is None and spec.world_size == 1:
        spec = dataclasses.replace(spec, auth_key=new_secret())  # a ring of one reads nothing from anyone
    if spec.auth_key is None:
        raise ValueError("RingSpec.auth_key is missing: every rank needs the job's secret (at least 16 bytes, the same "
                         "on every rank) so that nothing read from the store or the ring is used unauthenticated; "
                         "make one with elastic_ring.auth.new_secret() and pass it to every rank out of band "
                         "(ElasticTrainer does this for you)")
    with _lock:
        key = (spec.store, spec.job_id)
        last = _last_round.get(key)
        if last is not None and spec.round_id <= last:
            raise ValueError(
                f"RingSpec.round_id={spec.round_id} does not increase (this process already formed round {last} "
                f"of job {spec.job_id!r} on this store); every new round needs a larger id"
            )
        _shutdown_locked()
        _last_round[key] = spec.round_id
        started = time.monotonic()
        store = AuthenticatedStore(_store_client(spec.store, spec.connect_timeout_s), spec.auth_key)
        _current = _create(spec, store)
        ring_identity.set_current(ring_identity.RingIdentity.of(_current.spec))
        _log.debug("formed %s ring of %d in %.3f s", spec.backend, spec.world_size, time.monotonic() - started)
        return _current


def _shutdown_locked() -> None:
    global _current
    if _current is not None:
        comm, _current = _current, None
        ring_identity.set_current(None)
        try:
            if comm.errored:
                comm.abort()
            else:
                comm.close()
        finally:
            for hook in _teardown_hooks:
                hook()


def shutdown() -> None:
    """Leave the current ring (abort its communicator). Safe to call when not initialized."""
    with _lock:
        _shutdown_locked()


def is_initialized() -> bool:
    return _current is not None


def current() -> Communicator:
    """The current round's communicator; raises :class:`NotInitializedError` if there is none."""
    comm = _current
    if comm is None and _ring_provider is not None:
        with _lock:
            if _current is None:
                _ring_provider()
        comm = _current
    if comm is None:
        raise NotInitializedError(
            "elastic_ring has no ring: call elastic_ring.init(spec) first, or run the code "
            "inside ElasticTrainer(...).run(fn), which forms the ring for you"
        )
    return comm


def current_or_none() -> Communicator | None:
    return _current


def rank() -> int:
    """This process's rank in the current ring."""
    return current().spec.rank


def size() -> int:
    """Number of ranks in the current ring."""
    return current().spec.world_size


def local_rank() -> int:
    """Rank among the current ring's ranks on this node."""
    return current().spec.local_rank


def local_size() -> int:
    """Number of the current ring's ranks on this node."""
    return current().spec.local_size


def round_id() -> int:
    """Id of the current round."""
    return current().spec.round_id
