"""ElasticStream: a stateful IterableDataset trained exactly once per epoch, across a SIGKILL and resizes.

The ring test is the closed form of tests/test_live_recovery.py: each item's hit count rides in the
gradient reduction (a parameter whose gradient is the batch's hits, summed over the ring), so the
counts are exact iff every item of every epoch is applied exactly once, whatever rank trained it."""

import os
import signal
import uuid

import pytest
import torch

import elastic_ring as er
from state import ElasticSampler, TorchState
from state.samplers.stream import ElasticStream
from tests.local_rendezvous import StoreRendezvous

N_ITEMS, EPOCHS, BATCH, K = 53, 3, 2, 7


class Numbers(torch.utils.data.IterableDataset):
    """Items 0..n-1 in an order that depends on the epoch (set_epoch); its position is savable (torchdata's
    Stateful protocol: load_state_dict applies to the next iter())."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.read, self._resume = n, 0, 0, None
        self.passes = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        start, self._resume = self._resume or 0, None
        self.passes += 1
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(1000 + self.epoch)).tolist()
        for i in range(start, self.n):
            self.read = i + 1
            yield order[i]

    def state_dict(self) -> dict:
        return {"read": self.read, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state["read"]


class NotStateful(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(3)


def _rank_items(stream: ElasticStream, steps: int | None = None) -> list[list[int]]:
    out = []
    for batch in stream:
        out.append(batch.tolist())
        stream.record_batch()
        if steps is not None and len(out) == steps:
            break
    return out


def test_every_rank_takes_its_share_of_each_step_and_the_tail_is_folded():
    streams = [ElasticStream(Numbers(11), batch_size=2) for _ in range(2)]
    for rank, stream in enumerate(streams):
        stream.reset(rank, 2)
    got = [_rank_items(s) for s in streams]
    order = torch.randperm(11, generator=torch.Generator().manual_seed(1000)).tolist()
    assert got[0] == [order[0:2], order[4:8]] and got[1] == [order[2:4], order[8:11]], got  # 4, then 7 folded
    assert all(s.processed == 11 and s.step == 2 for s in streams)


def test_a_saved_position_resumes_exactly_on_a_fresh_dataset_at_another_world_size():
    dataset = Numbers(N_ITEMS)
    first = ElasticStream(dataset, batch_size=3)
    first.reset(0, 2)
    done = [i for batch in _rank_items(first, steps=4) for i in batch]
    saved = first.state_dict()
    assert saved["processed"] == 4 * 2 * 3 and saved["dataset"]["read"] == 24 and dataset.read > 24  # read ahead
    order = torch.randperm(N_ITEMS, generator=torch.Generator().manual_seed(1000)).tolist()
    rest = []
    for rank in range(3):  # a fresh process per rank (a joiner), 3 ranks now
        stream = ElasticStream(Numbers(N_ITEMS), batch_size=3)
        stream.load_state_dict(saved)
        stream.reset(rank, 3)
        rest += [i for batch in _rank_items(stream) for i in batch]
        assert stream.processed == N_ITEMS and stream.dataset.passes == 1  # seeked by load_state_dict: one pass
    assert sorted(rest) == sorted(order[24:]) and len(rest) == N_ITEMS - 24
    assert set(done) == {order[p] for p in range(24) if (p % 6) < 3}  # rank 0's first 3 of every 6


def test_a_resize_mid_epoch_drops_what_was_read_ahead_and_seeks():
    stream = ElasticStream(Numbers(20), batch_size=2)
    stream.reset(0, 1)
    first = _rank_items(stream, steps=3)  # 6 items consumed, 4 more read ahead
    stream.reset(0, 1)
    rest = _rank_items(stream)
    assert [i for b in first + rest for i in b] == torch.randperm(20, generator=torch.Generator().manual_seed(1000)).tolist()
    assert stream.dataset.passes == 2


class Records(Numbers):
    """Numbers as dicts of a tensor, a string and an int: the structure an empty share must keep."""

    def __iter__(self):
        for i in super().__iter__():
            yield {"x": torch.full((2,), float(i)), "name": f"item {i}", "id": i}


def _all_ranks(make, world: int, saved: dict | None = None, **kw) -> list[list]:
    """Every rank's batches of the rest of the epoch (each rank a fresh stream, as after a resume)."""
    out = []
    for rank in range(world):
        stream = ElasticStream(make(), **kw)
        if saved is not None:
            stream.load_state_dict(saved)
        stream.reset(rank, world)
        batches = []
        for batch in stream:
            batches.append(batch)
            stream.record_batch()
        out.append(batches)
    return out


def test_a_rank_with_an_empty_share_gets_an_empty_batch_of_the_steps_structure():
    got = _all_ranks(lambda: Numbers(3), 4, batch_size=1)  # 3 items, 4 ranks: rank 3's share is empty
    assert [len(b) for b in got] == [1, 1, 1, 1], "every rank runs the same steps"
    assert [b[0].tolist() for b in got[:3]] == [[i] for i in torch.randperm(3, generator=torch.Generator()
                                                                               .manual_seed(1000)).tolist()]
    assert got[3][0].shape == (0,) and got[3][0].dtype == torch.int64

    first = ElasticStream(Numbers(5), batch_size=1)  # one rank: 4 of 5 items, then a resume on 2 ranks
    assert len(_rank_items(first, steps=4)) == 4 and first.processed == 4
    got = _all_ranks(lambda: Numbers(5), 2, saved=first.state_dict(), batch_size=1)
    assert [len(b) for b in got] == [1, 1] and got[0][0].numel() == 1 and got[1][0].numel() == 0

    empty = _all_ranks(lambda: Records(2), 3, batch_size=2)[2][0]
    assert set(empty) == {"x", "name", "id"} and empty["x"].shape == (0, 2) and empty["name"] == []
    assert empty["id"].shape == (0,)
    mine = _all_ranks(lambda: Numbers(1), 2, batch_size=1, collate_fn=lambda items: ("mine", items))
    assert [b[0] for b in mine] == [("mine", [0]), ("mine", [])], "a collate_fn of the user's gets []"


def test_iterating_again_after_the_epochs_end_without_set_epoch_is_refused():
    stream = ElasticStream(Numbers(6), batch_size=2)
    with pytest.raises(RuntimeError, match=r"epoch 0 is over .*state\.stream\.set_epoch\(epoch \+ 1\)"):
        for _ in range(2):  # a DataLoader habit: every iteration a new epoch
            _rank_items(stream)
    assert stream.processed == 6
    stream.reset(0, 1)  # a recovery at the epoch's end: nothing left, no error
    assert _rank_items(stream) == []
    stream.set_epoch(1)
    assert sorted(i for b in _rank_items(stream) for i in b) == list(range(6))
    partial = ElasticStream(Numbers(6), batch_size=2)
    assert len(_rank_items(partial, steps=1) + _rank_items(partial)) == 3, "a loop that breaks early goes on"


def test_iterating_across_a_repartition_is_refused():
    stream = ElasticStream(Numbers(20), batch_size=2)
    it = iter(stream)
    next(it)
    stream.reset(0, 1)
    with pytest.raises(RuntimeError, match="re-partitioned .* while this loop iterated it; iterate it again"):
        next(it)


def test_an_iterable_dataset_without_a_savable_position_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"NotStateful has no state_dict or load_state_dict.*torchdata's "
                                        r"StatefulDataLoader"):
        ElasticStream(NotStateful(), batch_size=2)
    with pytest.raises(TypeError, match=r"NotStateful is an IterableDataset: use state.ElasticStream\(dataset, batch_size\) instead"):
        ElasticSampler(NotStateful(), batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        ElasticStream(Numbers(3), batch_size=0)


def _job(host, port, job, worlds):
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=worlds))
    first_rank = er.rank()
    holder = torch.nn.Module()
    holder.count = torch.nn.Parameter(torch.zeros(N_ITEMS, dtype=torch.float64))  # -hits, reduced with the step
    opt = er.DistributedOptimizer(torch.optim.SGD(holder.parameters(), lr=1.0), holder.named_parameters(), op=er.Sum)
    state = TorchState(model=holder, optimizer=opt, stream=ElasticStream(Numbers(N_ITEMS), batch_size=BATCH), epoch=0)
    assert state.step_linked
    log, reforms = [], [0]
    state.register_reset_callbacks([lambda: reforms.__setitem__(0, reforms[0] + 1)])

    @er.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            for batch in state.stream:
                if state.stream.step + 1 == K and reforms[0] == 0 and first_rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch: the survivors fail in the reduction
                hits = torch.zeros(N_ITEMS, dtype=torch.float64)
                hits[batch] += 1
                opt.zero_grad()
                (holder.count * hits).sum().backward()
                opt.step()
                state.stream.record_batch()
                log.append((reforms[0], state.stream.step))
            state.epoch += 1
            state.stream.set_epoch(state.epoch)
            state.commit()
        return state.stream.step

    steps = loop(state)
    return dict(steps=steps, log=log, seen=(-holder.count.detach()).tolist(), world=er.size(),
                processed=state.stream.processed, epoch=state.stream.epoch)


def test_a_sigkilled_rank_mid_epoch_every_item_is_trained_once_per_epoch(ring):
    job = f"stream-{uuid.uuid4().hex[:6]}"
    results = ring.start(_job, "127.0.0.1", ring.address.port, job, [2]).results(timeout_s=120, raise_errors=False)
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == 2, results
    for r in survivors:
        assert r["world"] == 2 and r["epoch"] == EPOCHS
        assert r["seen"] == [float(EPOCHS)] * N_ITEMS, r["seen"]  # each item exactly once per epoch
        before = [s for g, s in r["log"] if g == 0]
        after = [s for g, s in r["log"] if g > 0]
        assert before and after and max(before) - (min(after) - 1) == 0, r["log"]  # no step redone
    assert survivors[0]["steps"] == survivors[1]["steps"]
