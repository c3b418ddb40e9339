"""``hvd.elastic``: Horovod's elastic API over elastic_ring's elastic loop and ``state``.

``run`` is ``elastic_ring.ring.elastic.run``; ``State``, ``ObjectState`` and
``TorchState`` are the state layer's (``TorchState(model, optimizer, **values)``
as in Horovod, with ``commit()``, ``sync()``, ``register_reset_callbacks`` and
``check_host_updates()``), extended to keep this module's ``ElasticSampler``.

``ElasticSampler(dataset, shuffle=True, seed=0)`` is Horovod's: a sampler of
indices, used as ``DataLoader(dataset, batch_size=B, sampler=sampler)``, with
``record_batch(batch_idx, batch_size)``, ``record_indices(indices)``,
``set_epoch(epoch)``, ``state_dict()`` / ``load_state_dict()`` and ``reset()``.
Kept in a ``TorchState(..., train_sampler=sampler)``, it is saved at every
commit, restored with the state, given to every rank by ``sync()`` and re-split
over the new ring after a re-form, so every sample of an epoch is processed
once (the ring's last batch of an epoch may repeat up to ``size() - 1``
samples, Horovod's padding). elastic_ring's own exactly-once *batch* sampler,
``ElasticSampler(dataset, batch_size=B, ...)`` as ``DataLoader(ds,
batch_sampler=...)``, is ``state.ElasticSampler``: given ``batch_size``, this
one raises a ``TypeError`` that says so.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Sized

import torch

import elastic_ring as er
import state as _state
from elastic_ring.core.validation import check_int, is_int
from elastic_ring.ring import runtime
from elastic_ring.ring.elastic import run
from state.handlers import StateDictHandler
from state.samplers.sampler import check_sampler_args

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's elastic sampler: this rank's share of the samples of the epoch not processed yet.

    The epoch's order is a permutation of the dataset (``seed + epoch`` seeds it when ``shuffle``). At
    ``reset()`` the indices not yet processed, in that order, are padded by repeating the first ones to a
    multiple of ``size()`` and split with a stride: rank ``r`` gets positions ``r, r + W, r + 2W, ...``.
    ``len(sampler)`` is that share's length (the samples this rank had left at the last reset; constant
    until the next one). ``record_batch(batch_idx, batch_size)``, called by every rank after the ring's
    batch ``batch_idx`` of the current split, marks that batch of *every* rank processed (the split is the
    same on every rank, so no communication is needed: with a state's live hand-over after a failure, the
    batches of a lost rank that reached the model are counted too). ``record_indices(indices)`` marks
    this rank's own indices; they are shared with every rank at the next ``commit()`` of a ``TorchState``
    holding the sampler (an allgather; indices a lost rank recorded after its last commit are processed
    again). ``set_epoch(e)`` for a new epoch clears the progress; unlike Horovod's, ``set_epoch`` with the
    current epoch keeps it (a loop that calls it on re-entry does not process the epoch's start twice).
    """

    def __init__(self, dataset: Sized | int, shuffle: bool = True, seed: int = 0, *more: Any, **options: Any) -> None:
        if more or options or is_int(shuffle):
            _refuse_batch_sampler_args(shuffle, more, options)
        size = check_sampler_args(dataset, shuffle, seed)
        self.dataset = dataset
        self.dataset_size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._processed = torch.zeros(size, dtype=torch.bool)  # by dataset index, for the current epoch
        self._pending: set[int] = set()  # record_indices() not yet shared with the ring
        self.reset()

    # ------------------------------------------------------------ layout
    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        return torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def reset(self) -> None:
        """Split the epoch's unprocessed indices over the current ring (``er.rank()`` / ``er.size()``)."""
        comm = runtime.current_or_none()
        self.rank, self.num_replicas = (comm.rank, comm.size) if comm is not None else (0, 1)
        order = self._permutation()
        remaining = order[~self._processed[order]]
        self.remaining_indices = remaining.tolist()
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        if len(remaining) and self.total_size > len(remaining):
            repeats = math.ceil(self.total_size / len(remaining))
            remaining = remaining.repeat(repeats)[: self.total_size]
        self._padded = remaining
        self.indices = remaining[self.rank: self.total_size: self.num_replicas].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``: a new epoch starts with nothing processed; the current one keeps its progress."""
        check_int("ElasticSampler.set_epoch", "epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._processed.zero_()
            self._pending.clear()
        self.reset()

    # ------------------------------------------------------------ progress
    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark the ring's batch ``batch_idx`` (of ``batch_size`` samples per rank) of the current split processed."""
        check_int("ElasticSampler.record_batch", "batch_idx", batch_idx, minimum=0)
        check_int("ElasticSampler.record_batch", "batch_size", batch_size, minimum=1)
        start = batch_idx * batch_size * self.num_replicas
        self._processed[self._padded[start: start + batch_size * self.num_replicas]] = True

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark this rank's ``indices`` (dataset indices) processed; shared with the ring at the next commit."""
        indices = [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < self.dataset_size]
        if bad:
            raise ValueError(f"ElasticSampler.record_indices: {bad[:5]} are not indices of a dataset of "
                             f"{self.dataset_size} samples")
        self._processed[indices] = True
        self._pending.update(indices)

    def _take_pending(self) -> list[int]:
        pending, self._pending = sorted(self._pending), set()
        return pending

    def _mark(self, indices: list[int]) -> None:
        self._processed[indices] = True

    @property
    def processed_indices(self) -> set[int]:
        """The dataset indices processed in this epoch (as far as this rank knows)."""
        return set(torch.nonzero(self._processed).flatten().tolist())

    @property
    def processed_num(self) -> int:
        """How many samples of this epoch are processed."""
        return int(self._processed.sum())

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self._processed.clone(), "dataset_size": self.dataset_size,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if (state["dataset_size"], state["seed"], state["shuffle"]) != (self.dataset_size, self.seed, self.shuffle):
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_size']} samples (seed {state['seed']}, shuffle "
                f"{state['shuffle']}), this sampler has {self.dataset_size} (seed {self.seed}, shuffle "
                f"{self.shuffle}); build the sampler as the job that saved it did")
        self.epoch = state["epoch"]
        self._processed = torch.as_tensor(state["processed"], dtype=torch.bool).clone()
        self._pending.clear()
        self.reset()


def _refuse_batch_sampler_args(shuffle: Any, more: tuple, options: dict) -> None:
    """A TypeError for arguments Horovod's sampler does not take; the batch sampler's name the fix."""
    if is_int(shuffle) or {"batch_size", "global_batch_size"} & set(options) or more:
        raise TypeError("hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0) is Horovod's sampler of indices "
                        "(DataLoader(ds, batch_size=B, sampler=sampler)); it takes no batch size. For elastic_ring's "
                        "batch sampler use state.ElasticSampler(dataset, batch_size, shuffle=True, seed=0, "
                        "global_batch_size=None) as DataLoader(ds, batch_sampler=sampler)")
    raise TypeError(f"hvd.elastic.ElasticSampler got unexpected keyword arguments {sorted(options)}; it takes "
                    "(dataset, shuffle=True, seed=0)")


class _HorovodState:
    """What hvd's states add to the state layer's: keeping :class:`ElasticSampler` and ``check_host_updates``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ElasticSampler):
            if name.startswith("_") or name == "resumed_from":
                raise AttributeError(f"state value names may not start with '_' or be 'resumed_from': {name!r}")
            self._handlers[name] = StateDictHandler(value)  # restored in place: the DataLoader keeps the object
            return
        super().__setattr__(name, value)

    def _hvd_samplers(self) -> list[ElasticSampler]:
        return [h.value for h in self._handlers.values() if isinstance(h.value, ElasticSampler)]

    def commit(self) -> None:
        """Share the samplers' ``record_indices`` with every rank, then the state layer's commit."""
        samplers = self._hvd_samplers()
        if samplers:
            pending = [s._take_pending() for s in samplers]
            if er.is_initialized():
                try:
                    gathered = er.allgather_object(pending, name="hvd.elastic.ElasticSampler indices")
                except er.CommError as exc:
                    exc.live_state_consistent = True  # nothing changed yet: the live state is whole
                    raise
                for rank_pending in gathered:
                    for sampler, indices in zip(samplers, rank_pending):
                        sampler._mark(indices)
        super().commit()

    def sync(self, root_rank: int | None = None) -> None:
        if er.is_initialized():
            for sampler in self._hvd_samplers():  # a sampler built before the ring formed
                if (sampler.rank, sampler.num_replicas) != (er.rank(), er.size()):
                    sampler.reset()
        super().sync(root_rank)

    def on_reset(self) -> None:
        for sampler in self._hvd_samplers():
            sampler.reset()
        super().on_reset()

    def check_host_updates(self) -> None:
        """Horovod's check between commits: raises ``hvd.HostsUpdatedInterrupt`` (``er.MembershipChanged``) on
        every rank when the driver asked any rank for a re-form (a join, a drain), as ``commit()`` does
        (``TrainingStopped`` when the job must stop). A small collective: call it at the same point on every rank."""
        self.check_membership()


class State(_HorovodState, _state.State):
    __doc__ = _state.State.__doc__


class TorchState(_HorovodState, _state.TorchState):
    """``TorchState(model, optimizer, **values)``, as Horovod's; an :class:`ElasticSampler` value is kept too."""


class ObjectState(_HorovodState, _state.ObjectState):
    __doc__ = _state.ObjectState.__doc__
