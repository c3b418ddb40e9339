"""``hvd.DistributedOptimizer`` where elastic_ring's reducer cannot serve: over a process set, and ``op=Adasum``.

elastic_ring's gradient reduction runs on the whole ring, bucket by bucket inside ``loss.backward()``. These two
forms reduce in this layer instead, once per step, with Horovod's semantics:

* ``process_set=`` (a set smaller than the ring): at ``synchronize()`` (called by ``step()``) the gradients of the
  set's members are reduced by one fused ``grouped_allreduce`` on the set's sub-ring (``op``, ``compression``);
  ranks outside the set do not take part and step with their own gradients (Horovod's ``synchronize`` returns
  early there). Gradients that are None are reduced as zeros (a peer may have one), sparse ones dense. ``step()``
  after ``synchronize()`` without ``skip_synchronize()`` warns, as Horovod's, and applies what ``synchronize()``
  reduced: it does not reduce again (Horovod does, which with ``Sum`` multiplies by the set's size), as
  elastic_ring's own optimizer.
* ``op=Adasum`` (global set, more than one rank): Horovod's delta optimizer. ``step()`` first agrees with every
  rank on the parameters (names, dtypes, shapes) and on Horovod's conditions (a power-of-two number of ranks,
  floating-point parameters), so that a mistake raises on every rank before anything changed; it then runs the
  wrapped optimizer locally, takes each parameter's change ``delta = new - old``, reduces the deltas with Adasum
  (per-parameter coefficients; ``compression`` applies to them, as Horovod's) and sets
  ``param = old + adasum(delta)``. A parameter whose gradient is None is not stepped (its delta is 0; the deltas
  pair by position). If anything fails after the local step, the parameters and the optimizer's state are put
  back as they were before it, so the ranks do not diverge. ``synchronize()`` does nothing and
  ``skip_synchronize()`` raises, as in Horovod. It cannot run while a rank waits in ``hvd.join()``: every rank
  that steps raises ``TensorMismatchError`` (a ``RuntimeError``) and the joined rank waits on.

``backward_passes_per_step`` (both forms): gradients accumulate locally (autograd sums them) and are reduced once
at the step; computing a parameter's gradient more often than that before ``step()`` raises ``AssertionError``,
as Horovod's.

Cost, against the whole-ring optimizer: no overlap with the backward pass (the reduction starts at ``step()``)
and no autotuned buckets; and these are plain optimizers to the elastic loop: the step is not the transaction
elastic_ring's ``DistributedOptimizer`` makes of it (a failed step is retried from the last ``state.commit()``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from elastic_ring.collectives.agreement import agree
from elastic_ring.reduction.compression import Compression, Compressor
from elastic_ring.reduction.signature import describe
from elastic_ring.ring import process_sets as _process_sets

from . import adasum as _adasum
from .errors import _horovod_errors
from .ops import Adasum, grouped_allreduce, grouped_allreduce_


class _StepReduced:
    """Horovod's ``synchronize`` / ``skip_synchronize`` / ``step`` protocol around a reduction run at the step."""

    _hvd_should_sync: bool
    _hvd_synchronized: bool

    def _hvd_reduce(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        try:
            with _horovod_errors():
                self._hvd_reduce()
        finally:
            self._hvd_passes.clear()  # a failed step is retried from a new backward pass (the elastic loop)
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
                              "optimizer.synchronize(): the gradients synchronize() reduced are applied (not "
                              "reduced again); use skip_synchronize() around step() after synchronize()",
                              stacklevel=2)
            else:
                self.synchronize()
        self._hvd_synchronized = False
        self._hvd_passes.clear()
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
        try:
            with _horovod_errors():
                self._agree_before_step(params)
                with torch.no_grad():
                    starts = [p.detach().clone() for p in params]
                saved = _optimizer_state(self, params)
                try:
                    loss = super(_StepReduced, self).step(closure)  # the wrapped optimizer's own step, locally
                    with torch.no_grad():
                        self._apply_adasum(params, starts)
                except BaseException:
                    with torch.no_grad():
                        for p, s in zip(params, starts):
                            p.copy_(s)
                    _restore_state(self, params, saved)
                    raise
        finally:
            self._hvd_passes.clear()  # a failed step is retried from a new backward pass (the elastic loop)
        return loss

    def _agree_before_step(self, params: list[torch.Tensor]) -> None:
        """Every rank steps the same parameters, under Horovod's conditions (power-of-two ranks, floating-point
        parameters), or every rank raises here, before anything changed."""
        comm = _process_sets.current()
        problem = None
        try:
            _adasum.check(params, comm.size)
        except (TypeError, ValueError, NotImplementedError) as exc:
            problem = exc
        compression = (self._hvd_compression or Compression.none).name
        agree(comm, f"{self._hvd_label}(op=Adasum, compression={compression}) step",
              [(name, describe(p)) for name, p in self._hvd_named], None, problem)

    def _apply_adasum(self, params: list[torch.Tensor], starts: list[torch.Tensor]) -> None:
        deltas = [p.detach() - s for p, s in zip(params, starts)]
        compressor: Compressor | None = self._hvd_compression
        sent = deltas if compressor is None else [compressor.compress(d)[0] for d in deltas]
        grouped_allreduce_(sent, name=f"{self._hvd_label}.deltas", op=Adasum)
        for p, s, d, r in zip(params, starts, deltas, sent):
            p.copy_(s + (r if compressor is None else compressor.decompress(r, d.dtype)))


def _optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict:
    """A copy of ``params``' optimizer state (momentum buffers, Adam's moments, step counts)."""
    return {id(p): {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for k, v in optimizer.state[p].items()}
            for p in params if p in optimizer.state}


def _restore_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], saved: dict) -> None:
    for p in params:
        if id(p) in saved:
            optimizer.state[p] = saved[id(p)]
        else:
            optimizer.state.pop(p, None)


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters that need gradients, each once, named (Horovod's rules: unique names, every
    parameter of the optimizer named; without names ``allreduce.noname.<i>``)."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters()")
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {duplicates}")
        known = {id(p) for _, p in named}
        missing = [p for p in in_optimizer if id(p) not in known]
        if missing:
            raise ValueError(f"named_parameters was specified, but {len(missing)} parameter(s) of the optimizer "
                             f"were not named (the first has shape {tuple(missing[0].shape)}); pass "
                             "model.named_parameters() of the model whose parameters the optimizer updates")
        wanted = {id(p) for p in in_optimizer}
        named = [(n, p) for n, p in named if id(p) in wanted]
    seen: set[int] = set()
    unique = []
    for name, p in named:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            unique.append((name, p))
    return unique


def _pass_counters(wrapped: Any, params: list[torch.Tensor], passes: int) -> list:
    """Post-accumulate hooks counting each parameter's backward passes since the last reduction (Horovod's
    ``backward_passes_per_step`` check)."""
    counts = wrapped._hvd_passes

    def count(p: torch.Tensor) -> None:
        seen = counts.get(id(p), 0) + 1
        if seen > passes:
            raise AssertionError(
                f"Gradients were computed more than backward_passes_per_step={passes} times before call to "
                "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        counts[id(p)] = seen

    return [p.register_post_accumulate_grad_hook(count) for p in params]


def build(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
          kind: Callable[..., Any], *, op: Any, compression: Any, process_set: Any,
          backward_passes_per_step: int) -> torch.optim.Optimizer:
    """``optimizer`` as a ``kind`` (``_ProcessSetReduced`` / ``_AdasumDelta``) subclass of its own class, sharing
    its parameter groups and state (as elastic_ring's ``DistributedOptimizer`` does)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a positive int")
    if not isinstance(compression, Compressor):
        raise ValueError(f"compression={compression!r} is not a compressor; use hvd.Compression.none or "
                         "hvd.Compression.fp16")
    named = _named(optimizer, named_parameters)
    base = type(optimizer)
    cls = type(base.__name__, (kind, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_named = named
    wrapped._hvd_op = op
    wrapped._hvd_compression = None if compression is Compression.none else compression
    wrapped._hvd_label = "hvd.DistributedOptimizer"
    wrapped._hvd_should_sync, wrapped._hvd_synchronized = True, False
    wrapped._hvd_passes = {}
    wrapped._hvd_hooks = _pass_counters(wrapped, [p for _, p in named], backward_passes_per_step)
    wrapped.process_set = process_set
    wrapped.backward_passes_per_step = backward_passes_per_step
    wrapped._parameter_names = {p: n for n, p in named}  # Horovod's attribute: parameter -> name
    return wrapped
