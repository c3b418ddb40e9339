"""hvd.elastic.ElasticSampler: Horovod's sampler API (``sampler=`` with ``batch_size=``, ``record_batch(idx, size)``),
kept exactly once per epoch by hvd.elastic.TorchState across a SIGKILL and a re-form."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import elastic_ring as er
import ray_integration.horovod as hvd
from state.handlers import StateDictHandler
from tests.local_rendezvous import StoreRendezvous

N, B, EPOCHS = 41, 3, 2
DATA = TensorDataset(torch.arange(N))


# ------------------------------------------------------------------ one process
def test_len_and_iteration_split_the_epoch_with_horovods_padding():
    sampler = hvd.elastic.ElasticSampler(DATA, shuffle=False)
    assert len(sampler) == N and list(sampler) == list(range(N))
    shuffled = hvd.elastic.ElasticSampler(DATA, shuffle=True, seed=5)
    assert sorted(shuffled) == list(range(N)) and list(shuffled) != list(range(N))
    assert list(hvd.elastic.ElasticSampler(DATA, seed=5)) == list(shuffled)  # same seed, same order everywhere
    loader = DataLoader(DATA, batch_size=B, sampler=shuffled)  # Horovod's way: sampler= with batch_size=
    assert len(loader) == -(-N // B) and sorted(int(i) for (x,) in loader for i in x) == list(range(N))


def test_record_batch_shrinks_the_rest_of_the_epoch_after_a_reset_and_set_epoch_starts_over():
    sampler = hvd.elastic.ElasticSampler(DATA, shuffle=True, seed=1)
    order = list(sampler)
    sampler.record_batch(0, B)
    sampler.record_batch(1, B)
    assert len(sampler) == N  # constant until the next reset, as Horovod's
    assert sampler.processed_indices == set(order[: 2 * B]) and sampler.processed_num == 2 * B
    sampler.reset()
    assert len(sampler) == N - 2 * B and list(sampler) == order[2 * B:]
    sampler.record_indices([order[-1]])
    sampler.reset()
    assert list(sampler) == order[2 * B: -1]
    sampler.set_epoch(0)  # the current epoch: its progress stays
    assert len(sampler) == N - 2 * B - 1
    sampler.set_epoch(1)
    assert len(sampler) == N and sampler.processed_num == 0 and sorted(sampler) == list(range(N))
    assert list(sampler) != order  # a new epoch, a new order
    with pytest.raises(ValueError):
        sampler.record_indices([N])
    with pytest.raises(ValueError):
        sampler.record_batch(-1, B)


def test_state_dict_round_trips_and_refuses_another_dataset():
    sampler = hvd.elastic.ElasticSampler(DATA, seed=2)
    sampler.set_epoch(3)
    sampler.record_batch(0, 4)
    saved = sampler.state_dict()
    other = hvd.elastic.ElasticSampler(DATA, seed=2)
    other.load_state_dict(saved)
    assert other.epoch == 3 and other.processed_indices == sampler.processed_indices and len(other) == N - 4
    with pytest.raises(ValueError, match="dataset of 41"):
        hvd.elastic.ElasticSampler(10, seed=2).load_state_dict(saved)


def test_torch_state_keeps_the_sampler_object_across_commit_and_restore():
    sampler = hvd.elastic.ElasticSampler(DATA, seed=0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
    assert isinstance(state._handlers["train_sampler"], StateDictHandler)
    sampler.record_batch(0, B)
    state.commit()
    state.check_host_updates()  # no ring, no pending change: nothing to do
    sampler.record_batch(1, B)
    state.restore()
    assert state.train_sampler is sampler and sampler.processed_num == B and len(sampler) == N - B


def test_a_batch_size_names_the_batch_sampler_as_the_fix():
    for build in (lambda: hvd.elastic.ElasticSampler(DATA, batch_size=4),
                  lambda: hvd.elastic.ElasticSampler(DATA, global_batch_size=8),
                  lambda: hvd.elastic.ElasticSampler(DATA, 4, True, 0), lambda: hvd.elastic.ElasticSampler(DATA, 4)):
        with pytest.raises(TypeError, match=r"takes no batch size.*state\.ElasticSampler\(dataset, batch_size"):
            build()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['drop_last'\]"):
        hvd.elastic.ElasticSampler(DATA, drop_last=True)
    assert type(hvd.elastic.ElasticSampler(DATA, True, 0)) is hvd.elastic.ElasticSampler
    assert not hasattr(hvd.elastic, "StepElasticSampler")


# ------------------------------------------------------------------ a ring that loses a rank
def _horovod_loop_job(host, port, job, commit_every):
    """Horovod's elastic loop, only the import changed. ``state.counts`` is the "model": every step adds,
    over the ring, how often each sample was trained on (the padding Horovod repeats at a split's end left
    out), so it holds exactly what the committed / live training state saw."""
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=[2]))
    first_rank = er.rank()
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = hvd.elastic.ElasticSampler(DATA, shuffle=True, seed=0)
    loader = DataLoader(DATA, batch_size=B, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0,
                                   counts=torch.zeros(EPOCHS, N), worlds=[])

    @hvd.elastic.run
    def train(state):
        state.worlds = state.worlds + [er.size()]
        while state.epoch < EPOCHS:
            s = state.train_sampler
            real = len(s.remaining_indices)  # padded positions at or beyond it repeat earlier samples
            for batch_idx, (x,) in enumerate(loader):
                if first_rank == 2 and er.size() == 3 and state.epoch == 0 and batch_idx == 4:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch: the others fail in the allreduce below
                seen = torch.zeros(N)
                for j, i in enumerate(x.tolist()):
                    if s.rank + (batch_idx * B + j) * s.num_replicas < real:
                        seen[i] += 1
                state.counts[state.epoch] += er.allreduce(seen, op=er.Sum)
                state.train_sampler.record_batch(batch_idx, B)
                state.batch = batch_idx
                if batch_idx % commit_every == commit_every - 1:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch)
            state.commit()
        return state.worlds, state.counts.tolist()

    return train(state)


@pytest.mark.parametrize("commit_every", [3, 1])
def test_every_sample_is_trained_once_per_epoch_when_a_rank_is_killed_mid_epoch(ring, commit_every):
    job = f"hvs-{uuid.uuid4().hex[:6]}"
    results = ring.start(_horovod_loop_job, "127.0.0.1", ring.address.port, job, commit_every).results(
        timeout_s=90, raise_errors=False)
    assert getattr(results[2], "type_name", None) == "ProcessDied", results
    for worlds, counts in results[:2]:
        assert worlds == [3, 2], worlds  # the survivors re-formed at 2 ranks
        for epoch in range(EPOCHS):
            assert counts[epoch] == [1.0] * N, (epoch, counts[epoch])
