"""ElasticSampler: the layout tables, and exactly-once coverage over random resizes and rollbacks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state import ElasticSampler
from state.sampler_layout import share, step_sizes


@pytest.mark.parametrize(
    "remaining, world, batch, expected",
    [
        (0, 3, 4, []),
        (12, 3, 4, [12]),
        (24, 3, 4, [12, 12]),
        (25, 3, 4, [12, 13]),      # the tail is folded into the last step
        (35, 3, 4, [12, 23]),
        (5, 3, 4, [5]),            # less than one global batch: one step
        (2, 3, 4, [2]),            # fewer samples than ranks: one rank gets nothing
        (10, 1, 3, [3, 3, 4]),
    ],
)
def test_step_sizes(remaining, world, batch, expected):
    assert step_sizes(remaining, world, batch) == expected
    assert sum(expected) == remaining


@pytest.mark.parametrize(
    "size, world, expected",
    [
        (12, 3, [(0, 4), (4, 4), (8, 4)]),
        (13, 3, [(0, 5), (5, 4), (9, 4)]),
        (2, 3, [(0, 1), (1, 1), (2, 0)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_share(size, world, expected):
    shares = [share(size, world, r) for r in range(world)]
    assert shares == expected
    assert sum(c for _, c in shares) == size


def test_every_rank_gets_the_same_number_of_batches():
    for n in range(0, 40):
        for world in (1, 2, 3, 5):
            lengths = set()
            for rank in range(world):
                s = ElasticSampler(n, batch_size=3, seed=1)
                s.reset(rank, world)
                lengths.add(len(list(s)))
            assert len(lengths) == 1, (n, world)


def _ring(committed, world, batch):
    samplers = []
    for rank in range(world):
        s = ElasticSampler(committed["num_samples"], batch_size=batch, shuffle=committed["shuffle"], seed=committed["seed"])
        s.load_state_dict(committed)
        s.reset(rank, world)
        samplers.append(s)
    return samplers, [iter(s) for s in samplers]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=60),
    batch=st.integers(min_value=1, max_value=5),
    ops=st.lists(st.sampled_from(["step", "step", "step", "commit", "rollback", "resize", "fail_resize"]), max_size=120),
    worlds=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40),
)
def test_exactly_once_over_resizes_and_rollbacks(n, batch, ops, worlds):
    """Committed work covers every sample of every finished epoch exactly once."""
    world_iter = iter(worlds * 10)
    committed = ElasticSampler(n, batch_size=batch, seed=7).state_dict()
    samplers, iters = _ring(committed, next(world_iter), batch)
    pending: list[int] = []           # processed since the last commit
    done: dict[int, list[int]] = {}   # epoch -> samples in committed work
    epochs_finished = 0
    for op in ops + ["step"] * 200:
        if epochs_finished >= 2:
            break
        if op == "step":
            batches = [next(it, None) for it in iters]
            if all(b is None for b in batches):       # epoch over on every rank at once
                epoch = samplers[0].epoch
                for s in samplers:
                    s.set_epoch(epoch + 1)
                iters = [iter(s) for s in samplers]
                committed = samplers[0].state_dict()
                done.setdefault(epoch, []).extend(pending)
                pending = []
                epochs_finished += 1
                continue
            assert all(b is not None for b in batches), "ranks must stay in lock step"
            for s, b in zip(samplers, batches):
                pending.extend((samplers[0].epoch, i) for i in b)
                s.record_batch()
            assert len({s.state_dict()["processed"] for s in samplers}) == 1
        elif op in ("commit", "resize"):
            committed = samplers[0].state_dict()
            for epoch, i in pending:
                done.setdefault(epoch, []).append(i)
            pending = []
            if op == "resize":  # MembershipChanged after a commit: no rollback
                samplers, iters = _ring(committed, next(world_iter), batch)
        elif op in ("rollback", "fail_resize"):
            pending = []
            world = next(world_iter) if op == "fail_resize" else samplers[0]._world
            samplers, iters = _ring(committed, world, batch)
    # pending entries from the epoch-end commits above were stored as plain ints
    for epoch, samples in done.items():
        flat = [i[1] if isinstance(i, tuple) else i for i in samples]
        if epoch < epochs_finished:
            assert sorted(flat) == list(range(n)), f"epoch {epoch}: not exactly once"
        else:
            assert len(flat) == len(set(flat)), f"epoch {epoch}: a sample counted twice"


def test_state_dict_is_tiny_and_checked():
    s = ElasticSampler(1000, batch_size=8, seed=3)
    assert set(s.state_dict()) == {"epoch", "processed", "step", "num_samples", "seed", "shuffle"}
    with pytest.raises(ValueError, match="dataset of 1000 samples"):
        ElasticSampler(999, batch_size=8, seed=3).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="batch_size=0"):
        ElasticSampler(10, batch_size=0)


def test_record_past_the_end_says_what_to_do():
    s = ElasticSampler(4, batch_size=2)
    for _ in s:
        s.record_batch()
    with pytest.raises(RuntimeError, match="set_epoch"):
        s.record_batch()


def test_sampler_publishes_progress_for_logs_and_reports():
    import elastic_ring as er
    from elastic_ring import progress
    from elastic_ring.log import identity

    s = ElasticSampler(100, batch_size=10, seed=0)
    for _ in range(3):
        s.record_batch()
    assert progress.current() == {"step": 3, "epoch": 0, "samples": 30}
    assert identity() == "[no ring step 3]"
    saved = s.state_dict()
    s.set_epoch(1)
    s.record_batch()
    assert progress.current() == {"step": 4, "epoch": 1, "samples": 110}
    s.load_state_dict(saved)  # a restore puts the committed position back
    assert progress.current() == {"step": 3, "epoch": 0, "samples": 30}
    records = []
    er.set_reporter(records.append)
    try:
        er.report(loss=0.5)
    finally:
        er.set_reporter(None)
    assert records[0]["step"] == 3 and records[0]["samples"] == 30 and records[0]["loss"] == 0.5
    with pytest.raises(ValueError, match="step=-1"):
        er.set_progress(step=-1)
