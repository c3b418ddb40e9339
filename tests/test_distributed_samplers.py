"""torch DistributedSampler inside an elastic loop: re-pointed at the current ring before every run of the loop."""

import os
import signal
import uuid

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elastic_ring as er
from elastic_ring.distributed_samplers import retarget, retarget_reachable
from state import ObjectState
from tests.local_rendezvous import StoreRendezvous

DATA = TensorDataset(torch.arange(23))


def indices(sampler):
    return list(iter(sampler))


def test_retarget_splits_as_a_sampler_built_for_the_new_ring():
    for drop_last in (False, True):
        old = DistributedSampler(DATA, num_replicas=3, rank=2, shuffle=True, seed=5, drop_last=drop_last)
        assert retarget(old, 1, 2)
        fresh = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=drop_last)
        assert indices(old) == indices(fresh) and len(old) == len(fresh)
        assert not retarget(old, 1, 2)  # already right


_module_loader = DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=4, rank=3))


def test_samplers_reachable_from_the_loop_are_found_in_arguments_closures_and_globals():
    closed = DistributedSampler(DATA, num_replicas=4, rank=0)
    as_argument = DistributedSampler(DATA, num_replicas=4, rank=1)

    def loop(state, sampler):
        return closed, _module_loader

    assert retarget_reachable(loop, (None, as_argument), {}, 0, 2) == 3
    assert (closed.num_replicas, as_argument.num_replicas, _module_loader.sampler.num_replicas) == (2, 2, 2)
    on_rank0 = DistributedSampler(DATA, num_replicas=1, rank=0)  # another split, on purpose
    assert retarget_reachable(loop, (None, as_argument, on_rank0), {}, 1, 3, previous=(0, 2)) == 3
    assert (closed.num_replicas, closed.rank, on_rank0.num_replicas) == (3, 1, 1)


def _job(host, port, job):
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=[2]))
    first_rank = er.rank()
    sampler = DistributedSampler(DATA, num_replicas=er.size(), rank=er.rank(), shuffle=False)
    loader = DataLoader(DATA, batch_size=100, sampler=sampler)
    on_rank0 = DistributedSampler(DATA, num_replicas=1, rank=0)  # built for another split on purpose
    state = ObjectState(rounds=0)
    seen = []

    @er.elastic.run
    def loop(state):
        (batch,) = next(iter(loader))
        covered = er.allgather_object(sorted(batch.tolist()))
        if first_rank == 2 and not seen:
            os.kill(os.getpid(), signal.SIGKILL)
        er.allreduce(torch.ones(1))  # the survivors notice the death here
        seen.append((er.size(), sorted(sum(covered, []))))
        assert (on_rank0.num_replicas, on_rank0.rank) == (1, 0)
        return seen

    return loop(state)


def test_a_resize_re_points_the_loops_distributed_sampler(ring):
    job = f"ds-{uuid.uuid4().hex[:6]}"
    results = ring.start(_job, "127.0.0.1", ring.address.port, job).results(timeout_s=60, raise_errors=False)
    survivors = [r for r in results if isinstance(r, list)]
    assert len(survivors) == 2, results
    for seen in survivors:
        world, covered = seen[-1]
        assert world == 2 and covered == sorted(list(range(23)) + [0]), seen  # 23 samples over 2 ranks, padded by one
