"""Which NCCL calls each rank makes, and in which order, on every gradient bucket lane (issue 30's GPU run of
2026-11-27: ``thread`` hung, and a step benchmark with ``inline`` and ``thread`` failed with NCCL's "message
truncated"): the real reducer, lean hook and bucket paths on two simulated ranks, each with a fake NCCL library
that logs its calls and sums as ``world`` identical ranks would, and fake CUDA streams and events (CPU tensors).

NCCL pairs the ranks' calls by their order on the communicator, and plans a ``ncclGroupStart/End`` group as a
whole, so the ranks' logs (calls *and* group boundaries) must be identical whatever order autograd produced the
gradients in and however fast each rank's launches went, and the buckets must go out in bucket index order."""

import ctypes
import random
import threading

import pytest
import torch

from elastic_ring.backends.base import Communicator
from elastic_ring.backends.nccl import lib as nccl_lib
from elastic_ring.backends.nccl.codes import _REDUCE_DTYPES
from elastic_ring.backends.nccl.communicator import NcclCommunicator
from elastic_ring.backends.nccl.handle import CommHandle
from elastic_ring.backends.nccl.launcher import Launcher
from elastic_ring.backends.nccl.watchdog import Watchdog
from elastic_ring.core.ops import ReduceOp
from elastic_ring.reduction import reducer as reducer_mod
from elastic_ring.reduction.compression import Compression
from elastic_ring.ring import runtime
from elastic_ring import RingSpec, StoreAddress
from tests.test_nccl import FakeLib
from tests.test_nccl_launcher import cuda_free, fake_cuda  # noqa: F401 (fixtures)
from tests.test_nccl_watchdog import FakeClock

WORLD = 2
_TORCH_DTYPES = {code: dtype for dtype, code in _REDUCE_DTYPES.items()}


def _view(ptr: int, count: int, dtype_code: int) -> torch.Tensor:
    dtype = _TORCH_DTYPES[dtype_code]
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class RankLib(FakeLib):
    """One simulated rank's NCCL: logs every call (what its peers would pair with) and reduces as ``WORLD``
    identical ranks would (SUM: times WORLD; MIN, MAX: unchanged). ``hold_first_s`` makes the first bucket launch
    slow (the other buckets queue up behind it meanwhile, as on a busy GPU)."""

    def __init__(self, hold_first_s: float = 0.0):
        super().__init__([nccl_lib.SUCCESS])
        self.log: list[tuple] = []
        self.hold_first_s = hold_first_s
        self.threads: set[str] = set()

    def all_reduce(self, comm, ptr, count, dtype, op, stream):
        if op == nccl_lib.SUM and self.hold_first_s:
            hold, self.hold_first_s = self.hold_first_s, 0.0
            threading.Event().wait(hold)
        self.log.append(("allreduce", count, dtype, op))
        self.threads.add(threading.current_thread().name)
        if op == nccl_lib.SUM:
            _view(ptr, count, dtype).mul_(WORLD)
        return nccl_lib.IN_PROGRESS

    def broadcast(self, comm, ptr, count, dtype, root, stream):
        self.log.append(("broadcast", count))
        return nccl_lib.IN_PROGRESS

    def all_gather(self, comm, src, dst, count, dtype, stream):
        self.log.append(("allgather", count))
        for r in range(WORLD):
            ctypes.memmove(dst + r * count, src, count)
        return nccl_lib.IN_PROGRESS

    def group_start(self):
        self.log.append(("group start",))
        return nccl_lib.SUCCESS

    def group_end(self):
        self.log.append(("group end",))
        return nccl_lib.IN_PROGRESS


def _rank_comm(rank: int, lib: RankLib, record: list, stream) -> NcclCommunicator:
    spec = RingSpec(round_id=3, rank=rank, world_size=WORLD, node_ids=("a", "b"), backend="nccl",
                    store=StoreAddress("127.0.0.1", 1), collective_timeout_s=10.0)
    comm = NcclCommunicator.__new__(NcclCommunicator)  # no CUDA here: wire the parts by hand
    Communicator.__init__(comm, spec)
    comm._lib = lib
    comm._device = torch.device("cpu")  # CPU tensors pass the device check; CUDA itself is faked
    comm._watchdog = Watchdog(clock=FakeClock())
    comm._handle = CommHandle(lib, lib.init_ptr)
    comm._stream = stream
    lib.calls = record
    return comm


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))


def _grads(model: Net, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The reducer takes its CUDA branches (no verdict helper thread, deferred checks) on the fake device."""
    bind = reducer_mod.GradReducer._bind

    def bind_as_cuda(self, comm):
        bind(self, comm)
        self._on_cpu = False

    monkeypatch.setattr(reducer_mod.GradReducer, "_bind", bind_as_cuda)
    yield
    runtime._current = None


def _reducer_on(comm: NcclCommunicator, mode: str) -> tuple[Net, list, reducer_mod.GradReducer]:
    """A Net, its named parameters and a reducer of them on bucket lane ``mode``, with ``comm`` the current ring."""
    model = Net()
    params = list(model.named_parameters())
    reducer = reducer_mod.GradReducer(params, ReduceOp.AVERAGE, Compression.none, bucket_bytes=2048,
                                      backward_passes_per_step=1, first_bucket_bytes=512)
    reducer.bucket_mode = mode
    runtime._current = comm
    return model, params, reducer


def _run_rank(rank: int, mode: str, orders: list[list[int]], record: list, stream, hold_first_s: float = 0.0):
    """One simulated rank's steps: gradients handed to the reducer's hook in ``orders[step]``."""
    lib = RankLib(hold_first_s)
    comm = _rank_comm(rank, lib, record, stream)
    model, params, reducer = _reducer_on(comm, mode)
    try:
        for step, order in enumerate(orders):
            lib.hold_first_s = hold_first_s  # this step's first bucket launch is slow on this rank
            grads = _grads(model, step)
            for p in model.parameters():
                p.grad = None
            for i in order:  # autograd's order on this rank
                p = params[i][1]
                p.grad = grads[i].clone()
                reducer._on_grad_ready(p)
            reducer.synchronize()
            for i, (p, g) in enumerate(zip(model.parameters(), grads)):  # WORLD identical ranks: their gradient
                expected = g if i in order else torch.zeros_like(g)  # no gradient on this rank: it sent zeros
                assert torch.equal(p.grad, expected), f"step {step}: a gradient changed on its way through the lane"
        sizes = [b.numel for b in reducer.buckets]
        lean = reducer._lean is comm
    finally:
        runtime._current = None
        comm.close()
    return lib, sizes, lean


@pytest.mark.parametrize("mode", ["collective", "inline", "thread"])
def test_every_lane_makes_the_same_calls_on_every_rank_in_bucket_order_whatever_autograds_order(
        fake_cuda, cuda_free, as_on_a_gpu, mode):  # noqa: F811
    n = 12  # 6 layers x (weight, bias)
    rng = random.Random(7)
    orders = {0: [list(range(n)) for _ in range(4)],  # rank 0: the registration order every step
              1: [rng.sample(range(n), n) for _ in range(4)]}  # rank 1: a new shuffle every step
    orders[1][2].remove(5)  # and at step 2 no gradient for one parameter: its bucket goes out in synchronize()
    libs = {}
    for rank in (0, 1):
        # rank 0's first bucket launch of every step is slow: on the thread lane its later buckets queue up
        libs[rank], sizes, lean = _run_rank(rank, mode, orders[rank], cuda_free, fake_cuda.Stream(), hold_first_s=0.05 * (rank == 0))
        assert lean, "after the ring's first step the hooks take the lean path"
    log0, log1 = libs[0].log, libs[1].log
    assert log0 == log1, f"{mode}: the ranks' NCCL calls differ, so NCCL would pair different buckets:\n{log0}\n{log1}"
    assert ("group start",) not in log0, f"{mode}: buckets must never be grouped (a group is planned as a whole)"
    buckets = [entry[1] for entry in log0 if entry[0] == "allreduce" and entry[3] == nccl_lib.SUM]
    trailer = buckets[-1] - sizes[-1]
    expected_step = sizes[:-1] + [sizes[-1] + trailer]
    assert trailer >= 0 and buckets == expected_step * 4, f"bucket index order, every step: {buckets}"
    if mode == "thread":
        assert any(name.startswith("elastic-ring-nccl-launcher") for name in libs[0].threads)


def test_an_inline_bucket_waits_for_buckets_another_path_left_on_the_launcher(fake_cuda, cuda_free):  # noqa: F811
    lib = RankLib()
    comm = _rank_comm(1, lib, cuda_free, fake_cuda.Stream())
    gate = threading.Event()

    def slow_bucket(job):
        gate.wait(5)
        lib.log.append(("allreduce", "queued bucket", None, nccl_lib.SUM))

    comm._launcher = Launcher("test-launcher", slow_bucket, comm.fail)
    comm._launcher.submit(("bucket of the thread path",))
    threading.Timer(0.1, gate.set).start()
    comm.bucket_path("inline").launch(torch.ones(4))
    assert [entry[1] for entry in lib.log] == ["queued bucket", 4], "one ordering point for every launch"
    comm.close()


class FailingLib(RankLib):
    """The ``fail_at``-th bucket allreduce fails (a peer closed its connection)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at, self.buckets = fail_at, 0

    def all_reduce(self, comm, ptr, count, dtype, op, stream):
        if op == nccl_lib.SUM:
            self.buckets += 1
            if self.buckets == self.fail_at:
                self.log.append(("allreduce", count, dtype, op))
                return 6  # ncclRemoteError
        return super().all_reduce(comm, ptr, count, dtype, op, stream)


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_failed_bucket_launch_surfaces_as_comm_error_with_clean_gradients_and_ends_the_launcher(
        fake_cuda, cuda_free, as_on_a_gpu, mode):  # noqa: F811
    import elastic_ring as er

    lib = FailingLib(fail_at=2)
    comm = _rank_comm(0, lib, cuda_free, fake_cuda.Stream())
    model, params, reducer = _reducer_on(comm, mode)
    with pytest.raises(er.CommError, match="ncclRemoteError") as failed:
        for i in reversed(range(len(params))):  # autograd's usual order: the buckets go out during "backward"
            params[i][1].grad = torch.ones_like(params[i][1])
            reducer._on_grad_ready(params[i][1])
        reducer.synchronize()  # thread: the launcher's failure surfaces here at the latest
    assert getattr(failed.value, "live_state_consistent", False), "raised before the update: the state is whole"
    assert all(p.grad is None for _, p in params), "a retried step starts from clean gradients"
    assert comm.errored and "abort" in lib.calls
    sums = [entry for entry in lib.log if entry[3] == nccl_lib.SUM]
    assert len(sums) == 2, f"nothing is launched after the failed bucket: {sums}"
    launcher = comm._launcher
    assert launcher is None if mode == "inline" else launcher.join(5), "the launcher thread ends with its ring"
    runtime._current = None
