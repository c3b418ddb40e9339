"""The NCCL backend: CUDA tensors over ``cupy.cuda.nccl.NcclCommunicator``.

Contract, per round:

* The round's rank 0 creates the NCCL unique id and publishes it under the
  round's prefixed key in the rendezvous store; the other ranks read it there.
  Communicator creation blocks inside NCCL until every rank joins, so it runs in
  a helper thread that is given up on after ``connect_timeout_s``.
* Collectives run on a dedicated CUDA stream that first waits for torch's
  current stream (so the inputs are ready); torch's stream later waits on an
  event recorded after the collective (so the outputs are ready).
* ``Work.wait`` polls that event with a deadline (``collective_timeout_s``) and
  asks NCCL for asynchronous errors while it waits; on a timeout or an error
  the communicator is *aborted* and :class:`CommError` is raised. A failed or
  abandoned communicator is always aborted, never destroyed: ``ncclCommDestroy``
  can block forever on a dead peer.

cupy is imported lazily, so this module imports on machines without CUDA.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import torch
import torch.distributed as dist

from .communicator import Communicator, Work
from .constants import NCCL_POLL_INTERVAL_S
from .errors import CommError
from .ops import ReduceOp
from .spec import RingSpec

_UNIQUE_ID_KEY = "nccl/unique_id"


def nccl_available() -> bool:
    """True when CUDA and cupy's NCCL bindings can be used in this process."""
    if not torch.cuda.is_available():
        return False
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # cupy missing, or its NCCL library missing: both mean "no NCCL"
        return False
    return True


def _nccl_dtype(nccl, dtype: torch.dtype) -> int:
    table = {
        torch.float16: nccl.NCCL_FLOAT16,
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float64: nccl.NCCL_FLOAT64,
        torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8,
        torch.bool: nccl.NCCL_UINT8,
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
    }
    if hasattr(nccl, "NCCL_BFLOAT16"):
        table[torch.bfloat16] = nccl.NCCL_BFLOAT16
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"NCCL cannot move tensors of dtype {dtype}; cast to one of {sorted(map(str, table))}") from None


def _nccl_op(nccl, op: ReduceOp) -> int:
    return {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.MIN: nccl.NCCL_MIN, ReduceOp.MAX: nccl.NCCL_MAX}[op]


class _NcclWork(Work):
    __slots__ = ("_comm", "_event", "_deadline", "_timeout_s")

    def __init__(self, comm: "NcclCommunicator", event: torch.cuda.Event, timeout_s: float) -> None:
        self._comm = comm
        self._event = event
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def wait(self) -> None:
        while not self._event.query():
            self._comm.raise_async_error()
            if time.monotonic() > self._deadline:
                raise CommError(
                    f"[{self._comm.spec.identity}] NCCL collective did not finish within "
                    f"collective_timeout_s={self._timeout_s}; a peer is probably lost"
                )
            time.sleep(NCCL_POLL_INTERVAL_S)
        torch.cuda.current_stream(self._comm.device).wait_event(self._event)


class NcclCommunicator(Communicator):
    """Communicator of one round over NCCL. ``store`` is a connected TCP store client."""

    def __init__(self, spec: RingSpec, store: dist.Store) -> None:
        super().__init__(spec)
        if not nccl_available():
            raise RuntimeError(
                "backend='nccl' needs CUDA and cupy with NCCL: install elastic-ring[gpu] "
                "(cupy-cuda12x, nvidia-nccl-cu12) on a GPU machine, or use backend='gloo'"
            )
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        index = spec.cuda_device if spec.cuda_device is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        unique_id = self._exchange_unique_id(nccl, dist.PrefixStore(spec.store_prefix, store))
        self._comm = self._create(nccl, cupy, unique_id)
        with cupy.cuda.Device(index):
            self._cupy_stream = cupy.cuda.Stream(non_blocking=True)
        self._stream = torch.cuda.ExternalStream(self._cupy_stream.ptr, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def _exchange_unique_id(self, nccl, store: dist.Store) -> tuple:
        store.set_timeout(datetime.timedelta(seconds=self.spec.connect_timeout_s))
        if self.spec.rank == 0:
            unique_id = nccl.get_unique_id()
            store.set(_UNIQUE_ID_KEY, pickle.dumps(unique_id))
            return unique_id
        try:
            return pickle.loads(store.get(_UNIQUE_ID_KEY))
        except RuntimeError as exc:
            raise CommError(
                f"[{self.spec.identity}] rank 0 did not publish the NCCL unique id within "
                f"connect_timeout_s={self.spec.connect_timeout_s}: {exc}"
            ) from exc

    def _create(self, nccl, cupy, unique_id: tuple):
        """ncclCommInitRank blocks until all ranks join; give up after the connect timeout."""
        result: dict = {}

        def create() -> None:
            try:
                with cupy.cuda.Device(self._device.index):
                    result["comm"] = nccl.NcclCommunicator(self.spec.world_size, unique_id, self.spec.rank)
            except Exception as exc:  # handed to the caller below, not swallowed
                result["error"] = exc

        thread = threading.Thread(target=create, name=f"nccl-init-round{self.spec.round_id}", daemon=True)
        thread.start()
        thread.join(self.spec.connect_timeout_s)
        if thread.is_alive():
            # The helper stays blocked in NCCL until the process exits; there is no handle to abort yet.
            raise CommError(
                f"[{self.spec.identity}] NCCL communicator not formed within "
                f"connect_timeout_s={self.spec.connect_timeout_s}; a peer did not join"
            )
        if "error" in result:
            raise CommError(f"[{self.spec.identity}] NCCL communicator creation failed: {result['error']}")
        return result["comm"]

    def raise_async_error(self) -> None:
        try:
            self._comm.check_async_error()
        except Exception as exc:  # cupy's NcclError: the communicator is broken
            raise CommError(f"[{self.spec.identity}] NCCL reported an error: {exc}") from exc

    def _check_cuda(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self._device:
                raise ValueError(
                    f"the NCCL backend of this rank moves tensors on {self._device}, got one on {t.device}; "
                    "move it to the rank's device (torch.cuda.current_device())"
                )
            if not t.is_contiguous():
                raise ValueError("NCCL collectives need contiguous tensors")

    def _launch(self, tensors: tuple[torch.Tensor, ...], call, timeout_s: float) -> Work:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        call(self._cupy_stream.ptr)
        for t in tensors:
            t.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return _NcclWork(self, event, timeout_s)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, timeout_s: float) -> Work:
        self._check_cuda(tensor)
        dtype, nccl_op = _nccl_dtype(self._nccl, tensor.dtype), _nccl_op(self._nccl, op)
        ptr, count = tensor.data_ptr(), tensor.numel()
        return self._launch((tensor,), lambda s: self._comm.allReduce(ptr, ptr, count, dtype, nccl_op, s), timeout_s)

    def _broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Work:
        self._check_cuda(tensor)
        dtype, ptr, count = _nccl_dtype(self._nccl, tensor.dtype), tensor.data_ptr(), tensor.numel()
        return self._launch((tensor,), lambda s: self._comm.broadcast(ptr, ptr, count, dtype, root, s), timeout_s)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> Work:
        self._check_cuda(output, tensor)
        dtype, count = _nccl_dtype(self._nccl, tensor.dtype), tensor.numel()
        src, dst = tensor.data_ptr(), output.data_ptr()
        return self._launch((output, tensor), lambda s: self._comm.allGather(src, dst, count, dtype, s), timeout_s)

    def _barrier(self, timeout_s: float) -> Work:
        return self._allreduce(torch.zeros(1, device=self._device), ReduceOp.SUM, timeout_s)

    def _abort(self) -> None:
        comm = getattr(self, "_comm", None)
        if comm is not None:
            comm.abort()  # never destroy(): it can block on a dead peer

