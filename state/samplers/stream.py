"""ElasticStream: an ``IterableDataset`` trained exactly once per epoch, across world-size changes.

A stream has no length and no index, so it cannot be split the way :class:`~state.ElasticSampler`
splits a dataset. Instead every rank reads the *same* stream, and each optimizer step consumes the
next ``world * batch_size`` items of it, rank ``r`` taking its contiguous share (the layout of
:mod:`state.samplers.sampler_layout`: a tail smaller than one step is folded into the last step). The
position is one integer, ``processed`` (items of the epoch consumed by the whole ring), so a
resize re-cuts the rest of the epoch exactly, and the state links it to the optimizer's steps as it
links a sampler (:mod:`state.step_link`)::

    stream = ElasticStream(dataset, batch_size=32)
    state = TorchState(model=model, optimizer=opt, stream=stream, epoch=0)

    @er.elastic.run
    def loop(state):
        while state.epoch < epochs:
            for x, y in state.stream:           # this rank's share of each step, collated
                train_step(x, y)                 # ... opt.step()
                state.stream.record_batch()
            state.epoch += 1
            state.stream.set_epoch(state.epoch)
            state.commit()

**Cost:** every rank reads every item of the stream (``world`` times the reading of one rank) and
keeps at most two steps of items in memory.

**What the dataset must do.** Its position must be savable: ``state_dict()`` returns where its
current pass is, and ``load_state_dict(state)`` makes the *next* ``iter()`` resume there (the
``Stateful`` protocol of torchdata's ``StatefulDataLoader``); a later ``iter()`` is a new pass from
the start. Every ``iter()`` is one epoch, and what a pass yields must depend only on that state and
on ``set_epoch(epoch)``, which is called before every pass when the dataset has it (so every rank,
joiners included, reads the same items). The state must be plain values (numbers, strings, lists,
dicts, tensors): it travels in the sync and in durable checkpoints. An ``IterableDataset`` without
``state_dict`` / ``load_state_dict`` is refused.

**Seeking.** The stream keeps the dataset's ``state_dict()`` taken at the step boundary it has
reached (taken as it reads; nothing is re-read). A restore, a sync (a joiner) or a resumed checkpoint
loads it into the dataset and the next pass starts exactly at ``processed``; a resize drops the
items read ahead and seeks the same way. (Were no state kept for a position, the pass would be read
from its start and the first ``processed`` items skipped, with a warning.)
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

import elastic_ring as er
from elastic_ring.core.progress import set_progress
from elastic_ring.core.validation import check_bool, check_int

from elastic_ring.core.log import get_logger

from .sampler_layout import ring_position, share

_log = get_logger(__name__)

_NOT_STATEFUL = (
    "ElasticStream needs a dataset whose position can be saved: {what} has no {missing}. Give it state_dict() "
    "(where its current pass is) and load_state_dict(state) (the next iter() resumes there), as torchdata's "
    "StatefulDataLoader expects of its datasets; or use a map-style dataset (with len() and [i]) with ElasticSampler"
)


def check_stateful(dataset: Any) -> None:
    """TypeError unless ``dataset`` is iterable and has callable ``state_dict`` and ``load_state_dict``."""
    if not hasattr(dataset, "__iter__"):
        raise TypeError(f"ElasticStream dataset={dataset!r} is not iterable; give it an IterableDataset")
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(dataset, m, None))]
    if missing:
        raise TypeError(_NOT_STATEFUL.format(what=type(dataset).__name__, missing=" or ".join(missing)))


class ElasticStream:
    """This rank's batches of a stateful ``IterableDataset`` (module docstring); iterate it directly.

    ``collate_fn`` (default torch's ``default_collate``) turns a rank's list of items into its batch.
    A rank's share is empty only when fewer items than ranks remain in the epoch (its last step); it
    still gets a batch for that step, so every rank runs the same steps: with the default collate, an
    empty batch of the step's structure (every tensor with 0 rows, see :func:`empty_batch`); a
    ``collate_fn`` of the user's gets ``[]``."""

    global_batch_size = None  # the step link's question: a stream's steps are world * batch_size items
    batches_per_step = 1

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Callable[[list], Any] | None = None) -> None:
        check_stateful(dataset)
        check_int("ElasticStream", "batch_size", batch_size, minimum=1)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"ElasticStream collate_fn={collate_fn!r} must be a function of a list of items")
        self.dataset, self.batch_size = dataset, batch_size
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self.processed = 0   # items of this epoch consumed by the whole ring
        self.step = 0        # optimizer steps of the ring since the job began
        self._resume: Any = None  # the dataset's state_dict() after exactly `processed` items (None at 0)
        self._linked = False
        self._held_by_state = False  # a State holds it (set by State.__setattr__)
        self._before_new_epoch: Callable[[], None] | None = None
        self._on_repartition: Callable[[], None] | None = None
        self._reader: _Reader | None = None
        self._layout = 0     # bumped by every re-partition: an iteration of an older one stops
        self._ran_out = (-1, 0)  # (layout, position) where an iteration reached the end of the epoch
        self.reset()

    # ------------------------------------------------------------ layout
    def reset(self, rank: int | None = None, world: int | None = None) -> None:
        """Re-cut the rest of the epoch for the current ring (after a resize, restore or sync)."""
        rank, world = ring_position(rank, world)
        self._rank, self._world = rank, world
        self._reader = None  # items read ahead were cut for the old ring: the next pass seeks to `processed`
        self._layout += 1
        self._sizes: dict[int, int] = {}  # start position -> items, of steps yielded and not yet consumed
        self._acks = self._acks_counted = self._acks_at_reduce = 0
        self._publish()
        if self._on_repartition is not None:
            self._on_repartition()

    def _publish(self) -> None:
        set_progress(step=self.step, epoch=self.epoch, samples=self.processed)

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``: the current one keeps its progress, a later one starts a new pass of the dataset."""
        check_int("ElasticStream.set_epoch", "epoch", epoch, minimum=0)
        if epoch == self.epoch:
            return
        if epoch < self.epoch and (self.processed or self.step):
            raise ValueError(f"ElasticStream.set_epoch({epoch}): the stream is already at epoch {self.epoch}; epochs "
                             "only move forward (after a recovery, take the epoch from state.stream.epoch)")
        if self._before_new_epoch is not None:
            self._before_new_epoch()
        self.epoch, self.processed, self._resume = epoch, 0, None
        self.reset(self._rank, self._world)

    # ------------------------------------------------------------ consuming steps
    def record_batch(self) -> None:
        """Mark this rank's batch of the current step as processed (linked mode: only acknowledge it)."""
        if self._linked:
            self._acks += 1
            return
        self._consume(1)

    def _link(self, linked: bool = True) -> None:
        check_bool("ElasticStream._link", "linked", linked)
        self._linked = linked
        self._acks = self._acks_counted = self._acks_at_reduce = 0

    def _note_reduced(self) -> None:
        self._acks_at_reduce = self._acks

    def _advance(self, passes: int, skipped: bool = False) -> None:
        """An optimizer step consumed the steps the loop acknowledged since the previous one (else ``passes``)."""
        check_int("ElasticStream._advance", "passes", passes, minimum=0)
        upto = min(self._acks_at_reduce, self._acks) if skipped else self._acks
        window = upto - self._acks_counted
        self._acks_counted = max(self._acks_counted, upto)
        self._consume(window if window > 0 else passes, optimizer_step=True)

    def _consume(self, steps: int, optimizer_step: bool = False) -> None:
        reader = self._reader
        for _ in range(steps):
            size = self._sizes.pop(self.processed, None)
            if size is None:
                break  # nothing yielded there (the epoch ended, or the loop stepped without a batch)
            self.processed += size
            self._resume = reader.states.pop(self.processed, None) if reader is not None else None
            if reader is not None:
                reader.forget_before(self.processed)
            if not optimizer_step:
                self.step += 1
        if optimizer_step:
            self.step += 1
        self._publish()

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        """This rank's batches of the rest of the epoch, one per step (RuntimeError if an earlier iteration already
        reached the epoch's end and ``set_epoch`` was not called since)."""
        layout, end = self._ran_out
        if layout == self._layout and self.processed >= end:
            raise RuntimeError(
                f"ElasticStream: epoch {self.epoch} is over (an earlier iteration reached its end) and set_epoch() "
                f"was not called since; the epoch is part of the stream's saved position, so iterating again does "
                f"not start a new one: call state.stream.set_epoch(epoch + 1) after each epoch")
        return self._steps()

    def _steps(self) -> Iterator[Any]:
        layout, per_step = self._layout, self._world * self.batch_size
        if self._reader is None or self._reader.cursor != self.processed:
            self._reader = _Reader(self.dataset, self.epoch, self.processed, self._resume)
        reader, cursor = self._reader, self.processed
        while True:
            if layout != self._layout:
                raise RuntimeError("the ElasticStream was re-partitioned (the ring re-formed, or its state was "
                                   "loaded) while this loop iterated it; iterate it again")
            reader.fill(cursor + 2 * per_step, boundaries=(cursor + per_step, cursor + 2 * per_step))
            available = reader.end - cursor
            if available == 0:
                self._ran_out = (layout, cursor)
                return
            size = available if reader.exhausted and available < 2 * per_step else per_step
            self._sizes[cursor] = size
            offset, count = share(size, self._world, self._rank)
            items = reader.items(cursor + offset, count)
            template = reader.items(cursor, 1) if not items and self.collate_fn is default_collate else None
            cursor += size
            reader.cursor = cursor
            yield empty_batch(default_collate(template)) if template else self.collate_fn(items)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "step": self.step, "dataset": self._resume}

    def load_state_dict(self, state: dict) -> None:
        for key in ("epoch", "processed", "step"):
            check_int("ElasticStream.load_state_dict", key, state.get(key), minimum=0)
        if state["processed"] and state.get("dataset") is None:
            raise ValueError(f"ElasticStream state at item {state['processed']} of epoch {state['epoch']} holds no "
                             "dataset state to seek with; it was not saved by an ElasticStream")
        self.epoch, self.processed, self.step = state["epoch"], state["processed"], state["step"]
        self._resume = state.get("dataset")
        self.reset(self._rank, self._world)


def _leaf_list(value: Any) -> bool:
    """A collated column of plain values (``default_collate`` keeps strings as the list or tuple of them)."""
    return (isinstance(value, (list, tuple)) and not hasattr(value, "_fields")
            and all(not isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value))


def empty_batch(batch: Any) -> Any:
    """``batch`` (``default_collate`` of one item) with 0 rows: each tensor sliced to ``[:0]``, each list of
    strings (or other plain values) empty, dicts and sequences kept with their keys and fields."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        emptied = {k: empty_batch(v) for k, v in batch.items()}
        return emptied if type(batch) is dict else type(batch)(emptied)
    if _leaf_list(batch):
        return type(batch)()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(empty_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_batch(v) for v in batch)
    return batch


class _Reader:
    """One pass of the dataset from a saved position: the items read and not yet consumed, and the
    dataset's ``state_dict()`` at the step boundaries reached (taken right after that many items)."""

    def __init__(self, dataset: Any, epoch: int, start: int, resume: Any) -> None:
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if start and resume is not None:
            dataset.load_state_dict(copy.deepcopy(resume))
        self.dataset, self.start, self.end, self.cursor = dataset, start, start, start
        self._iterator = iter(dataset)
        if start and resume is None:  # no state saved at this position (never expected): replay the pass to it
            _log.warning("ElasticStream: no dataset state at item %d of epoch %d; reading the pass from its start "
                         "and skipping %d items", start, epoch, start)
            for _ in range(start):
                next(self._iterator)
        self._items: collections.deque = collections.deque()  # positions [self.start, self.end)
        self.states: dict[int, Any] = {}
        self.exhausted = False

    def fill(self, upto: int, boundaries: tuple[int, ...]) -> None:
        """Read until ``upto`` items of the epoch were read or the pass ended, noting the dataset's state at
        ``boundaries`` (and at the pass's end)."""
        while self.end < upto and not self.exhausted:
            try:
                item = next(self._iterator)
            except StopIteration:
                self.exhausted = True
                self.states.setdefault(self.end, copy.deepcopy(self.dataset.state_dict()))
                return
            self._items.append(item)
            self.end += 1
            if self.end in boundaries:
                self.states[self.end] = copy.deepcopy(self.dataset.state_dict())

    def items(self, position: int, count: int) -> list:
        first = position - self.start
        return [self._items[first + i] for i in range(count)]

    def forget_before(self, position: int) -> None:
        while self.start < position and self._items:
            self._items.popleft()
            self.start += 1
        for stale in [p for p in self.states if p < position]:
            del self.states[stale]
