"""ElasticSampler: a batch sampler that processes every sample of an epoch exactly once,
across world-size changes and rollbacks.

Use it as a DataLoader's ``batch_sampler`` (passing it as ``sampler=`` raises
TypeError: torch would yield batches of batches) and record each batch after training on it::

    sampler = ElasticSampler(dataset, batch_size=32, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @er.elastic.run
    def loop(state):
        while state.epoch < epochs:
            for x, y in loader:                 # this rank's rest of the epoch
                train_step(x, y)
                state.sampler.record_batch()    # after the optimizer step
                if state.sampler.steps_recorded % 10 == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

Its state is tiny: ``epoch``, ``processed`` (how many positions of the
epoch's permutation are done) and ``step`` (optimizer steps of the ring since
the job began). It publishes them as this process's progress
(:func:`elastic_ring.core.progress.set_progress`: log lines and ``er.report``
records). After a restore or a resize the rest of the epoch is re-partitioned
over the new ring (see :mod:`state.samplers.sampler_layout`).
Every rank gets the same number of batches; the last batch of an epoch can be
larger than ``batch_size`` (the tail is folded into it), and it is empty on
some ranks only when fewer samples than ranks remain. All ranks must use the
same ``batch_size``. ``len(sampler)`` is the number of batches of the current
partition (from the last ``reset()`` / ``set_epoch()`` / ``load_state_dict()``
to the epoch's end) and stays constant while batches are consumed; iterating
yields only the batches not yet consumed. ``set_epoch(e)`` with the current
epoch keeps the epoch's progress (call it at the start of every epoch, as
Horovod's examples do); epochs only move forward.

*Linked mode.* When :class:`state.State` holds the sampler and a
``DistributedOptimizer``, it links them: every optimizer step advances the
sampler (``_advance``), atomically with the optimizer's apply, by the batches
the loop acknowledged with ``record_batch()`` since the previous step (or by
the step's backward passes before any acknowledgment), so ``record_batch()``
may sit before or after ``optimizer.step()`` (see :mod:`state.step_link`).

*Constant global batch.* ``ElasticSampler(dataset, batch_size=m,
global_batch_size=G)`` makes every optimizer step process exactly ``G``
samples whatever the world size ``W``: each rank runs ``M = ceil(G / (W * m))``
micro-batches per step (``batches_per_step``, the same on every rank,
recomputed at every resize), one backward pass each, of at most ``m`` samples.
An epoch tail smaller than ``G`` is folded into the last step, which then has
more passes (the whole rest is one step if it is smaller than ``G``). Splits
can be uneven; no pass is empty on any rank unless a step has fewer samples
than ranks (with ``m = 1`` a pass may then hold 2). ``pass_share(j)`` gives
``(n_rj, S)``, this rank's samples in micro-batch ``j`` and the step's total, so
the optimizer weighs every sample by exactly ``1/S``. This needs the user's
loss to be a mean over the micro-batch (PyTorch's default
``reduction="mean"``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Iterator, Sized

import torch

import elastic_ring as er

from elastic_ring.core.progress import set_progress
from elastic_ring.core.validation import check_bool, check_int, is_int

import bisect
from typing import Callable

from .sampler_layout import global_steps, ring_position, share, step_sizes

_WRAPPED = ("ElasticSampler is a batch sampler: pass it as DataLoader(dataset, batch_sampler=sampler) (and no "
            "batch_size / shuffle / sampler / drop_last); it was passed as sampler=, which would yield batches of batches")


def check_sampler_args(dataset: Sized | int, shuffle: bool, seed: int) -> int:
    """The dataset's size, after checking what every elastic sampler takes (a dataset or its size, the order)."""
    if isinstance(dataset, torch.utils.data.IterableDataset) and not hasattr(dataset, "__len__"):
        raise TypeError(f"ElasticSampler needs a dataset with len() and [i]; {type(dataset).__name__} is an "
                        "IterableDataset: use state.ElasticStream(dataset, batch_size) instead (its position must be "
                        "savable: state_dict() / load_state_dict(), as torchdata's StatefulDataLoader expects)")
    if is_int(dataset):
        size = dataset
    elif isinstance(dataset, bool) or not hasattr(dataset, "__len__"):
        raise ValueError(f"ElasticSampler dataset={dataset!r} must be a dataset with len() or its size as an int")
    else:
        size = len(dataset)
    check_int("ElasticSampler", "dataset size", size, minimum=0)
    check_bool("ElasticSampler", "shuffle", shuffle)
    check_int("ElasticSampler", "seed", seed, minimum=0, hint="the same seed on every rank gives the same order")
    return size


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset: Sized | int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 global_batch_size: int | None = None) -> None:
        size = check_sampler_args(dataset, shuffle, seed)
        check_int("ElasticSampler", "batch_size", batch_size, minimum=1)
        if global_batch_size is not None:
            check_int("ElasticSampler", "global_batch_size", global_batch_size, minimum=1,
                      hint="the samples of one optimizer step over the whole ring, or None for batch_size per rank")
        self.num_samples = size
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed = 0
        self.step = 0
        self._linked = False
        self._held_by_state = False  # a State holds it (set by State.__setattr__)
        #: Called before a new epoch starts (the step link settles a step the optimizer reduced and skipped).
        self._before_new_epoch: Callable[[], None] | None = None
        #: Called after every re-partition (the step link sizes the optimizer's next step for it).
        self._on_repartition: Callable[[], None] | None = None
        self.reset()

    # ------------------------------------------------------------ layout
    def reset(self, rank: int | None = None, world: int | None = None) -> None:
        """Re-partition the rest of the epoch over the current ring (after a resize or restore).

        ``rank`` and ``world`` default to the current ring's (0 and 1 without a ring).
        """
        rank, world = ring_position(rank, world)
        self._rank, self._world = rank, world
        self._base = self.processed
        self._done = 0   # batches consumed since this re-partition
        self._acks = 0   # record_batch() calls since this re-partition (linked mode)
        self._acks_counted = 0  # acks already accounted for by an optimizer step (linked mode)
        self._acks_at_reduce = 0  # acks when the last step's reduction completed (linked mode)
        remaining, g = self.num_samples - self._base, self.global_batch_size
        if g is None:
            self._sizes = step_sizes(remaining, world, self.batch_size)
            self._starts = list(range(len(self._sizes) + 1))
        else:
            steps = global_steps(remaining, world, self.batch_size, g)
            self._sizes = [chunk for step in steps for chunk in step]
            self._starts = [0]
            for step in steps:
                self._starts.append(self._starts[-1] + len(step))
        self._publish()
        if self._on_repartition is not None:
            self._on_repartition()

    def _step_span(self) -> tuple[int, int]:
        """``[first, end)`` entries of the step that holds the next unconsumed batch (empty at the epoch's end)."""
        k = bisect.bisect_right(self._starts, self._done) - 1
        if k >= len(self._starts) - 1:
            return len(self._sizes), len(self._sizes)
        return self._starts[k], self._starts[k + 1]

    def _publish(self) -> None:
        set_progress(step=self.step, epoch=self.epoch, samples=self.epoch * self.num_samples + self.processed)

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``: the current one keeps its progress, a later one starts from its beginning."""
        check_int("ElasticSampler.set_epoch", "epoch", epoch, minimum=0)
        if epoch == self.epoch:
            return
        if epoch < self.epoch and (self.processed or self.step):
            raise ValueError(
                f"ElasticSampler.set_epoch({epoch}): the sampler is already at epoch {self.epoch}; epochs only "
                f"move forward (after a recovery, take the epoch from state.sampler.epoch) — build a new sampler "
                f"to start over"
            )
        if self._before_new_epoch is not None:
            self._before_new_epoch()  # a step reduced and then skipped still belongs to the epoch it trained
        self.epoch = epoch
        self.processed = 0
        self.reset(self._rank, self._world)

    @property
    def batches_per_step(self) -> int:
        """Micro-batches per rank in the next optimizer step: with a global batch size ``M`` (more in the epoch's
        last step when a tail was folded into it), else 1."""
        if self.global_batch_size is None:
            return 1
        first, end = self._step_span()
        return max(1, end - first)

    @property
    def _consumed(self) -> int:
        """Yielded batches consumed since the last re-partition."""
        return self._done

    def record_batch(self) -> None:
        """Mark this rank's next batch as processed (linked mode: only acknowledge it; the optimizer advances)."""
        count = self._acks if self._linked else self._done
        if count >= len(self._sizes):
            raise RuntimeError(
                f"record_batch() called {count + 1} times, but this epoch had only "
                f"{len(self._sizes)} batches left; call set_epoch() to start the next epoch"
            )
        if self._linked:
            self._acks += 1
            return
        end = self._step_span()[1]
        self.processed += self._sizes[self._done]
        self._done += 1
        if self._done == end:
            self.step += 1
        self._publish()

    @property
    def steps_recorded(self) -> int:
        """Batches consumed since the last re-partition."""
        return self._done

    def _link(self, linked: bool = True) -> None:
        """Enter (or leave) linked mode: the optimizer's steps advance the position (see ``_advance``)."""
        check_bool("ElasticSampler._link", "linked", linked)
        self._linked, self._acks, self._acks_counted = linked, self._done, self._done
        self._acks_at_reduce = self._done

    def _note_reduced(self) -> None:
        """A step's reduction completed: acknowledgments until now belong to it, even if it is skipped."""
        self._acks_at_reduce = self._acks

    def _advance(self, passes: int, skipped: bool = False) -> None:
        """An optimizer step of ``passes`` backward passes was consumed (applied, or reduced and skipped).

        With a global batch size it consumes the current global step. Otherwise it consumes the batches the loop
        acknowledged (``record_batch()``) since the previous step, when there are any: in steady state that is one
        step's batches whether the loop records before or after ``step()``, and it also counts batches the loop
        skipped without a step; with no acknowledgment yet (a loop that records after ``step()``, at a
        partition's first step, or one that never records) it consumes ``passes`` batches. A ``skipped`` step
        (reduced, then not applied: noticed later, when the loop may already have acknowledged the skipped
        batch itself) counts the acknowledgments made until its reduction completed."""
        check_int("ElasticSampler._advance", "passes", passes, minimum=0)
        upto = min(self._acks_at_reduce, self._acks) if skipped else self._acks
        if self.global_batch_size is not None:
            batches = max(0, self._step_span()[1] - self._done)
        else:
            window = upto - self._acks_counted
            batches = window if window > 0 else passes
        self._acks_counted = max(self._acks_counted, upto)
        end = min(self._done + batches, len(self._sizes))
        self.processed += sum(self._sizes[self._done:end])
        self._done = end
        self.step += 1
        self._publish()

    def pass_share(self, j: int) -> tuple[int, int]:
        """``(n_rj, S)``: this rank's samples in micro-batch ``j`` of the next unconsumed step, and the step's total."""
        first, end = self._step_span()
        if first >= end:
            raise RuntimeError(
                f"ElasticSampler.pass_share({j}): epoch {self.epoch} has no step left on this rank's partition; "
                f"call set_epoch() to start the next epoch"
            )
        check_int("ElasticSampler.pass_share", "j", j, minimum=0, maximum=end - first - 1,
                  hint=f"this step has {end - first} micro-batches (batches_per_step)")
        return share(self._sizes[first + j], self._world, self._rank)[1], sum(self._sizes[first:end])

    # ------------------------------------------------------------ iteration
    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        self._refuse_wrapping(sys._getframe(1))  # once per iteration, not per batch
        return self._batches()

    def _refuse_wrapping(self, frame: FrameType | None) -> None:
        """TypeError if a ``BatchSampler`` wraps this sampler (``DataLoader(..., sampler=ElasticSampler(...))``)."""
        for _ in range(3):
            if frame is None:
                return
            # only __iter__ frames: f_locals would keep a snapshot of a training loop's tensors alive
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "__iter__" else None
            if isinstance(owner, torch.utils.data.BatchSampler) and getattr(owner, "sampler", None) is self:
                raise TypeError(_WRAPPED)
            frame = frame.f_back

    def _batches(self) -> Iterator[list[int]]:
        order = self._permutation()
        position = self._base + sum(self._sizes[: self._done])
        for size in self._sizes[self._done:]:
            offset, count = share(size, self._world, self._rank)
            yield order[position + offset : position + offset + count].tolist()
            position += size

    def __len__(self) -> int:
        """Batches of the current partition (constant within it, whatever has been consumed)."""
        return len(self._sizes)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "step": self.step, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_samples']} samples (seed {state['seed']}, "
                f"shuffle {state['shuffle']}), this sampler has {self.num_samples} (seed {self.seed}, "
                f"shuffle {self.shuffle}); build the sampler as the job that saved it did"
            )
        saved = state.get("global_batch_size")
        if saved != self.global_batch_size:
            raise ValueError(
                f"sampler state was saved with global_batch_size={saved}, this sampler has "
                f"global_batch_size={self.global_batch_size}; build the sampler with the job's global_batch_size"
            )
        self.epoch = state["epoch"]
        self.processed = state["processed"]
        self.step = state.get("step", 0)
        self.reset(self._rank, self._world)  # the partition follows the ring only in reset() (on re-forming)
