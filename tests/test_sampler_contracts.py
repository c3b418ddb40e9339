"""ElasticSampler contracts: len() within an epoch, set_epoch(), DataLoader use, linked mode, the global batch API."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from state import ElasticSampler


def test_len_is_the_partition_and_stays_constant_while_consuming():
    s = ElasticSampler(100, batch_size=10, seed=0)
    assert len(s) == 10
    for _ in range(3):
        s.record_batch()
    assert len(s) == 10 and s.steps_recorded == 3 and len(list(s)) == 7
    assert len(DataLoader(range(100), batch_sampler=s)) == 10
    s.load_state_dict(s.state_dict())  # a restore re-partitions the rest: 70 samples
    assert len(s) == 7 and len(list(s)) == 7
    s.reset(0, 2)  # a resize: 70 samples in steps of 20, the tail folded
    assert len(s) == 3
    s.set_epoch(1)
    assert len(s) == 5


def test_set_epoch_with_the_current_epoch_keeps_progress():
    s = ElasticSampler(40, batch_size=4, seed=1)
    s.set_epoch(0)                      # Horovod's loop calls set_epoch at every epoch's start
    s.record_batch()
    s.record_batch()
    saved = s.state_dict()
    s.load_state_dict(saved)            # a recovery restores mid-epoch ...
    s.set_epoch(0)                      # ... and the loop's set_epoch keeps the progress
    assert s.processed == 8 and len(list(s)) == 8
    s.set_epoch(1)
    assert (s.epoch, s.processed, len(list(s))) == (1, 0, 10)
    s.set_epoch(4)                      # skipping epochs is the user's choice
    assert (s.epoch, s.processed) == (4, 0)
    with pytest.raises(ValueError, match=r"already at epoch 4; epochs only move forward .* build a new sampler"):
        s.set_epoch(3)
    fresh = ElasticSampler(40, batch_size=4)
    fresh.set_epoch(5)
    fresh.set_epoch(2)                  # nothing processed yet: any epoch
    assert fresh.epoch == 2


def _dataset(n=40):
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("drop_last", [False, True])
def test_passing_it_as_sampler_is_refused(drop_last):
    s = ElasticSampler(40, batch_size=4, seed=0)
    loader = DataLoader(_dataset(), batch_size=16, sampler=s, drop_last=drop_last)
    with pytest.raises(TypeError, match=r"batch sampler: pass it as DataLoader\(dataset, batch_sampler=sampler\)"):
        next(iter(loader))


def test_as_batch_sampler_it_loads_every_sample_once_and_checks_only_at_iteration_start(monkeypatch):
    s = ElasticSampler(40, batch_size=4, seed=0)
    calls = []
    check = ElasticSampler._refuse_wrapping
    monkeypatch.setattr(ElasticSampler, "_refuse_wrapping", lambda self, frame: calls.append(1) or check(self, frame))
    seen = []
    for (x,) in DataLoader(_dataset(), batch_sampler=s, num_workers=0):
        assert x.shape == (4,)
        seen.extend(x.tolist())
        s.record_batch()
    assert sorted(seen) == list(range(40)) and calls == [1]
    assert list(iter(s)) == [] and len(calls) == 2  # iterating the sampler itself is fine


def test_linked_mode_the_optimizer_advances_and_record_batch_only_acknowledges():
    s = ElasticSampler(20, batch_size=2, seed=0)
    s._link()
    s.record_batch()                    # before optimizer.step(): nothing moves
    assert (s.processed, s.step, s._consumed, s.steps_recorded) == (0, 0, 0, 0)
    s._advance(1)                       # the optimizer's apply consumes the acknowledged batch
    assert (s.processed, s.step, s._consumed, s.steps_recorded) == (2, 1, 1, 1)
    s._advance(1)                       # a loop that records after step(): no acknowledgment yet, one pass
    assert (s.processed, s.step, s._consumed) == (4, 2, 2)
    s.record_batch()                    # ... its record comes after the apply
    s._advance(1)                       # one acknowledgment since the previous step: one batch
    assert (s.processed, s.step, s._consumed) == (6, 3, 3)
    s.record_batch()
    s.record_batch()                    # a batch skipped without a step (a non-finite loss, say)
    s._advance(1)                       # consumes both: the skipped batch is not trained again after a failure
    assert (s.processed, s.step, s._consumed) == (10, 4, 5)
    s._advance(2)                       # backward_passes_per_step=2, nothing acknowledged: two batches
    assert (s.processed, s.step, s._consumed) == (14, 5, 7)
    s._advance(100)                     # capped at the partition's end, never raising
    assert (s.processed, s.step, s._consumed, len(s)) == (20, 6, 10, 10)
    while s._acks < 10:
        s.record_batch()
    with pytest.raises(RuntimeError, match="record_batch\\(\\) called 11 times.*set_epoch"):
        s.record_batch()
    assert "linked" not in str(s.state_dict())
    s.load_state_dict(s.state_dict())   # the link is per process: it stays
    assert s._linked
    s._link(False)
    s.set_epoch(1)
    s.record_batch()
    assert (s.processed, s.step) == (2, 7)


def test_a_new_epoch_settles_a_step_that_was_reduced_and_skipped_first():
    s = ElasticSampler(8, batch_size=2, seed=0)
    s._link()
    settled = []
    s._before_new_epoch = lambda: (settled.append(s.epoch), s._advance(1))
    s._advance(3)
    s.set_epoch(0)                      # the current epoch: nothing to settle
    assert settled == []
    s.set_epoch(1)                      # the skip is counted in epoch 0, before epoch 1 starts
    assert settled == [0] and (s.epoch, s.processed, s.step) == (1, 0, 2)


def test_global_batch_options_state_and_errors():
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="global_batch_size"):
            ElasticSampler(10, batch_size=2, global_batch_size=bad)
    s = ElasticSampler(30, batch_size=2, global_batch_size=12)
    s.reset(1, 2)
    assert (s.batches_per_step, len(s), s.global_batch_size) == (3, 8, 12)   # chunks 4 4 4 | 4 4 4 3 3
    assert ElasticSampler(30, batch_size=2).batches_per_step == 1
    assert s.pass_share(0) == (2, 12)
    with pytest.raises(ValueError, match="pass_share j=3 must be an int >= 0 and <= 2"):
        s.pass_share(3)
    for _ in range(5):                  # unlinked: every record is a micro-batch; the first step has 3
        s.record_batch()
    assert (s.processed, s.step) == (20, 1)
    assert s.batches_per_step == 5      # the second step holds the folded tail: 5 passes of at most 2 per rank
    assert s.pass_share(2) == (2, 18) and s.pass_share(4) == (1, 18)
    for _ in range(3):
        s.record_batch()
    assert s.step == 2
    with pytest.raises(RuntimeError, match="no step left"):
        s.pass_share(0)
    assert s.state_dict()["global_batch_size"] == 12
    with pytest.raises(ValueError, match="global_batch_size=12, this sampler has global_batch_size=None"):
        ElasticSampler(30, batch_size=2).load_state_dict(s.state_dict())
    old = ElasticSampler(30, batch_size=2).state_dict()
    del old["global_batch_size"]        # a state saved before the option loads
    ElasticSampler(30, batch_size=2).load_state_dict(old)
