"""DistributedOptimizer: wrap any torch optimizer so that step() uses averaged gradients.

``DistributedOptimizer(opt, model.named_parameters())`` returns an optimizer of
a subclass of ``type(opt)`` that shares ``opt``'s parameter groups and state
(so ``isinstance`` checks and LR schedulers keep working). Gradient hooks
reduce buckets while backward runs (see :mod:`elastic_ring.reduction.reducer`);
``step()`` waits for them, then runs the wrapped optimizer's own step.

Gradients are views into the fusion buckets, so ``.grad`` tensors share
storage with them between steps (as with DDP's ``gradient_as_bucket_view``);
``zero_grad(set_to_none=True)`` and ``False`` both work.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterable, Iterator

import torch

from .autotune import AutotuneResult
from .compression import Compression, Compressor, check_compressor
from ..core.errors import CommError
from ..core.constants import AUTOTUNE, FIRST_BUCKET_BYTES, OPTIMIZER_BUCKET_BYTES
from .reducer import GradReducer
from ..core.ops import Average, ReduceOp
from ..core.validation import check_int


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class."""

    _er_reducer: GradReducer
    _er_synchronize_in_step: bool
    _er_accumulate: bool = False

    def synchronize(self) -> None:
        """Reduce gradients now (e.g. to clip them before ``step()``; then use ``skip_synchronize``)."""
        if not self.step_applies_next:
            reducer = self._er_reducer
            raise RuntimeError(
                f"optimizer.synchronize() before micro-batch {reducer.micro_calls + 1} of {reducer.passes}: with a "
                "constant global batch, step() applies only after the step's last micro-batch, and the gradients "
                "are complete only then; clip or unscale them only when optimizer.step_applies_next is True"
            )
        self._er_reducer.synchronize()

    @property
    def step_applies_next(self) -> bool:
        """Whether the next ``step()`` applies (always, except between the micro-batches of a constant global
        batch's step): gate gradient clipping, ``GradScaler.unscale_`` / ``step`` / ``update`` on it."""
        reducer = self._er_reducer
        return not self._er_accumulate or reducer.micro_calls >= reducer.passes - 1

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not reduce again (after an explicit ``synchronize()``)."""
        self._er_synchronize_in_step = False
        try:
            yield
        finally:
            self._er_synchronize_in_step = True

    def step(self, closure=None):  # noqa: D401 - torch's signature
        if self._er_accumulate:  # one call per micro-batch; apply after the last
            reducer = self._er_reducer
            reducer.micro_calls += 1
            if reducer.micro_calls < reducer.passes:
                return None
        if self._er_synchronize_in_step:
            reducer = self._er_reducer
            if reducer._synced_pending and reducer.reduced_unapplied:  # synchronize() ran, nothing reduced since
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(); "
                    "the gradients are not reduced again. Wrap step() in `with optimizer.skip_synchronize():` "
                    "when you call synchronize() yourself (e.g. to clip gradients)", UserWarning, stacklevel=2)
            else:
                self._er_reducer.synchronize()
        try:
            result = super().step(closure)  # type: ignore[misc]
        except CommError as exc:  # a wrapped optimizer's own collective: its update may be half applied
            exc.inside_apply = True
            raise
        reducer = self._er_reducer
        reducer.note_applied()  # the batch bookkeeping linked to this optimizer advances with the apply
        reducer.take_boundary()  # any rank asked: every rank acts before the next step's work (run_boundary)
        return result

    def add_step_listener(self, listener: Callable[[int, bool], None]) -> None:
        """Call ``listener(passes, applied)`` after every step this optimizer consumed: applied by ``step()``
        (``applied=True``), or reduced and then skipped, as ``GradScaler`` does on an overflow (noticed when
        the next step's first gradient arrives). ``passes`` is ``backward_passes_per_step``. A step that
        failed, or was reduced but then discarded by a recovery, is not consumed."""
        if not callable(listener):
            raise TypeError(f"step listener {listener!r} is not callable")
        self._er_reducer.step_listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[int, bool], None]) -> None:
        self._er_reducer.step_listeners.remove(listener)

    def add_reduced_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a step's reduction completes (before the step is applied or skipped)."""
        if not callable(listener):
            raise TypeError(f"reduced listener {listener!r} is not callable")
        self._er_reducer.reduced_listeners.append(listener)

    def remove_reduced_listener(self, listener: Callable[[], None]) -> None:
        self._er_reducer.reduced_listeners.remove(listener)

    def set_step_boundary(self, ask: Callable[[], bool] | None, act: Callable[[], None] | None) -> None:
        """Act at step boundaries the ring agrees on. ``ask()`` is polled once per step; its answer rides in the
        step's check (MAX over ranks), so after a step in which any rank's ``ask()`` was true, every rank has a
        boundary due (:attr:`boundary_due`). ``act()`` then runs on every rank before the next step does any
        work: at :meth:`run_boundary` (the state layer calls it before the model's next training forward), or
        at the next step's first gradient otherwise. The state layer uses it to join and leave at the next
        step; ``act`` may raise (e.g. ``MembershipChanged``), which ends that step on every rank."""
        if (ask is None) != (act is None):
            raise ValueError("set_step_boundary needs both ask and act, or neither")
        self._er_reducer.boundary_ask = ask
        self._er_reducer.boundary_act = act

    @property
    def boundary_due(self) -> bool:
        """A step boundary the ring agreed on waits for its ``act()`` (see :meth:`set_step_boundary`)."""
        return self._er_reducer.boundary_due

    def run_boundary(self) -> None:
        """Run the due boundary's ``act()`` now (no-op when none is due)."""
        self._er_reducer.run_boundary()

    def set_pass_shares(self, share: Callable[[int], tuple[int, int]] | None) -> None:
        """Weight backward passes by their share of the global step's samples (None: off). ``share(j)`` gives
        ``(n, total)``: pass ``j`` of this rank's step holds ``n`` of the step's ``total`` samples, and its
        gradient is the mean over those ``n``. The gradient is multiplied by ``n * world / total`` (``op=Average``)
        or ``n / total`` (``op=Sum``) before it is accumulated, so every sample of the step weighs exactly
        ``1 / total``. A constant global batch (``ElasticSampler(global_batch_size=...)``) uses it."""
        if share is not None and not callable(share):
            raise TypeError(f"pass share {share!r} is not callable")
        self._er_reducer.set_pass_scale(share)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` between steps (the same value on every rank)."""
        check_int("DistributedOptimizer", "backward_passes_per_step", passes, minimum=1,
                  hint="call step() after that many backward passes")
        self._er_reducer.set_passes(passes)

    def set_accumulate_in_step(self, accumulate: bool) -> None:
        """Accumulate mode (a constant global batch turns it on): call ``zero_grad()``, backward and ``step()``
        once per micro-batch as in a plain loop; ``step()`` applies after ``backward_passes_per_step`` calls
        and only counts before that, and ``zero_grad()`` between them keeps the accumulating gradients."""
        self._er_accumulate = bool(accumulate)
        self._er_reducer.micro_calls = 0

    def _settle_skipped(self) -> None:
        """A step reduced and not applied counts as skipped now (before an epoch ends), not at the next gradient."""
        self._er_reducer.settle_skipped()

    def _discard_step(self) -> None:
        """Drop a step in flight (its gradients and counts): the state layer does this when a recovery
        discards the step, before it re-sizes the step for a new ring."""
        self._er_reducer.discard_step()

    @property
    def backward_passes_per_step(self) -> int:
        return self._er_reducer.passes

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._er_accumulate and self._er_reducer.micro_calls:
            return  # between the micro-batches of one step: the gradients accumulate
        if self._er_reducer.pending:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); with backward_passes_per_step > 1, call zero_grad() only after step()"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]

    @property
    def applied_steps(self) -> int:
        """How many times this process applied the wrapped optimizer's step (rides in every step's
        cross-rank check: ranks at different counts raise TensorMismatchError before reducing)."""
        return self._er_reducer.applied_steps

    def _set_applied_steps(self, n: int) -> None:
        """Re-base :attr:`applied_steps` to ``n``, the same on every rank of the current ring (the state
        layer calls this after every sync and restore). From then on the current ring compares it in
        every step's check; after a re-form that was not re-based, only a fresh optimizer's count is
        compared (a joiner starts at 0 while survivors do not)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"applied_steps={n!r} must be an int >= 0")
        self._er_reducer.set_applied_steps(n)

    @property
    def fusion_buckets(self):
        """The gradient buckets, in launch order (for inspection and tests)."""
        return self._er_reducer.buckets

    @property
    def fusion_threshold_bytes(self) -> int:
        """The bucket size in use now (the autotuner may change it during a ring's first steps)."""
        return self._er_reducer.bucket_bytes

    @property
    def autotune_result(self) -> AutotuneResult | None:
        """What the autotuner tried and chose in the current ring (None while tuning or when it is off)."""
        return self._er_reducer.autotune_result


def _named_parameters(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> list[tuple[str, torch.nn.Parameter]]:
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"param_group.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in named):
            raise ValueError("named_parameters must be an iterable of (name, parameter) pairs, e.g. model.named_parameters()")
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names {duplicates}; every parameter needs a unique name")
        known = {id(p) for _, p in named}
        missing = [p for p in in_optimizer if id(p) not in known]
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) of the optimizer are not in named_parameters "
                f"(first one has shape {tuple(missing[0].shape)}); pass model.named_parameters() of the model "
                "whose parameters the optimizer updates"
            )
        wanted = {id(p) for p in in_optimizer}
        named = [(n, p) for n, p in named if id(p) in wanted]
    seen: set[int] = set()
    unique = []
    for name, p in named:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            unique.append((name, p))
    return unique


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp | str = Average,
    fusion_threshold_bytes: int | None = None,
    first_bucket_bytes: int | None = None,
    autotune: bool | None = None,
    strict_checks: bool = False,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over the ring.

    Args:
        optimizer: any ``torch.optim.Optimizer``; the result shares its state.
        named_parameters: ``model.named_parameters()``; names appear in errors.
        compression: ``Compression.none`` or ``Compression.fp16`` (halves the bytes sent).
        backward_passes_per_step: backward passes accumulated locally (summed)
            before one reduction; call ``step()`` after that many passes.
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``.
        fusion_threshold_bytes: largest gradient bucket (default
            ``ELASTIC_RING_OPTIMIZER_BUCKET_BYTES``, 16 MiB). Giving it turns
            autotuning off unless ``autotune=True``.
        first_bucket_bytes: the first bucket closes once it holds this many
            bytes, so the first allreduce starts early in backward (default
            1 MiB, as DDP; 0 turns it off).
        autotune: try bucket sizes during the first steps of every ring and
            keep the fastest (the same on every rank; see
            ``opt.autotune_result``). Default: on unless
            ``fusion_threshold_bytes`` is given or ``ELASTIC_RING_AUTOTUNE=0``.
        strict_checks: check every step with its own 48-byte collective
            before any gradient bucket is sent (as in a ring's first step).
            Default False: after a ring's first step the step's agreement
            rides inside its last gradient bucket, with no collective or wait
            of its own. What only strict checks turn into a clear error: a
            collective called by only some ranks just before a step (gloo
            then fails the ring or aborts the process; see docs/performance.md).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    check_int("DistributedOptimizer", "backward_passes_per_step", backward_passes_per_step, minimum=1,
              hint="call step() after that many backward passes")
    if fusion_threshold_bytes is not None:
        check_int("DistributedOptimizer", "fusion_threshold_bytes", fusion_threshold_bytes, minimum=1,
                  hint="or None for the default")
    if first_bucket_bytes is not None:
        check_int("DistributedOptimizer", "first_bucket_bytes", first_bucket_bytes, minimum=0,
                  hint="0: no early first bucket")
    if not isinstance(strict_checks, bool):
        raise ValueError(f"strict_checks={strict_checks!r} must be True or False")
    if autotune is not None and not isinstance(autotune, bool):
        raise ValueError(f"autotune={autotune!r} must be True, False or None (None: on unless fusion_threshold_bytes is given)")
    op = ReduceOp.parse(op)
    if op is ReduceOp.PRODUCT:
        raise ValueError("DistributedOptimizer reduces gradients with op=Average, Sum, Min or Max; op=Product is "
                         "for er.allreduce")
    compressor = check_compressor(compression)
    named = _named_parameters(optimizer, named_parameters)
    if autotune is None:
        autotune = AUTOTUNE and fusion_threshold_bytes is None
    bucket_bytes = OPTIMIZER_BUCKET_BYTES if fusion_threshold_bytes is None else fusion_threshold_bytes
    first = FIRST_BUCKET_BYTES if first_bucket_bytes is None else first_bucket_bytes

    cls = type(f"Distributed{type(optimizer).__name__}", (_DistributedMixin, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks with `optimizer`
    wrapped._er_reducer = GradReducer(named, op, compressor, bucket_bytes, backward_passes_per_step,
                                      first_bucket_bytes=first, autotune=autotune, strict_checks=strict_checks)
    wrapped._er_synchronize_in_step = True
    return wrapped
