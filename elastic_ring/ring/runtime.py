"""The process's current ring: form a round, reconfigure to the next, shut down.

``init(spec)`` is the single entry point of the worker runtime (and of tests
that run without Ray): it aborts the previous round's communicator, if any, and
forms the new one on the round's prefixed store keys. Round ids must increase
per store, so a stale round's keys can never be mistaken for the new round's.

Connections to rendezvous stores are kept for the life of the process and
shared by all rounds that use the same store. Every round's communicator sees
the store through :class:`~elastic_ring.core.auth.AuthenticatedStore` under the
spec's ``auth_key``, so gloo's and NCCL's rendezvous values are authenticated.

Forming is interruptible (:mod:`elastic_ring.backends.formation`): an arrival barrier,
then the backend's construction on a helper thread. :func:`abort_round` (from
any thread; the worker actor calls it when the driver declares a member of a
round dead) fails the current communicator of that round or an older one (a
collective blocked on it in another thread raises :class:`CommError`), cancels
a formation of such a round in progress, and makes a later ``init`` of such a
round raise at once. The abort mark is kept per store and job, like the last
round id.

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

from ..backends.base import Communicator
from ..backends.formation import Formation
from ..core import identity as ring_identity
from ..core.auth import AuthenticatedStore, new_secret
from ..core.errors import CommError, NotInitializedError
from ..core.log import get_logger
from ..core.spec import RingSpec, StoreAddress

_log = get_logger(__name__)

_lock = threading.RLock()
_current: Communicator | None = None
_stores: dict[StoreAddress, dist.TCPStore] = {}
_last_round: dict[tuple[StoreAddress, str], int] = {}
_ring_provider: Callable[[], None] | None = None
_teardown_hooks: list[Callable[[], None]] = []

_JobKey = tuple[StoreAddress, str]
# abort_round's state: never waits for ``_lock`` (which a formation holds for its whole length).
_abort_lock = threading.Lock()
_aborted: dict[_JobKey | None, tuple[int, str]] = {}  # job -> (highest aborted round, its reason); None: no job yet
_job: _JobKey | None = None  # the job of the latest init: the one abort_round's round ids refer to
_forming: Formation | None = None  # the formation in progress (init holds _lock: at most one)


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
    if store is not None:
        # a kept connection whose server went (a store that restarted at the same address, as a test's per-test
        # server on a port the OS handed out again): its first write would fail the round as "the store is gone";
        # one round trip finds it out, and a fresh connection replaces it
        try:
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
            store.num_keys()
        except (RuntimeError, OSError):
            del _stores[address]
            store = None
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


def _create(spec: RingSpec, store: dist.Store, formation: Formation, parent: Communicator | None) -> Communicator:
    if spec.backend == "gloo":
        from ..backends.gloo import GlooCommunicator

        return GlooCommunicator(spec, store, formation)
    from ..backends.nccl.communicator import NcclCommunicator

    return NcclCommunicator(spec, store, formation=formation, parent=parent)  # type: ignore[arg-type]


def abort_round(round_id: int, reason: str) -> None:
    """The driver says round ``round_id`` lost a member: give up this process's rings of that round
    and older ones. Thread-safe and non-blocking (it never waits for a formation or a collective):

    * the current communicator, if its round is ``<= round_id`` and it is still in use, fails with a
      :class:`CommError` naming ``reason``: a collective blocked on it in another thread raises that
      within about 0.1 s (gloo; NCCL: its abort ends the kernels), and so does every later call;
    * a formation of a round ``<= round_id`` in progress raises :class:`CommError` at once;
    * a later :func:`init` of a round ``<= round_id`` of the same job raises :class:`CommError` at
      once (the abort may come before this process starts forming that round).

    Rounds ``> round_id`` are never affected. The mark is kept for the job (store and job id) of the
    latest :func:`init` (before the first one: for the first job this process joins).
    """
    if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
        raise ValueError(f"abort_round: round_id={round_id!r} must be a round id (an int >= 0)")
    reason = str(reason) or "no reason given"
    with _abort_lock:
        mark = _aborted.get(_job)
        if mark is None or round_id > mark[0]:
            _aborted[_job] = (round_id, reason)
        forming, comm = _forming, _current
    if forming is not None and forming.spec.round_id <= round_id:
        _log.warning("[%s] round %d aborted while forming: %s", forming.spec.identity, round_id, reason)
        forming.cancel(reason)
    if comm is not None and comm.spec.round_id <= round_id and not (comm.closed or comm.errored):
        _log.warning("[%s] round %d aborted: %s; failing the communicator", comm.spec.identity, round_id, reason)
        comm.fail(CommError(f"[{comm.spec.identity}] round {comm.spec.round_id} was aborted: {reason}"
                            + _older(comm.spec.round_id, round_id)))


def _older(this: int, aborted: int) -> str:
    return "" if this == aborted else f" (every round up to {aborted} was aborted)"


def _check_not_aborted_locked(spec: RingSpec, key: _JobKey) -> None:
    """Under ``_abort_lock``: CommError if ``spec``'s round was aborted before it formed."""
    mark = _aborted.get(key)
    if mark is not None and spec.round_id <= mark[0]:
        raise CommError(f"[{spec.identity}] round {spec.round_id} was aborted before it formed: {mark[1]}"
                        f"{_older(spec.round_id, mark[0])}; wait for a later round")


def init(spec: RingSpec) -> Communicator:
    """Form the communicator of ``spec``'s round and make it the current ring.

    Aborts the previous round's communicator first. Raises :class:`CommError` if
    the ring cannot be formed within ``spec.connect_timeout_s`` (a peer is
    missing; the error names the ranks that did not arrive), if the round is
    aborted (:func:`abort_round`) before or while it forms, and ``ValueError`` if
    ``spec.round_id`` does not increase.
    """
    if not isinstance(spec, RingSpec):
        raise TypeError(f"elastic_ring.init expects a RingSpec, got {type(spec).__name__}")
    if spec.auth_key is None and spec.world_size == 1:
        spec = dataclasses.replace(spec, auth_key=new_secret())  # a ring of one reads nothing from anyone
    if spec.auth_key is None:
        raise ValueError("RingSpec.auth_key is missing: every rank needs the job's secret (at least 16 bytes, the same "
                         "on every rank) so that nothing read from the store or the ring is used unauthenticated; "
                         "make one with elastic_ring.core.auth.new_secret() and pass it to every rank out of band "
                         "(ElasticTrainer does this for you)")
    with _lock:
        key = (spec.store, spec.job_id)
        last = _last_round.get(key)
        if last is not None and spec.round_id <= last:
            raise ValueError(
                f"RingSpec.round_id={spec.round_id} does not increase (this process already formed round {last} "
                f"of job {spec.job_id!r} on this store); every new round needs a larger id"
            )
        _last_round[key] = spec.round_id
        _enter_job(key)
        started = time.monotonic()
        comm = _form(spec, key)
        ring_identity.set_current(ring_identity.RingIdentity.of(comm.spec))
        _log.debug("formed %s ring of %d in %.3f s", spec.backend, spec.world_size, time.monotonic() - started)
        return comm


def _enter_job(key: _JobKey) -> None:
    """Under ``_lock``: ``key`` is now the job abort_round refers to (it inherits a mark made
    before this process's first init)."""
    global _job
    with _abort_lock:
        _job = key
        early = _aborted.pop(None, None)
        if early is not None and early[0] > _aborted.get(key, (-1, ""))[0]:
            _aborted[key] = early


def _form(spec: RingSpec, key: _JobKey) -> Communicator:
    """Under ``_lock``: leave the previous ring, form ``spec``'s communicator as a cancellable
    formation and publish it, unless its round was aborted before or meanwhile (then CommError).
    A previous NCCL communicator that ``spec`` may shrink or grow stays alive until the attempt ends."""
    parent = _take_parent_locked(spec)
    try:
        return _form_from(spec, key, parent)
    finally:
        _retire(parent)


def _form_from(spec: RingSpec, key: _JobKey, parent: Communicator | None) -> Communicator:
    global _current, _forming
    try:
        with _abort_lock:
            _check_not_aborted_locked(spec, key)
    finally:
        _shutdown_locked()
    client = _store_client(spec.store, spec.connect_timeout_s)
    store = AuthenticatedStore(client, spec.auth_key)
    formation = Formation(spec, store)
    with _abort_lock:
        _check_not_aborted_locked(spec, key)  # it may have come while this rank connected to the store
        _forming = formation
    try:
        comm = _create(spec, store, formation, parent)
    except BaseException:
        if (formation.store_held or formation.store_broken) and _stores.get(spec.store) is client:
            # an abandoned helper may hold this connection's lock until its own deadline; or it broke
            del _stores[spec.store]
        raise
    finally:
        with _abort_lock:
            _forming = None
    with _abort_lock:
        try:
            _check_not_aborted_locked(spec, key)  # the abort came after the formation ended
        except CommError:
            comm.abort()
            comm.release()
            raise
        _current = comm
    return comm


def _take_parent_locked(spec: RingSpec) -> Communicator | None:
    """Under ``_lock``: the current communicator, taken out of use but kept alive, when ``spec`` may be
    derived from it (NCCL shrink or grow of ``spec.parent_round``); None otherwise."""
    global _current
    with _abort_lock:  # abort_round reads _current under it: once taken, it is not failed as the current ring
        comm = _current
        if (comm is None or spec.backend != "nccl" or spec.nccl_reform != "shrink_grow"
                or spec.parent_round is None or comm.spec.round_id != spec.parent_round
                or comm.spec.job_id != spec.job_id or comm.spec.store != spec.store):
            return None
        _current = None
        comm.lend()  # type: ignore[attr-defined]  # a failure recorded from now on is aborted by release()
    ring_identity.set_current(None)
    for hook in _teardown_hooks:
        hook()
    return comm


def _retire(parent: Communicator | None) -> None:
    """Free a parent after its child formed (or failed to): it is never used again."""
    if parent is None:
        return
    try:
        parent.release()
    except Exception as exc:  # noqa: BLE001 - the new round stands; a parent that cannot be freed is logged
        _log.warning("[%s] freeing the previous round's communicator failed: %s: %s", parent.spec.identity,
                     type(exc).__name__, exc)


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
            comm.release()
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
    return current().spec.placement.local_rank


def local_size() -> int:
    """Number of the current ring's ranks on this node."""
    return current().spec.placement.local_size


def round_id() -> int:
    """Id of the current round."""
    return current().spec.round_id
