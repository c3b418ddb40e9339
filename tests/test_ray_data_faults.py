"""Ray Data input (ray_integration.data) under the faults a review found: a rebuilt dataset in another block
order or with other values (the fingerprint), a Ray-Train-style epoch loop (an iteration past the epoch's end),
a shard no State holds, failed block reads (never cached; timeouts retried), the reader thread's end.

Without Ray: blocks are in-memory pyarrow tables (tests.test_ray_data.fake_dataset). With real Ray:
``prepare_datasets`` on a pipeline whose first block finishes last, and the digests computed by remote tasks.
"""

from __future__ import annotations

import gc
import pathlib
import threading
import time
import warnings

import numpy as np
import pyarrow as pa
import pytest
import ray.exceptions
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from ray_integration import data
from ray_integration.data import BlockSpan, ElasticDataShard, PreparedDataset, block_digest
from ray_integration.data import prepare as prepare_module
from ray_integration.data import shard as shard_module
from ray_integration.errors import InputUnavailable
from state import TorchState
from tests.test_ray_data import fake_dataset, shard


def digested(prepared: PreparedDataset) -> PreparedDataset:
    """``prepared`` with its blocks' digests, as prepare_datasets records them."""
    return PreparedDataset(prepared.name, prepared.blocks, prepared.columns,
                           tuple(block_digest(b.ref, b.start, b.rows) for b in prepared.blocks))


def with_tables(prepared: PreparedDataset, tables: list) -> PreparedDataset:
    return digested(PreparedDataset(prepared.name, tuple(BlockSpan(t, 0, t.num_rows) for t in tables),
                                    prepared.columns))


# ------------------------------------------------------------------ the fingerprint reads the values
def test_a_rebuilt_dataset_in_another_block_order_or_with_other_values_is_refused_on_resume():
    original = digested(fake_dataset([5, 5, 5, 5]))
    s = shard(original, batch_size=4)
    next(s.iter_batches(batch_size=4))
    s.record_batch()
    saved = s.state_dict()
    again = shard(digested(fake_dataset([5, 5, 5, 5])), batch_size=4)
    again.load_state_dict(saved)  # the same rows in the same blocks: resumes
    assert again.processed == 4

    tables = [b.ref for b in original.blocks]
    swapped = with_tables(original, [tables[1], tables[0], tables[2], tables[3]])  # equal sizes, another order
    changed = tables[3].set_column(1, "x", pa.array(np.arange(15, 20) * 2.0 + (np.arange(5) == 2)))
    edited = with_tables(original, tables[:3] + [changed])  # one middle value of the last block differs
    for rebuilt in (swapped, edited):
        assert rebuilt.shape_fingerprint == original.shape_fingerprint and rebuilt.fingerprint != original.fingerprint
        with pytest.raises(ValueError, match="same rows per block and columns, but other values in the blocks"):
            shard(rebuilt, batch_size=4).load_state_dict(saved)
    with pytest.raises(ValueError, match="one per block"):
        PreparedDataset("t", original.blocks, original.columns, original.digests[:2])


def test_the_block_digest_reads_the_spans_rows_of_any_column_type():
    table = pa.table({"id": np.arange(10), "name": [f"r{i}" for i in range(10)],
                      "v": [np.full(3, i, np.float32) for i in range(10)]})
    assert block_digest(table, 2, 5) == block_digest(table.slice(2, 5), 0, 5)
    assert block_digest(table, 2, 5) != block_digest(table, 3, 5)
    assert len({block_digest(table, 0, n) for n in (1, 2, 3)}) == 3


# ------------------------------------------------------------------ epochs
def test_a_ray_train_style_epoch_loop_is_told_to_call_set_epoch():
    s = shard(batch_size=4)
    rows = []
    with pytest.raises(RuntimeError, match=r"end of epoch 0 .*shard\.set_epoch\(epoch \+ 1\)"):
        for _ in range(3):  # Ray Train's loop: every iter_*() call a new epoch
            for batch in s.iter_batches(batch_size=4):
                rows.append(len(batch["id"]))
                s.record_batch()
    assert sum(rows) == 30, "the first epoch was trained whole before the error"


def _train_epoch(s: ElasticDataShard, stop_after: int | None = None) -> list[int]:
    ids = []
    for batch in s.iter_batches(batch_size=4):
        ids += batch["id"].tolist()
        s.record_batch()
        if stop_after is not None and len(ids) >= stop_after:
            break
    return ids


def test_set_epoch_each_epoch_trains_every_row_and_a_recovery_at_the_epochs_end_is_not_an_error():
    s = shard(batch_size=4)
    for epoch in range(3):
        s.set_epoch(epoch)
        assert sorted(_train_epoch(s)) == list(range(30)), f"epoch {epoch}"
    first = _train_epoch(shard(batch_size=4), stop_after=8)  # a loop that breaks early continues where it was
    s = shard(batch_size=4)
    assert sorted(_train_epoch(s, stop_after=8) + _train_epoch(s)) == list(range(30)) and len(first) == 8
    saved = s.state_dict()  # at the epoch's end: a recovery re-forms (reset) or restores (load_state_dict)
    for recover in (lambda: s.reset(0, 1), lambda: s.load_state_dict(saved)):
        recover()
        assert _train_epoch(s) == [], "the finished epoch has nothing left"
        with pytest.raises(RuntimeError, match="set_epoch"):
            s.iter_torch_batches(batch_size=4)
    s.set_epoch(1)
    assert sorted(_train_epoch(s)) == list(range(30))


def test_a_shard_iterated_in_a_ring_without_a_state_warns_once(monkeypatch):
    unheld, held, linked = shard(batch_size=4), shard(batch_size=4), shard(batch_size=4)
    model = torch.nn.Linear(1, 1)
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    TorchState(model=model, optimizer=optimizer, sampler=linked)
    TorchState(model=model, sampler=held).commit()  # a State without an optimizer: its commits save the position
    monkeypatch.setattr(runtime, "current_or_none", lambda: object())  # inside a ring
    with pytest.warns(RuntimeWarning, match=r"'train' is iterated in a ring, but no State holds its position"):
        unheld.iter_batches(batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unheld.iter_batches(batch_size=4)  # once
        held.iter_batches(batch_size=4)
        linked.iter_torch_batches(batch_size=4)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard(batch_size=4).iter_batches(batch_size=4)  # outside a ring: nothing to lose


# ------------------------------------------------------------------ failed block reads
class FlakyFetch:
    """Reads a fake block (the table itself); raises ``error`` on the first ``times`` reads of the block that starts
    at row ``first``."""

    def __init__(self, first: int, error: BaseException, times: int = 1) -> None:
        self.first, self.error, self.left, self.calls = first, error, times, 0

    def __call__(self, ref):
        self.calls += 1
        if ref.column("id")[0].as_py() == self.first and self.left > 0:
            self.left -= 1
            raise self.error
        return ref


def flaky_shard(fetch: FlakyFetch) -> ElasticDataShard:
    s = ElasticDataShard(fake_dataset([3] * 10), 3, shuffle=False, fetch=fetch)  # batch k is block k
    s.reset(0, 1)
    return s


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_failed_block_read_is_not_kept_and_the_next_read_fetches_it_again(prefetch):
    s = flaky_shard(FlakyFetch(first=3, error=RuntimeError("object lost")))
    got = []
    with pytest.raises(RuntimeError, match="object lost"):
        for batch in s.iter_batches(batch_size=3, prefetch_batches=prefetch):
            got += batch["id"].tolist()
            s.record_batch()
    assert got == [0, 1, 2]
    s.reset(0, 1)  # the ring re-forms; the survivors read on from the newest position
    for batch in s.iter_batches(batch_size=3, prefetch_batches=prefetch):
        got += batch["id"].tolist()
        s.record_batch()
    assert got == list(range(30))
    s.close()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_timed_out_block_read_is_retried(monkeypatch, prefetch):
    monkeypatch.setattr(shard_module, "FETCH_RETRY_DELAY_S", 0.0)
    for error in (ray.exceptions.GetTimeoutError("get timed out"), TimeoutError("slow")):
        fetch = FlakyFetch(first=3, error=error, times=shard_module.FETCH_TRIES - 1)
        s = flaky_shard(fetch)
        ids = [i for b in s.iter_batches(batch_size=3, prefetch_batches=prefetch) for i in b["id"].tolist()]
        assert ids == list(range(30)) and s._cache.retries == shard_module.FETCH_TRIES - 1
        s.close()
    s = flaky_shard(FlakyFetch(first=3, error=TimeoutError("down"), times=shard_module.FETCH_TRIES))
    with pytest.raises(InputUnavailable, match="down"):  # the worker leaves as a lost worker (issue 32)
        list(s.iter_batches(batch_size=3, prefetch_batches=prefetch))
    s.close()


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("elastic-ring-blocks")]


def _wait_gone(threads: list[threading.Thread]) -> bool:
    for t in threads:
        t.join(timeout=10)
    return not any(t.is_alive() for t in threads)


def test_the_reader_thread_ends_with_close_and_with_the_shard():
    before = set(_reader_threads())
    s = shard(fake_dataset([3] * 10), batch_size=3, shuffle=False)
    assert len(list(s.iter_batches(batch_size=3, prefetch_batches=2))) == 10
    mine = [t for t in _reader_threads() if t not in before]
    assert mine and s._cache.thread_running
    s.close()
    assert _wait_gone(mine) and not s._cache.thread_running
    assert len(list(shard(fake_dataset([3] * 10), batch_size=3).iter_batches(batch_size=3))) == 10  # usable
    s = shard(fake_dataset([3] * 10), batch_size=3, shuffle=False)
    list(s.iter_batches(batch_size=3, prefetch_batches=2))
    mine = [t for t in _reader_threads() if t not in before]
    del s
    gc.collect()
    assert _wait_gone(mine)


# ------------------------------------------------------------------ real Ray
def first_block_last(marks: str, blocks: int):
    """A map_batches function whose first block finishes after every other block of its run has finished (each
    other block leaves a file in ``marks``; the first waits for them, 30 s at most)."""

    def transform(batch):
        first = int(batch["id"][0])
        if first == 0:
            deadline = time.monotonic() + 30
            while len(list(pathlib.Path(marks).iterdir())) < blocks - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            (pathlib.Path(marks) / str(first)).touch()
        return {"id": batch["id"], "x": batch["id"] * 2}

    return transform


@pytest.mark.slow  # ~11-24 s: a real 8-block pipeline (the fingerprint check itself has fast tests)
def test_prepare_datasets_keeps_the_dataset_order_and_fingerprints_the_values(ray_session, tmp_path):
    import ray.data

    context = ray.data.DataContext.get_current()
    assert not context.execution_options.preserve_order
    prints = []
    for run in range(2):
        marks = tmp_path / f"run{run}"
        marks.mkdir()
        ds = ray.data.range(800, override_num_blocks=8).map_batches(first_block_last(str(marks), 8), batch_size=100)
        prepared = data.prepare_datasets({"train": ds}).datasets["train"]
        ids = [i for b in ElasticDataShard(prepared, shuffle=False).iter_batches(batch_size=50)
               for i in b["id"].tolist()]
        assert ids == list(range(800)), "global row i is the dataset's row i, however its blocks finished"
        assert not ds.context.execution_options.preserve_order, "the dataset's own context is left as it was"
        prints.append(prepared.fingerprint)
    assert prints[0] == prints[1] and len(prepared.digests) == 8
    assert not context.execution_options.preserve_order, "the user's context is left as it was"
    other = ray.data.range(800, override_num_blocks=8).map_batches(lambda b: {"id": b["id"], "x": b["id"] * 3})
    described = data.prepare_datasets({"train": other}).datasets["train"]
    assert described.shape_fingerprint == prepared.shape_fingerprint and described.fingerprint != prepared.fingerprint


def test_the_digests_computed_where_the_blocks_live_equal_the_local_ones(ray_session, monkeypatch):
    import ray.data

    materialized = ray.data.range(300, override_num_blocks=5).materialize()
    spans = [s for bundle in materialized.iter_internal_ref_bundles() for s in prepare_module._spans(bundle)]
    here = prepare_module._digests("t", spans)
    monkeypatch.setattr(prepare_module, "_local", lambda refs: [False] * len(refs))
    monkeypatch.setattr(prepare_module, "DIGESTS_IN_FLIGHT", 2)
    assert prepare_module._digests("t", spans) == here
    assert here == tuple(block_digest(ray_session.get(s.ref), s.start, s.rows) for s in spans)


# ------------------------------------------------------------------ the benchmark
def test_the_benchmark_prints_what_it_measured_when_a_later_run_fails(capsys):
    from benchmarks import ray_data as bench

    rates = iter([100.0, 80.0, 50.0, 110.0])

    def measure() -> float:
        rate = next(rates, None)
        if rate is None:
            raise RuntimeError("the cluster went away")
        return rate

    with pytest.raises(SystemExit) as info:
        bench.measure_all(2, {"ours, dataset order": measure, "ours, shuffled": measure, "Ray Train": measure})
    out, err = capsys.readouterr()
    assert info.value.code == 1
    assert "run 2 of 'ours, shuffled' failed; what was measured before it" in out, out
    assert "ours, dataset order    median        105 rows/s  (2.10x Ray Train)  runs 100, 110" in out, out
    assert "Ray Train              median         50 rows/s  (1.00x Ray Train)" in out
    assert "failed with RuntimeError: the cluster went away" in err
    done = bench.measure_all(1, {"Ray Train": lambda: 40.0})
    assert done == {"Ray Train": [40.0]}
