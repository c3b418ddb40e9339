"""torch DistributedSampler inside an elastic loop: re-pointed at the current ring before the loop runs in a new
ring; one that feeds training steps is refused after a re-form (its epoch restarted), evaluation data is not."""

import copy
import os
import pickle
import signal
import types
import uuid

import pytest

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elastic_ring as er
from elastic_ring.ring import runtime
from elastic_ring.ring.distributed_samplers import (DistributedSamplerInTraining, allow_epoch_restart, retarget,
                                               retarget_reachable)
from state import ElasticSampler, ObjectState, TorchState
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


class _Trainer:
    def __init__(self):
        self.loader = DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=4, rank=2))
        self.nested = {"loader": DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=4,
                                                                                           rank=3))}

    def loop(self, state):
        return self.loader, self.nested


def test_samplers_one_level_inside_objects_and_containers_are_found_too():
    trainer = _Trainer()
    assert retarget_reachable(trainer.loop, (None,), {}, 0, 2) == 1  # a method's object's loader
    assert trainer.loader.sampler.num_replicas == 2
    assert trainer.nested["loader"].sampler.num_replicas == 4  # two levels down: not seen
    listed = [DistributedSampler(DATA, num_replicas=4, rank=1)]
    assert retarget_reachable(lambda state: listed, (None,), {}, 1, 2) == 1  # in a list the loop closes over
    assert (listed[0].num_replicas, listed[0].rank) == (2, 1)


def _steps(loader, model, optimizer, batches):
    """Draw ``batches`` batches from ``loader``, with an optimizer step after each."""
    drawn = []
    for (x,) in loader:
        drawn.append(x.tolist())
        optimizer.zero_grad()
        model(x.float().unsqueeze(1)).sum().backward()
        optimizer.step()
        if len(drawn) == batches:
            break
    return drawn


def test_a_re_pointed_sampler_that_feeds_training_steps_is_refused_at_its_next_batch():
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DistributedSampler(DATA, num_replicas=3, rank=1, shuffle=False)
    evaluation = DistributedSampler(DATA, num_replicas=3, rank=1, shuffle=False)
    stream = allow_epoch_restart(DistributedSampler(DATA, num_replicas=3, rank=1, shuffle=False))
    loaders = [DataLoader(DATA, batch_size=2, sampler=s) for s in (train, evaluation, stream)]

    def loop(state):
        return loaders

    assert _steps(loaders[0], model, optimizer, 3) == [[1, 4], [7, 10], [13, 16]]  # not watched before a re-form
    assert retarget_reachable(loop, (None,), {}, 0, 2, previous=(1, 3)) == 3
    again = DistributedSampler(DATA, num_replicas=2, rank=0)  # split for a ring that re-formed with the same split
    assert retarget_reachable(lambda state: again, (None,), {}, 0, 2, previous=(0, 2)) == 0
    assert retarget_reachable(lambda state: again, (None,), {}, 0, 2) == 0
    assert type(again) is not DistributedSampler and isinstance(again, DistributedSampler)  # watched all the same
    assert isinstance(train, DistributedSampler) and indices(train) == list(range(0, 23, 2))
    with pytest.raises(DistributedSamplerInTraining, match=r"ElasticSampler.*batch_sampler=sampler"):
        _steps(loaders[0], model, optimizer, 3)  # a step between two of its batches: refused at the second
    assert [x.tolist() for (x,) in loaders[1]][:2] == [[0, 2], [4, 6]]  # evaluation: no step between its batches
    assert len(_steps(loaders[2], model, optimizer, 3)) == 3  # allowed on purpose
    plain = pickle.loads(pickle.dumps(train))  # a copy is a plain DistributedSampler, split for the new ring
    assert type(plain) is DistributedSampler and type(copy.deepcopy(train)) is DistributedSampler
    assert (plain.num_replicas, plain.rank, indices(plain)) == (2, 0, indices(train))


def test_a_horovod_scripts_sampler_keeps_horovods_epoch_restart():
    sampler = DistributedSampler(DATA, num_replicas=3, rank=2)
    script = {"hvd": types.ModuleType("ray_integration.horovod"), "sampler": sampler}
    exec("def loop(state):\n    return sampler\n", script)  # a loop whose module imports hvd, as the launcher runs it
    loop = script["loop"]
    assert retarget_reachable(loop, (None,), {}, 1, 2) == 1
    assert type(sampler) is DistributedSampler and (sampler.num_replicas, sampler.rank) == (2, 1)  # not watched


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


def _training_job(host, port, job, sampler_kind):
    """Train with a DistributedOptimizer (rank 2 of 3 dies after its first step), the batches drawn from a
    torch DistributedSampler (``"distributed"``) or an ElasticSampler (``"elastic"``); evaluate over a
    DistributedSampler after every epoch."""
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=[2]))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    if sampler_kind == "distributed":
        train_sampler = DistributedSampler(DATA, num_replicas=er.size(), rank=er.rank(), shuffle=False)
        train_loader = DataLoader(DATA, batch_size=2, sampler=train_sampler)
        state = TorchState(model=model, optimizer=optimizer, epoch=0)
    else:
        train_sampler = ElasticSampler(DATA, batch_size=2)
        train_loader = DataLoader(DATA, batch_sampler=train_sampler)
        state = TorchState(model=model, optimizer=optimizer, sampler=train_sampler, epoch=0)
    eval_loader = DataLoader(DATA, batch_size=100, sampler=DistributedSampler(DATA, num_replicas=er.size(),
                                                                              rank=er.rank(), shuffle=False))
    first_rank = er.rank()

    @er.elastic.run
    def loop(state):
        while state.epoch < 2:
            train_sampler.set_epoch(state.epoch)
            for (x,) in train_loader:
                optimizer.zero_grad()
                model(x.float().unsqueeze(1)).sum().backward()
                optimizer.step()
                if sampler_kind == "elastic":
                    train_sampler.record_batch()
                if first_rank == 2 and er.size() == 3:
                    os.kill(os.getpid(), signal.SIGKILL)  # after its first step: the others fail in the next
            evaluated = sorted(sum(er.allgather_object([i for (x,) in eval_loader for i in x.tolist()]), []))
            state.epoch += 1
        return er.size(), evaluated

    return loop(state)


@pytest.mark.parametrize("sampler_kind", ["distributed", "elastic"])
def test_training_data_from_a_distributed_sampler_is_refused_after_a_re_form_evaluation_data_is_not(
        ring, sampler_kind):
    job = f"dst-{uuid.uuid4().hex[:6]}"
    results = ring.start(_training_job, "127.0.0.1", ring.address.port, job, sampler_kind).results(
        timeout_s=60, raise_errors=False)
    assert getattr(results[2], "type_name", None) == "ProcessDied", results
    survivors = results[:2]
    if sampler_kind == "distributed":  # its epoch restarted in the new ring: refused at the first step there
        for failure in survivors:
            assert failure.type_name == "DistributedSamplerInTraining", failure
            assert "ElasticSampler" in failure.message and "batch_sampler=sampler" in failure.message
    else:  # the evaluation's DistributedSampler followed the new ring, with no error
        for world, evaluated in survivors:
            assert world == 2 and evaluated == sorted(list(range(23)) + [0]), (world, evaluated)


def _same_split_job(host, port, job):
    """Two ranks train from a torch DistributedSampler; after the first step both lose their round (no process
    dies), so the loop re-enters in a ring of the same size, where each rank may keep its rank and split."""
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=[2]))
    model = torch.nn.Linear(1, 1)
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    train_loader = DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, num_replicas=er.size(),
                                                                             rank=er.rank(), shuffle=False))
    state = TorchState(model=model, optimizer=optimizer, epoch=0)
    failed = []

    @er.elastic.run
    def loop(state):
        for (x,) in train_loader:
            optimizer.zero_grad()
            model(x.float().unsqueeze(1)).sum().backward()
            optimizer.step()
            if not failed:
                failed.append(runtime.round_id())
                runtime.abort_round(failed[0], "injected: the round is lost, nobody died")
        return "finished"

    return loop(state)


def test_a_training_distributed_sampler_is_refused_even_when_the_new_ring_keeps_its_split(ring):
    job = f"dss-{uuid.uuid4().hex[:6]}"
    results = ring.start(_same_split_job, "127.0.0.1", ring.address.port, job, world_size=2).results(
        timeout_s=60, raise_errors=False)
    for failure in results:  # with the split unchanged the epoch would restart silently: samples trained twice
        assert getattr(failure, "type_name", None) == "DistributedSamplerInTraining", results
