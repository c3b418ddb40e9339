"""NcclCommunicator's failure and teardown decisions on CPU: a communicator object wired to a fake NCCL
library and a watchdog with a fake clock (its CUDA calls are replaced by no-ops; the collectives
themselves are tested on a GPU in tests/gpu). Graceful close finalizes then destroys; a failed or late
finalize aborts; the watchdog's failure aborts (then empties torch's cache) and becomes the CommError
that every later call raises."""

import contextlib

import pytest
import torch

import elastic_ring as er
from elastic_ring.backends.base import Communicator
from elastic_ring.backends.nccl.communicator import NcclCommunicator
from elastic_ring.backends.nccl.handle import CommHandle
from elastic_ring.backends.nccl.lib import IN_PROGRESS, SUCCESS
from elastic_ring.backends.nccl.watchdog import Watchdog
from elastic_ring.core.ops import ReduceOp
from tests.test_nccl import FakeLib
from tests.test_nccl_watchdog import FakeClock


@pytest.fixture
def calls(monkeypatch):
    record = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: record.append("empty_cache"))
    return record


def make_comm(lib, calls, collective_timeout_s=5.0):
    spec = er.RingSpec(round_id=7, rank=1, world_size=2, node_ids=("a", "b"), backend="nccl",
                       store=er.StoreAddress("127.0.0.1", 1), collective_timeout_s=collective_timeout_s)
    comm = NcclCommunicator.__new__(NcclCommunicator)  # no CUDA here: wire the parts by hand
    Communicator.__init__(comm, spec)
    comm._lib, comm._device = lib, torch.device("cuda", 0)
    comm._watchdog = Watchdog(clock=FakeClock())
    comm._handle = CommHandle(lib, lib.init_ptr)
    lib.calls = calls  # one ordered log of NCCL calls and empty_cache
    return comm


def test_graceful_close_finalizes_then_destroys(calls):
    lib = FakeLib([IN_PROGRESS, IN_PROGRESS, SUCCESS])
    comm = make_comm(lib, calls)
    comm.close()
    assert calls == ["finalize", "destroy"] and comm.closed and not comm.errored
    comm.close()
    comm.abort()
    assert calls == ["finalize", "destroy"]
    with pytest.raises(er.CommError, match="was closed"):
        comm.allreduce(torch.ones(1), ReduceOp.SUM)


def test_a_late_finalize_is_aborted(calls):
    lib = FakeLib([IN_PROGRESS])
    comm = make_comm(lib, calls, collective_timeout_s=0.2)
    comm.close()
    assert calls == ["finalize", "abort", "empty_cache"]


def test_a_failed_finalize_is_aborted(calls):
    lib = FakeLib([IN_PROGRESS, 6])
    comm = make_comm(lib, calls)
    comm.close()
    assert calls == ["finalize", "abort", "empty_cache"]


def test_closing_an_errored_communicator_aborts_without_finalizing(calls):
    comm = make_comm(FakeLib(), calls)
    comm._error = RuntimeError("Connection reset by peer")  # as recorded by a failed collective
    comm.close()
    assert calls == ["abort", "empty_cache"] and comm.closed


def test_the_watchdogs_failure_aborts_once_and_every_later_call_raises_it(calls):
    lib = FakeLib([SUCCESS])
    comm = make_comm(lib, calls)
    dog, clock = comm._watchdog, comm._watchdog._clock
    dog.watch(comm, "allreduce", lambda: False, timeout_s=5)
    clock.now += 6
    dog.poll_once()
    assert calls == ["abort", "empty_cache"] and comm.errored
    with pytest.raises(er.CommError, match=r"^\[rank 1/2 round 7\] NCCL allreduce did not finish within "
                                           r"collective_timeout_s=5 \(deadline passed 1.00 s ago\)"):
        comm.raise_if_failed()
    with pytest.raises(er.CommError, match="failed earlier .*did not finish within collective_timeout_s=5"):
        comm.allreduce(torch.ones(1), ReduceOp.SUM)
    comm.abort()
    comm.close()
    assert calls == ["abort", "empty_cache"], "abort is idempotent; no finalize after a failure"


def test_an_async_error_is_described_for_the_watchdog(calls):
    lib = FakeLib([SUCCESS, IN_PROGRESS, 6])
    comm = make_comm(lib, calls)
    assert comm.async_error() is None and comm.async_error() is None
    assert comm.async_error() == "ncclRemoteError: peer 1 closed the connection"
    comm.abort()
    assert comm.async_error() is None  # an aborted handle has nothing more to say
