"""ElasticSampler: the layout tables (per-rank and constant global batch), and exactly-once coverage over
random resizes and rollbacks."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fractions import Fraction

from state import ElasticSampler
from state.samplers.sampler_layout import micro_batches, micro_step_sizes, share, step_sizes


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
    world_iter = itertools.cycle(worlds)
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
    assert set(s.state_dict()) == {"epoch", "processed", "step", "num_samples", "seed", "shuffle", "global_batch_size"}
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
    from elastic_ring.core.progress import set_progress
    from elastic_ring.ring.report import set_reporter
    from elastic_ring.core import progress
    from elastic_ring.core.log import identity

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
    set_reporter(records.append)
    try:
        er.report(loss=0.5)
    finally:
        set_reporter(None)
    assert records[0]["step"] == 3 and records[0]["samples"] == 30 and records[0]["loss"] == 0.5
    with pytest.raises(ValueError, match="step=-1"):
        set_progress(step=-1)


# ---------------------------------------------------------------- constant global batch
@pytest.mark.parametrize(
    "remaining, world, batch, g, m, chunks, first_step_by_rank",
    [
        (24, 3, 4, 12, 1, [12, 12], [[4], [4], [4]]),
        (24, 2, 4, 12, 2, [6, 6, 6, 6], [[3, 3], [3, 3]]),
        (20, 3, 2, 10, 2, [5, 5, 5, 5], [[2, 2], [2, 2], [1, 1]]),   # G not divisible by W
        (10, 4, 4, 5, 1, [5, 5], [[2], [1], [1], [1]]),               # W * m > G
        (6, 4, 1, 3, 1, [3, 3], [[1], [1], [1], [0]]),                # G < W: a rank idles
        (30, 2, 4, 12, 2, [6, 6, 6, 6, 6], [[3, 3], [3, 3]]),         # tail folded: the last step has 3 passes
        (5, 2, 4, 12, 2, [5], [[3], [2]]),                            # the whole rest is less than G: one pass
        (1, 2, 4, 12, 2, [1], [[1], [0]]),                            # fewer samples than ranks: a rank idles
        (17, 1, 2, 7, 4, [2, 2, 2, 1, 2, 2, 2, 2, 2], [[2, 2, 2, 1]]),
        (64, 3, 1, 64, 21, [4] + [3] * 20, [[2] + [1] * 20, [1] * 21, [1] * 21]),  # batch 1: no empty pass
        (0, 3, 2, 8, 2, [], None),
    ],
)
def test_micro_step_sizes(remaining, world, batch, g, m, chunks, first_step_by_rank):
    assert micro_batches(g, world, batch) == m
    assert micro_step_sizes(remaining, world, batch, g) == chunks
    assert sum(chunks) == remaining
    if first_step_by_rank is not None:
        assert [[share(c, world, r)[1] for c in chunks[:m]] for r in range(world)] == first_step_by_rank


@settings(max_examples=200, deadline=None)
@given(remaining=st.integers(0, 150), g=st.integers(1, 40), batch=st.integers(1, 8), world=st.integers(1, 6))
def test_global_steps_cover_their_positions_with_weights_summing_to_one(remaining, g, batch, world):
    samplers = [ElasticSampler(remaining, batch_size=batch, shuffle=False, global_batch_size=g) for _ in range(world)]
    for rank, s in enumerate(samplers):
        s.reset(rank, world)
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1, "every rank has the same number of micro-batches"
    position, start = 0, 0
    while position < len(batches[0]):
        m = samplers[0].batches_per_step
        assert {s.batches_per_step for s in samplers} == {m}, "every rank runs the same passes in a step"
        step = [(r, j, batches[r][position + j]) for r in range(world) for j in range(m)]
        size = sum(len(b) for _, _, b in step)
        assert sorted(i for _, _, b in step for i in b) == list(range(start, start + size))
        assert size == g or position + m == len(batches[0]), "only the epoch's last step differs from G"
        weights = Fraction(0)
        for r, j, b in step:
            assert samplers[r].pass_share(j) == (len(b), size)
            weights += Fraction(len(b), size)
        assert weights == 1
        counts = [len(b) for _, _, b in step]
        assert max(counts) <= batch or (batch == 1 and max(counts) == 2), "a pass holds at most batch_size"
        if size >= world:
            assert min(counts) >= 1, "no pass is empty on any rank"
        for s in samplers:
            s._advance(m)
        position, start = position + m, start + size
    assert start == remaining


def _global_ring(committed, world, batch, g):
    samplers = []
    for rank in range(world):
        s = ElasticSampler(committed["num_samples"], batch_size=batch, seed=committed["seed"], global_batch_size=g)
        s._link()
        s.load_state_dict(committed)
        s.reset(rank, world)
        samplers.append(s)
    return samplers, [iter(s) for s in samplers]


def _global_run(n, batch, g, ops, worlds):
    """Linked global-batch training over ops; returns {epoch: committed samples}, epochs finished, step sizes seen."""
    world_iter = iter(worlds * 20)
    committed = ElasticSampler(n, batch_size=batch, seed=5, global_batch_size=g).state_dict()
    samplers, iters = _global_ring(committed, next(world_iter), batch, g)
    pending, done, finished, sizes = [], {}, 0, []
    for op in ops + ["step"] * 300:
        if finished >= 2:
            break
        if op == "step":
            m = samplers[0].batches_per_step
            step = [[next(it, None) for _ in range(m)] for it in iters]
            if all(b is None for rank in step for b in rank):  # epoch over on every rank at once
                for s in samplers:
                    s.set_epoch(s.epoch + 1)
                iters = [iter(s) for s in samplers]
                committed = samplers[0].state_dict()
                done.setdefault(finished, []).extend(pending)
                pending, finished = [], finished + 1
                continue
            assert all(b is not None for rank in step for b in rank), "ranks must stay in lock step"
            epoch = samplers[0].epoch
            sizes.append((epoch, sum(len(b) for rank in step for b in rank)))
            for s, rank in zip(samplers, step):
                for b in rank:
                    s.record_batch()  # linked: only an acknowledgment
                    pending.extend((epoch, i) for i in b)
                s._advance(m)
            assert len({s.state_dict()["processed"] for s in samplers}) == 1
        elif op in ("commit", "resize"):
            committed = samplers[0].state_dict()
            for epoch, i in pending:
                done.setdefault(epoch, []).append(i)
            pending = []
            if op == "resize":
                samplers, iters = _global_ring(committed, next(world_iter), batch, g)
        else:  # rollback, maybe onto another world size
            pending = []
            world = next(world_iter) if op == "fail_resize" else samplers[0]._world
            sizes = [x for x in sizes if x[0] < committed["epoch"]] + _committed_sizes(sizes, committed)
            samplers, iters = _global_ring(committed, world, batch, g)
    return done, finished, sizes


def _committed_sizes(sizes, committed):
    """The step sizes of the committed epoch that the committed position covers."""
    kept, total = [], 0
    for epoch, size in sizes:
        if epoch == committed["epoch"] and total < committed["processed"]:
            kept.append((epoch, size))
            total += size
    return kept


def _check_global_run(n, g, done, finished, sizes):
    last = n - g * (n // g - 1) if n >= g else n
    for epoch, samples in done.items():
        flat = [i[1] if isinstance(i, tuple) else i for i in samples]
        if epoch < finished:
            assert sorted(flat) == list(range(n)), f"epoch {epoch}: not exactly once"
            epoch_sizes = [size for e, size in sizes if e == epoch]
            expected = [g] * (len(epoch_sizes) - 1) + [last] if n else []
            assert epoch_sizes == expected, f"epoch {epoch}: steps {epoch_sizes}"
        else:
            assert len(flat) == len(set(flat)), f"epoch {epoch}: a sample counted twice"


def test_global_batch_exactly_once_across_a_resize():
    n, batch, g = 50, 3, 8
    done, finished, sizes = _global_run(n, batch, g, ["step", "step", "commit", "step", "resize", "step", "step"],
                                        [3, 2])
    assert finished == 2
    _check_global_run(n, g, done, finished, sizes)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=60),
    batch=st.integers(min_value=1, max_value=4),
    g=st.integers(min_value=1, max_value=20),
    ops=st.lists(st.sampled_from(["step", "step", "step", "commit", "rollback", "resize", "fail_resize"]), max_size=80),
    worlds=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=20),
)
def test_global_batch_exactly_once_over_resizes_and_rollbacks(n, batch, g, ops, worlds):
    """Every step holds exactly G samples (the folded last excepted), every sample of an epoch once."""
    done, finished, sizes = _global_run(n, batch, g, ops, worlds)
    _check_global_run(n, g, done, finished, sizes)
