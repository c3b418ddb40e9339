"""``hvd.DistributedOptimizer`` where elastic_ring's reducer cannot serve: over a process set, and ``op=Adasum``.

elastic_ring's gradient reduction runs on the whole ring, bucket by bucket inside ``loss.backward()``. These two
forms reduce in this layer instead, once per step, with Horovod's semantics:

* ``process_set=`` (a set smaller than the ring): at ``synchronize()`` (called by ``step()``) the gradients of the
  set's members are reduced by one fused ``grouped_allreduce`` on the set's sub-ring (``op``, ``compression``);
  ranks outside the set do not take part and step with their own gradients (Horovod's ``synchronize`` returns
  early there). Gradients that are None are reduced as zeros (a peer may have one), sparse ones dense.
* ``op=Adasum`` (global set, more than one rank): Horovod's delta optimizer. ``step()`` runs the wrapped
  optimizer locally, takes each parameter's change ``delta = new - old``, reduces the deltas with Adasum
  (per-parameter coefficients) and sets ``param = old + adasum(delta)``. ``synchronize()`` does nothing and
  ``skip_synchronize()`` raises, as in Horovod.

Cost, against the whole-ring optimizer: no overlap with the backward pass (the reduction starts at ``step()``)
and no autotuned buckets; and these are plain optimizers to the elastic loop: the step is not the transaction
elastic_ring's ``DistributedOptimizer`` makes of it (a failed step is retried from the last ``state.commit()``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from elastic_ring.reduction.compression import Compression
from elastic_ring.reduction.optimizer import _named_parameters

from .errors import _horovod_errors
from .ops import Adasum, grouped_allreduce, grouped_allreduce_


class _StepReduced:
    """Horovod's ``synchronize`` / ``skip_synchronize`` / ``step`` protocol around a reduction run at the step."""

    _hvd_should_sync: bool
    _hvd_synchronized: bool

    def _hvd_reduce(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        with _horovod_errors():
            self._hvd_reduce()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):  # noqa: D401 - torch's signature
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients are reduced again", stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)  # type: ignore[misc]


class _ProcessSetReduced(_StepReduced):
    """Gradients averaged (``op``) over the members of ``process_set`` at the step."""

    def _hvd_reduce(self) -> None:
        if not self.process_set.included():
            return
        params = [p for _, p in self._hvd_named]
        sparse = {}
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                sparse[id(p)] = p.grad.sparse_dim()
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        names = f"{self._hvd_label}.grads"
        if self._hvd_compression is None:
            grouped_allreduce_(grads, name=names, op=self._hvd_op, process_set=self.process_set)
        else:
            reduced = grouped_allreduce(grads, name=names, compression=self._hvd_compression, op=self._hvd_op,
                                        process_set=self.process_set)
            with torch.no_grad():
                for g, r in zip(grads, reduced):
                    g.copy_(r)
        for p in params:
            if id(p) in sparse:
                p.grad = p.grad.to_sparse(sparse[id(p)])


class _AdasumDelta(_StepReduced):
    """Horovod's Adasum delta optimizer: a local step, then the parameters' changes combined by Adasum."""

    def synchronize(self) -> None:  # Horovod's: nothing to do before the step
        pass

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator, as the context manager needs

    def step(self, closure=None):  # noqa: D401 - torch's signature
        params = [p for _, p in self._hvd_named]
        for p in params:
            if p.grad is None:  # every rank steps every parameter: the deltas pair by position
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
        loss = super(_StepReduced, self).step(closure)  # the wrapped optimizer's own step, locally
        with torch.no_grad():
            deltas = [p.detach() - s for p, s in zip(params, starts)]
            with _horovod_errors():
                grouped_allreduce_(deltas, name=f"{self._hvd_label}.deltas", op=Adasum)
            for p, s, d in zip(params, starts, deltas):
                p.copy_(s + d)
        return loss


def build(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
          kind: Callable[..., Any], *, op: Any, compression: Any, process_set: Any,
          backward_passes_per_step: int) -> torch.optim.Optimizer:
    """``optimizer`` as a ``kind`` (``_ProcessSetReduced`` / ``_AdasumDelta``) subclass of its own class, sharing
    its parameter groups and state (as elastic_ring's ``DistributedOptimizer`` does)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a positive int")
    named = _named_parameters(optimizer, named_parameters)
    base = type(optimizer)
    cls = type(base.__name__, (kind, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_named = named
    wrapped._hvd_op = op
    wrapped._hvd_compression = None if compression is Compression.none else compression
    wrapped._hvd_label = "hvd.DistributedOptimizer"
    wrapped._hvd_should_sync, wrapped._hvd_synchronized = True, False
    wrapped.process_set = process_set
    wrapped.backward_passes_per_step = backward_passes_per_step
    wrapped._parameter_names = {p: n for n, p in named}  # Horovod's attribute: parameter -> name
    return wrapped
