"""The gloo backend: CPU tensors over a fresh torch.distributed gloo group per round.

The group is an explicit ``ProcessGroupGloo`` object on a ``PrefixStore`` with
the round's prefix, never the global default group, so it coexists with a
user's own ``init_process_group`` and a process can form any number of rounds
without restarting. Collectives run on gloo's own threads; ``Work.wait`` blocks
with the round's timeout. ``abort`` drops the group, which closes its sockets,
so peers blocked on this rank fail within milliseconds instead of waiting for
their timeout (gloo's abort alone does not close them). The group is dropped on
a :mod:`elastic_ring.backends.reaper` thread, at once: destroying it costs about 10 ms per
peer, which the next round's formation no longer waits for. The sockets close
when that destruction ends; a collective still queued on the group is finished
or failed first, as it was when the caller itself destroyed the group.

Forming goes through :class:`~elastic_ring.backends.formation.Formation`: an arrival
barrier, then the group's construction, on a helper thread that is abandoned
when the round is aborted (a group that forms after that goes to the reaper).

**Pairs connected at first use** (``ELASTIC_RING_GLOO_LAZY=1``, the default; ``0``: gloo's full mesh). A
group built with gloo's default devices connects a full mesh at construction:
each rank reads every rank's address from the store and connects every pair,
one after the other (O(n) per rank, O(n²) store reads in all; measured 0.45 s
at 64 ranks against 0.03 s). Lazy devices (``create_device(lazy_init=True)``,
one fresh device per group: a lazy device must never serve two groups) publish
this rank's address and connect a pair when a collective first uses it. The
communicator's collectives use few pairs: allreduce and allgather are rings
(rank ± 1), a broadcast from any root is a binomial tree whose edges join ranks
``2^k`` apart, and gloo's barrier is a dissemination barrier over exactly the
pairs ``rank ± 2^k``. So the formation ends with one barrier (waited for in
slices, interruptible like the rest of the formation): it connects every pair
these collectives will ever use, 2·⌈log₂ n⌉ per rank, while a member that died
after arriving still fails the formation, as the full mesh did; nothing reads
the store after the formation. A peer that dies later closes its sockets,
which its neighbours see at once.

Gloo's ``abort()`` and ``shutdown()`` do not wake a thread blocked in
``Work.wait`` (measured: it stays blocked for its whole timeout when a peer is
frozen). ``_GlooWork.wait`` therefore waits in slices of ``WAIT_SLICE_S`` and
raises between two slices once the communicator was aborted, so that
``runtime.abort_round`` from another thread ends a collective that a frozen
peer holds within about ``WAIT_SLICE_S``. A slice that times out leaves the
collective running (torch's timed wait has no side effect; measured: the same
collective completes correctly after 20 slices). The gloo thread that runs an
abandoned collective stays blocked until the collective fails (the peer's
socket closes when it dies) or reaches its own timeout; until then the group's
teardown waits on the reaper's thread, off the critical path.
"""

from __future__ import annotations

import datetime
import time
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from ..core import constants, timeline
from ..core.constants import GLOO_THREADS
from ..core.errors import CommError
from ..core.ops import ReduceOp
from ..core.spec import RingSpec
from . import reaper
from .base import _BACKEND_FAILURES, BucketPath, Communicator, Work
from .formation import Formation

#: How often a thread blocked in a gloo collective looks whether the communicator was aborted.
WAIT_SLICE_S = 0.1
#: Where a round's gloo ranks publish their addresses, under the round's prefix: a full mesh's values list the
#: pair ids, a lazy group's do not, so the two never share keys (ELASTIC_RING_GLOO_LAZY must be the same on every
#: rank; a rank of the other mode makes the formation time out instead of misreading the values).
EAGER_PREFIX, LAZY_PREFIX = "gloo/", "gloo-lazy/"


def address_key(spec: RingSpec, rank: int, lazy: bool) -> str:
    """The store key under which ``rank`` of ``spec``'s round publishes its gloo address (torch's PrefixStore
    adds a ``/`` after each prefix, gloo its device index)."""
    return f"{spec.store_prefix}{LAZY_PREFIX if lazy else EAGER_PREFIX}/0/{rank}"

_GLOO_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


_SLICE = _timedelta(WAIT_SLICE_S)


class _GlooWork(Work):
    """A gloo collective in flight. Holds torch's Work, which keeps the group's
    context (and sockets) alive, so abort() releases it through ``release``;
    a thread waiting on it notices the release within ``WAIT_SLICE_S``."""

    __slots__ = ("_work", "_timeout_s")

    def __init__(self, work: "dist.Work", timeout_s: float) -> None:
        self._work: "dist.Work | None" = work
        self._timeout_s = timeout_s

    def wait(self) -> None:
        work = self._work
        if work is None:
            raise RuntimeError("the collective was aborted")
        deadline = time.monotonic() + self._timeout_s
        try:
            while True:
                try:
                    work.wait(_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():  # finished (or failed) just now: its own result
                        work.wait(_SLICE)
                        return
                if self._work is None:
                    raise RuntimeError("the collective was aborted while waiting")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the collective did not finish within {self._timeout_s:g} s")
        finally:
            self._work = None
            del work

    def release(self) -> None:
        self._work = None

    def is_completed(self) -> bool:
        work = self._work
        return work is None or work.is_completed()


class _GlooBuckets(BucketPath):
    """The gradient buckets' lane on gloo: the ring's group with options made once, works made without a Python
    frame; the same checks and failures as :meth:`Communicator.allreduce`. The communicator's abort releases the
    works in flight (the path sits in its ``_works``). While the timeline records (looked at once per step),
    buckets take the recorded path."""

    def __init__(self, comm: "GlooCommunicator") -> None:
        super().__init__(comm)
        self._opts = opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = _timedelta(comm.spec.collective_timeout_s)
        self._timeout_s = comm.spec.collective_timeout_s
        self._live: list[_GlooWork] = []
        self._recorded = timeline.is_enabled()
        comm._works.add(self)

    def launch(self, tensor: torch.Tensor) -> Work:
        comm: GlooCommunicator = self.comm  # type: ignore[assignment]
        if comm._pg is None or comm._error is not None or comm._closed or self._recorded:
            return comm.allreduce(tensor, ReduceOp.SUM)  # its checks raise what is wrong; the timeline records it
        if comm.before_issue:  # an _async queue: what was called before this bucket goes out first
            comm.run_before_issue()
        pg = comm._pg
        if pg is None:  # aborted by another thread meanwhile: its checks raise
            return comm.allreduce(tensor, ReduceOp.SUM)
        try:
            raw = pg.allreduce([tensor], self._opts)
        except _BACKEND_FAILURES as exc:
            # the error's traceback keeps this frame: no local of it may hold the group, which must die on the
            # reaper (comm.fail aborts), not wherever the error is collected (see _connect_pairs)
            del pg
            raise comm.fail(exc) from exc
        work = _GlooWork.__new__(_GlooWork)  # no __init__ frame: this runs once per bucket
        work._work, work._timeout_s = raw, self._timeout_s
        self._live.append(work)
        if comm._pg is None:  # aborted by another thread meanwhile
            work.release()
        return work

    def wait(self, works: list[Work]) -> None:
        comm = self.comm
        try:
            for work in works:
                if comm._error is not None or comm._closed:
                    comm.check_usable()
                try:
                    work.wait()
                except _BACKEND_FAILURES as exc:
                    raise comm.fail(exc) from exc
        finally:
            self._live.clear()
            self._recorded = timeline.is_enabled()

    def release(self) -> None:
        """The communicator was aborted: drop the works in flight (they hold the group's sockets)."""
        for work in self._live:
            work.release()


def _connect_pairs(box: list, formation: Formation, spec: RingSpec, label: str) -> None:
    """Connect the pairs of a lazy group (``box[0]``) that its collectives use, with one barrier (see the module
    docstring), waited for in slices so that a cancelled or abandoned formation stops waiting at once. On any
    failure the group is aborted and handed to the reaper (``box`` is emptied), and the error raised."""
    opts = dist.BarrierOptions()
    opts.timeout = _timedelta(max(formation.remaining_s(), 0.001))
    try:
        work = box[0].barrier(opts)
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # it failed (a peer gone): its own error
                    work.wait(_SLICE)
                    return
            formation._check_wanted()
            if formation.remaining_s() <= 0:
                raise CommError(f"[{spec.identity}] connecting the gloo pairs of round {spec.round_id} did not "
                                f"finish within connect_timeout_s={spec.connect_timeout_s}: a rank that arrived "
                                "never connected (it died, or cannot be reached at the address it published)")
    except BaseException:
        work = None
        dying = [box.pop()]
        dying[0].abort()
        # its teardown waits until gloo gives up a pair to a dead peer (up to five times the pair's timeout, a
        # listener's wait that nothing interrupts); the exit hook does not wait for that. The reaper's box holds
        # the only reference: no local of this frame may keep the group, or the traceback of the error raised
        # here would (its frames live as long as the exception), and the group would be destroyed wherever the
        # exception is collected: on the training thread, in a garbage collection, blocked in that teardown
        reaper.drop(dying, f"{label} (its pairs did not connect)", 0.0)
        raise


class GlooCommunicator(Communicator):
    """Communicator of one round over gloo. ``store`` is a connected TCP store client."""

    def __init__(self, spec: RingSpec, store: dist.Store, formation: Formation | None = None) -> None:
        super().__init__(spec)
        self._store = store  # a Python store behind a PrefixStore must outlive the group's use of it
        formation = formation if formation is not None else Formation(spec, store)
        label = f"the gloo group of {spec.identity}"
        reads = formation.interruptible_store()  # gloo's address exchange ends when the round is aborted

        def build(seconds_left: float) -> "dist.ProcessGroupGloo":
            lazy = constants.GLOO_LAZY_PAIRS  # explicit: a user's TORCH_GLOO_LAZY_INIT does not change our groups
            # the two modes publish different values: a rank of the other mode is never read, only waited for
            prefixed = dist.PrefixStore(spec.store_prefix + (LAZY_PREFIX if lazy else EAGER_PREFIX), reads)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = _timedelta(seconds_left)
            options._threads = GLOO_THREADS
            if spec.bind_host:
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.bind_host, lazy_init=lazy)]
            else:
                options._devices = [dist.ProcessGroupGloo.create_default_device(lazy_init=lazy)]
            pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, options)
            if lazy and spec.world_size > 1:
                box = [pg]
                del pg
                _connect_pairs(box, formation, spec, label)
                pg = box.pop()
            return pg

        def discard(box: list) -> None:  # a group formed after its round was given up
            box[0].abort()
            reaper.drop(box, f"{label} (formed after the round was abandoned)", spec.collective_timeout_s)

        self._pg: "dist.ProcessGroupGloo | None" = formation.run(build, discard, "gloo ring")
        # Collectives use the collective timeout; forming used the connect timeout.
        self._pg._set_default_timeout(_timedelta(spec.collective_timeout_s))
        self._works: "weakref.WeakSet[_GlooWork | _GlooBuckets]" = weakref.WeakSet()  # released by an abort

    def _group(self) -> "dist.ProcessGroupGloo":
        pg = self._pg  # aborted from another thread: None
        if pg is None:
            raise CommError(f"[{self.spec.identity}] the communicator was aborted"
                            + (f" ({self._error})" if self._error is not None else ""))
        return pg

    def _track(self, work: "dist.Work", timeout_s: float) -> Work:
        tracked = _GlooWork(work, timeout_s)
        self._works.add(tracked)
        if self._pg is None:  # aborted by another thread after this collective was queued
            tracked.release()
        return tracked

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def bucket_path(self, mode: str | None = None) -> BucketPath:
        return _GlooBuckets(self)

    def _check_cpu(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(
                    f"the gloo backend moves CPU tensors, got a tensor on {t.device}; "
                    "use backend='nccl' for CUDA tensors or move the tensor to the CPU"
                )

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, timeout_s: float) -> Work:
        self._check_cpu(tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[op]
        opts.timeout = _timedelta(timeout_s)
        return self._track(self._group().allreduce([tensor], opts), timeout_s)

    def _broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Work:
        self._check_cpu(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = _timedelta(timeout_s)
        return self._track(self._group().broadcast([tensor], opts), timeout_s)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> Work:
        self._check_cpu(output, tensor)
        opts = AllgatherOptions()
        opts.timeout = _timedelta(timeout_s)
        return self._track(self._group().allgather([list(output.unbind(0))], [tensor], opts), timeout_s)

    def _barrier(self, timeout_s: float) -> Work:
        # gloo's barrier ignores per-call timeouts; a one-element allreduce honours them.
        return self._allreduce(torch.zeros(1), ReduceOp.SUM, timeout_s)

    def _abort(self) -> None:
        # abort() alone leaves the sockets open, and a peer blocked on this rank
        # would wait for its full timeout; destroying the group closes them, so
        # the peer fails within milliseconds (measured: 8 s -> 0.02 s).
        # Works in flight hold the group's context too, so they are released as well.
        box, self._pg = [self._pg], None  # the box holds the only reference; the reaper takes it
        if box[0] is None:
            return
        box[0].abort()
        for work in list(self._works):
            work.release()
        # Its destructor waits for collectives still queued (they fail or time out), then closes the pairs.
        reaper.drop(box, f"the gloo group of {self.spec.identity}", self.spec.collective_timeout_s)
