"""ElasticSampler: a batch sampler that processes every sample of an epoch exactly once,
across world-size changes and rollbacks.

Use it as a DataLoader's ``batch_sampler`` and record each batch after training on it::

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
epoch's permutation are done) and ``step`` (batches the ring recorded since the
job began). It publishes them as this process's progress
(:func:`elastic_ring.set_progress`: log lines and ``er.report`` records). After a restore or a resize the rest of the
epoch is re-partitioned over the new ring (see :mod:`state.sampler_layout`).
Every rank gets the same number of batches; the last batch of an epoch can be
larger than ``batch_size`` (the tail is folded into it), and it is empty on
some ranks only when fewer samples than ranks remain. All ranks must use the
same ``batch_size``.
"""

from __future__ import annotations

from typing import Iterator, Sized

import torch

import elastic_ring as er

from elastic_ring.validation import check_bool, check_int, is_int

from .sampler_layout import share, step_sizes


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset: Sized | int, batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if is_int(dataset):
            size = dataset
        elif isinstance(dataset, bool) or not hasattr(dataset, "__len__"):
            raise ValueError(f"ElasticSampler dataset={dataset!r} must be a dataset with len() or its size as an int")
        else:
            size = len(dataset)
        check_int("ElasticSampler", "dataset size", size, minimum=0)
        check_int("ElasticSampler", "batch_size", batch_size, minimum=1)
        check_bool("ElasticSampler", "shuffle", shuffle)
        check_int("ElasticSampler", "seed", seed, minimum=0, hint="the same seed on every rank gives the same order")
        self.num_samples = size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed = 0
        self.step = 0
        self.reset()

    # ------------------------------------------------------------ layout
    def reset(self, rank: int | None = None, world: int | None = None) -> None:
        """Re-partition the rest of the epoch over the current ring (after a resize or restore).

        ``rank`` and ``world`` default to the current ring's (0 and 1 without a ring).
        """
        comm = er.runtime.current_or_none()
        if rank is None or world is None:
            rank, world = (comm.rank, comm.size) if comm is not None else (0, 1)
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} is not in 0..{world - 1}")
        self._rank, self._world = rank, world
        self._base = self.processed
        self._steps_done = 0
        self._sizes = step_sizes(self.num_samples - self._base, self._world, self.batch_size)
        self._publish()

    def _publish(self) -> None:
        er.set_progress(step=self.step, epoch=self.epoch, samples=self.epoch * self.num_samples + self.processed)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        check_int("ElasticSampler.set_epoch", "epoch", epoch, minimum=0)
        self.epoch = epoch
        self.processed = 0
        self.reset(self._rank, self._world)

    def record_batch(self) -> None:
        """Mark this rank's next batch (and so the ring's next step) as processed."""
        if self._steps_done >= len(self._sizes):
            raise RuntimeError(
                f"record_batch() called {self._steps_done + 1} times, but this epoch had only "
                f"{len(self._sizes)} batches left; call set_epoch() to start the next epoch"
            )
        self.processed += self._sizes[self._steps_done]
        self._steps_done += 1
        self.step += 1
        self._publish()

    @property
    def steps_recorded(self) -> int:
        """Batches recorded since the last re-partition."""
        return self._steps_done

    # ------------------------------------------------------------ iteration
    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._permutation()
        position = self._base + sum(self._sizes[: self._steps_done])
        for size in self._sizes[self._steps_done:]:
            offset, count = share(size, self._world, self._rank)
            yield order[position + offset : position + offset + count].tolist()
            position += size

    def __len__(self) -> int:
        return len(self._sizes) - self._steps_done

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "step": self.step, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_samples']} samples (seed {state['seed']}, "
                f"shuffle {state['shuffle']}), this sampler has {self.num_samples} (seed {self.seed}, "
                f"shuffle {self.shuffle}); build the sampler as the job that saved it did"
            )
        self.epoch = state["epoch"]
        self.processed = state["processed"]
        self.step = state.get("step", 0)
        self.reset(self._rank, self._world)  # the partition follows the ring only in reset() (on re-forming)
