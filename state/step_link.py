"""The step as a transaction: a state's ElasticSampler advances with its DistributedOptimizer's apply.

When a :class:`~state.State` holds exactly one ``DistributedOptimizer`` it links it to the
state (nothing for the user to write): step boundaries always, and, when the state also holds
exactly one :class:`~state.ElasticSampler`, the sampler:

* **Bookkeeping with the apply.** Every step the optimizer consumes (applies, or reduces and
  skips as ``GradScaler`` does on an overflow) advances the sampler by the step's batches, in
  the same call as the apply: the batches the loop acknowledged with ``record_batch()`` since
  the previous step (one step's worth whether it records before or after ``step()``, plus any
  batch it skipped without a step), or ``backward_passes_per_step`` batches when it has not
  acknowledged any yet. ``record_batch()`` itself moves nothing, so it may sit before or after
  ``optimizer.step()``. An :class:`~state.ElasticStream` (an ``IterableDataset``) is linked the same
  way: a step consumes its ``world * batch_size`` items. A rank's applied steps and its sampler's
  position therefore agree at every point outside the apply itself: wherever a collective of
  the training loop fails (a gradient bucket, the step's check, a flag or a loss allreduce of
  the user's own), the rank's state is whole, and the ring continues from the newest live
  state: the step in flight, and only it, is redone (:mod:`state.recovery`).
* **Joins, drains and stops at the next step.** The optimizer's per-step check carries one
  more flag: "a notice from the driver waits on this rank" (:mod:`state.membership`). After a
  step in which any rank had one, every rank commits before the model's next training forward
  (or at the next step's first gradient): the commit's agreement raises ``MembershipChanged``
  (or ``TrainingStopped``) on every rank, the ring re-forms and the survivors hand their live
  state to the joiners. No ``state.commit()`` of the user's is needed for that. A notice that
  asks only for a durable write (the driver's just-in-time write before a preemption deadline)
  commits there, hands the commit to the writer, and the ring trains on.
* **A constant global batch.** With ``ElasticSampler(global_batch_size=G)`` the optimizer runs
  ``sampler.batches_per_step`` backward passes per step (set at every re-form), weights each
  pass by its share of the step's samples (``sampler.pass_share``), and accumulates: the loop
  calls ``zero_grad()``, backward and ``step()`` once per micro-batch as a plain loop does, and
  ``step()`` applies once per global step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from elastic_ring.core.log import get_logger

from . import membership
from .samplers.sampler import ElasticSampler
from .samplers.stream import ElasticStream

_log = get_logger(__name__)


def is_distributed_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) and hasattr(value, "add_step_listener")


def notice_waits() -> bool:
    """This rank holds a driver notice for the current round (a change, a stop, or a write asked for alone) to act
    on at a step boundary."""
    notice = membership.pending()
    return notice.change or notice.stop or notice.persist


class StepLink:
    """Links one DistributedOptimizer to its state: step boundaries always, the sampler when there is one.

    One link per optimizer: a second State over the same optimizer is refused (its listener would advance
    the sampler twice per step, and closing either link would undo the other's boundary).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sampler: ElasticSampler | ElasticStream | None,
                 modules: list[torch.nn.Module], at_boundary: Callable[[], None]) -> None:
        owner = getattr(optimizer, "_er_step_link", None)
        if owner is not None:
            raise ValueError(
                "this DistributedOptimizer already belongs to another State (its steps advance that state's "
                "sampler and act on its step boundaries); keep one State per optimizer"
            )
        self.optimizer, self.sampler = optimizer, sampler
        optimizer._er_step_link = self
        optimizer.add_step_listener(self._on_step)
        optimizer.add_reduced_listener(self._on_reduced)
        optimizer.set_step_boundary(notice_waits, at_boundary)
        if sampler is not None:
            if sampler.global_batch_size is not None:
                optimizer.set_pass_shares(sampler.pass_share)
                optimizer.set_accumulate_in_step(True)
            sampler._link(True)
            sampler._before_new_epoch = optimizer._settle_skipped
            sampler._on_repartition = self.fit_ring
        self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in modules]
        self._modules = [id(m) for m in modules]
        self.fit_ring()

    def matches(self, optimizer: Any, sampler: Any, modules: list[torch.nn.Module]) -> bool:
        return optimizer is self.optimizer and sampler is self.sampler and [id(m) for m in modules] == self._modules

    def _on_reduced(self) -> None:
        if self.sampler is not None:
            self.sampler._note_reduced()

    def _on_step(self, passes: int, applied: bool) -> None:
        if self.sampler is not None:
            self.sampler._advance(passes, skipped=not applied)
            self.fit_ring()  # the next step may have another number of micro-batches (an epoch's folded tail)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.optimizer.boundary_due and module.training and torch.is_grad_enabled():
            self.optimizer.run_boundary()

    def fit_ring(self) -> None:
        """The optimizer runs as many backward passes per step as the sampler's next step has (global batch)."""
        sampler = self.sampler
        if sampler is not None and sampler.global_batch_size is not None:
            if self.optimizer.backward_passes_per_step != sampler.batches_per_step:
                self.optimizer._discard_step()  # between steps, or a re-form discarded the step in flight anyway
                self.optimizer.set_backward_passes_per_step(sampler.batches_per_step)

    def close(self) -> None:
        optimizer = self.optimizer
        optimizer.remove_step_listener(self._on_step)
        optimizer.remove_reduced_listener(self._on_reduced)
        optimizer.set_step_boundary(None, None)
        optimizer._er_reducer.boundary_due = False
        if self.sampler is not None:
            if self.sampler.global_batch_size is not None:
                optimizer.set_pass_shares(None)
                optimizer.set_accumulate_in_step(False)
            self.sampler._link(False)
            self.sampler._before_new_epoch = None
            self.sampler._on_repartition = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if getattr(optimizer, "_er_step_link", None) is self:
            optimizer._er_step_link = None
