"""Overlapped, fused allreduce of gradients during the backward pass.

The reducer owns the hooks that :class:`DistributedOptimizer` registers. Its
contract:

* Parameters are bucketed once, in reverse registration order (the order in
  which backward usually produces their gradients), by
  :func:`elastic_ring.fusion.plan_buckets`.
* When a parameter's gradient has been accumulated ``backward_passes_per_step``
  times, it is ready. Bucket *k* is launched (packed, prescaled if needed, and
  handed to the communicator asynchronously) as soon as it and every bucket
  before it are ready, so all ranks launch buckets in the same order while
  communication overlaps the rest of the backward pass.
* :meth:`synchronize` launches what is left (a parameter without a gradient
  contributes zeros), waits for every bucket, unpacks the averaged gradients
  into ``.grad`` and resets for the next step.
* At the first gradient of every step, one 48-byte allreduce is started that
  checks that all ranks are at the same point and hold the same parameters
  (names, dtypes, shapes); it is waited for just before the first bucket is
  launched, so backward keeps running meanwhile. Different models, or a collective that only some ranks call between
  steps, then fail on every rank with :class:`TensorMismatchError` instead of
  pairing a 48-byte message with a gradient bucket, which makes gloo abort the
  process ("Received data size doesn't match expected size").
* A :class:`CommError` anywhere drops everything in flight, so the step can be
  retried on the next round after a rollback. At world size 1 the hooks return
  at once and nothing is copied.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from . import fusion, runtime
from .communicator import Communicator, Work
from .compression import Compressor
from .errors import CommError
from .ops import ReduceOp
from .signature import PendingCheck, describe, start_check


class GradReducer:
    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        op: ReduceOp,
        compressor: Compressor,
        bucket_bytes: int,
        backward_passes_per_step: int,
    ) -> None:
        ordered = list(reversed(named_params))
        self._names = [n for n, _ in ordered]
        self._params = [p for _, p in ordered]
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._op = op
        self._compressor = compressor
        self._passes = backward_passes_per_step
        self.buckets = fusion.plan_buckets(
            [(p.numel(), p.dtype, p.device) for p in self._params], bucket_bytes, compressor
        )
        self._bucket_of = [0] * len(self._params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.indices:
                self._bucket_of[i] = b
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._lock = threading.RLock()
        self._comm: Communicator | None = None
        self._kind = (f"DistributedOptimizer step (op={op.value}, compression={compressor.name}, "
                      f"backward_passes_per_step={backward_passes_per_step})")
        self._entries = [(n, describe(p)) for n, p in zip(self._names, self._params)]
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    # ------------------------------------------------------------ state
    def _reset(self) -> None:
        self._check: PendingCheck | None = None
        self._verified = False
        self._remaining = [self._passes] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._in_flight: list[tuple[int, torch.Tensor, Work, bool]] = []

    @property
    def pending(self) -> bool:
        """True between the first ready gradient of a step and its synchronize()."""
        return bool(self._in_flight) or any(r != self._passes for r in self._remaining)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------ hooks
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        comm = runtime.current_or_none()
        if comm is None or comm.size == 1:
            return
        with self._lock:
            self._bind(comm)
            self._start_check(comm)
            i = self._position[id(param)]
            self._remaining[i] -= 1
            if self._remaining[i] < 0:
                raise RuntimeError(
                    f"gradient of {self._names[i]!r} was computed more than backward_passes_per_step="
                    f"{self._passes} times before optimizer.step(); raise backward_passes_per_step "
                    "or call step() after every backward pass"
                )
            if self._remaining[i] == 0:
                self._ready[self._bucket_of[i]] += 1
                self._launch_ready(comm)

    def _bind(self, comm: Communicator) -> None:
        """Start using ``comm``: drop anything in flight on an older round."""
        if comm is not self._comm:
            self._reset()
            self._comm = comm

    def _start_check(self, comm: Communicator) -> None:
        """Once per step, at its first gradient: ask whether all ranks are here with the same model."""
        if self._check is None and not self._verified:
            try:
                self._check = start_check(comm, self._kind, self._entries, None)
            except CommError:
                self._reset()
                raise

    def _finish_check(self) -> None:
        """Before the step's first launch: the answer must be yes."""
        if self._verified:
            return
        check, self._check = self._check, None
        try:
            check.finish()  # type: ignore[union-attr]
        except Exception:
            self._reset()
            raise
        self._verified = True

    def _launch_ready(self, comm: Communicator) -> None:
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].indices):
            self._launch(comm, self._next)
            self._next += 1

    def _launch(self, comm: Communicator, b: int) -> None:
        self._finish_check()
        bucket = self.buckets[b]
        buffer = self._buffers[b]
        if buffer is None:
            buffer = self._buffers[b] = fusion.allocate(bucket)
        grads = self._grads()
        prescale = self._op is ReduceOp.AVERAGE and fusion.needs_prescale(bucket.wire_dtype)
        base_op = ReduceOp.SUM if self._op is ReduceOp.AVERAGE else self._op
        with torch.no_grad():
            fusion.pack(bucket, grads, buffer)
            if prescale:
                buffer.mul_(1.0 / comm.size)
        try:
            work = comm.allreduce(buffer, base_op)
        except CommError:
            self._reset()
            raise
        self._in_flight.append((b, buffer, work, prescale))

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params]  # type: ignore[misc]

    # ------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Finish this step's reduction: every parameter's ``.grad`` holds the reduced value."""
        comm = runtime.current()
        if comm.size == 1:
            self._reset()
            return
        with self._lock:
            self._bind(comm)
            self._start_check(comm)
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            while self._next < len(self.buckets):
                self._launch(comm, self._next)
                self._next += 1
            grads = self._grads()
            try:
                with torch.no_grad():
                    for b, buffer, work, prescale in self._in_flight:
                        work.wait()
                        if self._op is ReduceOp.AVERAGE and not prescale:
                            buffer.div_(comm.size)
                        fusion.unpack_(self.buckets[b], buffer, grads)
            finally:
                self._reset()
