"""The gloo backend: CPU tensors over a fresh torch.distributed gloo group per round.

The group is an explicit ``ProcessGroupGloo`` object on a ``PrefixStore`` with
the round's prefix, never the global default group, so it coexists with a
user's own ``init_process_group`` and a process can form any number of rounds
without restarting. Collectives run on gloo's own threads; ``Work.wait`` blocks
with the round's timeout. ``abort`` drops the group, which closes its sockets,
so peers blocked on this rank fail within milliseconds instead of waiting for
their timeout (gloo's abort alone does not close them). The group is dropped on
a :mod:`elastic_ring.reaper` thread, at once: destroying it costs about 10 ms per
peer, which the next round's formation no longer waits for. The sockets close
when that destruction ends; a collective still queued on the group is finished
or failed first, as it was when the caller itself destroyed the group.
"""

from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from . import reaper
from .communicator import Communicator, Work
from .constants import GLOO_THREADS
from .errors import CommError
from .ops import ReduceOp
from .spec import RingSpec

_GLOO_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _GlooWork(Work):
    """A gloo collective in flight. Holds torch's Work, which keeps the group's
    context (and sockets) alive, so abort() releases it through ``release``."""

    __slots__ = ("_work", "_timeout")

    def __init__(self, work: "dist.Work", timeout_s: float) -> None:
        self._work: "dist.Work | None" = work
        self._timeout = _timedelta(timeout_s)

    def wait(self) -> None:
        work = self._work
        if work is None:
            raise RuntimeError("the collective was aborted")
        try:
            work.wait(self._timeout)
        finally:
            self._work = None
            del work

    def release(self) -> None:
        self._work = None


class GlooCommunicator(Communicator):
    """Communicator of one round over gloo. ``store`` is a connected TCP store client."""

    def __init__(self, spec: RingSpec, store: dist.Store) -> None:
        super().__init__(spec)
        prefixed = dist.PrefixStore(spec.store_prefix + "gloo/", store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(spec.connect_timeout_s)
        options._threads = GLOO_THREADS
        if spec.bind_host:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.bind_host)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        try:
            self._pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, options)
        except RuntimeError as exc:
            raise CommError(
                f"[{spec.identity}] could not form the gloo ring within "
                f"connect_timeout_s={spec.connect_timeout_s}: {exc}"
            ) from exc
        # Collectives use the collective timeout; forming used the connect timeout.
        self._pg._set_default_timeout(_timedelta(spec.collective_timeout_s))
        self._works: "weakref.WeakSet[_GlooWork]" = weakref.WeakSet()

    def _track(self, work: "dist.Work", timeout_s: float) -> Work:
        tracked = _GlooWork(work, timeout_s)
        self._works.add(tracked)
        return tracked

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

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
        return self._track(self._pg.allreduce([tensor], opts), timeout_s)

    def _broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Work:
        self._check_cpu(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = _timedelta(timeout_s)
        return self._track(self._pg.broadcast([tensor], opts), timeout_s)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> Work:
        self._check_cpu(output, tensor)
        opts = AllgatherOptions()
        opts.timeout = _timedelta(timeout_s)
        return self._track(self._pg.allgather([list(output.unbind(0))], [tensor], opts), timeout_s)

    def _barrier(self, timeout_s: float) -> Work:
        # gloo's barrier ignores per-call timeouts; a one-element allreduce honours them.
        return self._allreduce(torch.zeros(1), ReduceOp.SUM, timeout_s)

    def _abort(self) -> None:
        # abort() alone leaves the sockets open, and a peer blocked on this rank
        # would wait for its full timeout; destroying the group closes them, so
        # the peer fails within milliseconds (measured: 8 s -> 0.02 s).
        # Works in flight hold the group's context too, so they are released as well.
        box, self._pg = [self._pg], None  # the box holds the only reference; the reaper takes it
        box[0].abort()
        for work in list(self._works):
            work.release()
        # Its destructor waits for collectives still queued (they fail or time out), then closes the pairs.
        reaper.drop(box, f"the gloo group of {self.spec.identity}", self.spec.collective_timeout_s)
