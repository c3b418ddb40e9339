"""Ray Data input (ray_integration.data): every row trained exactly once per epoch across resizes.

Without Ray (fast): the epoch's order, the partition over changing rings, the batch formats, the batch
size rule, the fingerprint check on resume, the error messages, the per-rank block reads. With real Ray:
a dataset prepared on the driver, three workers training on it, one SIGKILLed mid-epoch (shrink) and a
replacement joining (grow); every row's uses are counted exactly (a parameter whose gradient is the
batch's one-hot of row ids moves only with applied optimizer steps), and every replica ends equal.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import elastic_ring as er
from ray_integration import data
from ray_integration.data import BlockSpan, ElasticDataShard, PreparedDataset, PreparedDatasets, block_order
from state import TorchState

ROWS = [5, 7, 3, 9, 6]  # rows per block of the fake dataset (30 rows)


def fake_dataset(rows=ROWS, name="train") -> PreparedDataset:
    """Blocks as in-memory pyarrow tables: the 'ref' is the table itself (fetch = identity)."""
    blocks, first = [], 0
    for n in rows:
        ids = np.arange(first, first + n)
        blocks.append(BlockSpan(pa.table({"id": ids, "x": ids * 2.0}), 0, n))
        first += n
    return PreparedDataset(name, tuple(blocks), (("id", "int64"), ("x", "double")))


def shard(prepared=None, rank=0, world=1, **kw) -> ElasticDataShard:
    s = ElasticDataShard(prepared or fake_dataset(), fetch=lambda ref: ref, **kw)
    s.reset(rank, world)
    return s


# ------------------------------------------------------------------ order
def test_the_order_is_a_per_epoch_permutation_of_blocks_with_rows_shuffled_within_each():
    order = block_order(ROWS, shuffle=True, seed=3, epoch=0).tolist()
    assert sorted(order) == list(range(sum(ROWS)))
    firsts = np.cumsum([0] + ROWS)
    runs = [int(np.searchsorted(firsts, i, side="right") - 1) for i in order]
    changes = sum(1 for a, b in zip(runs, runs[1:]) if a != b)
    assert changes == len(ROWS) - 1, "each block's rows are consecutive in the order"
    assert order == block_order(ROWS, True, 3, 0).tolist(), "the same on every rank"
    assert order != block_order(ROWS, True, 3, 1).tolist(), "another order next epoch"
    assert block_order(ROWS, False, 3, 5).tolist() == list(range(sum(ROWS)))


# ------------------------------------------------------------------ exactly once over resizes
def drive(prepared, worlds, batch_size=2, epochs=2, shuffle=True):
    """Simulate ranks that train in lock step and re-form after the step counts given: ``worlds`` is a list of
    (world size, steps to run in it). Returns how often each row id was yielded per epoch."""
    seen = np.zeros((epochs, prepared.num_rows), dtype=int)
    saved = None
    for world, steps in worlds:
        ranks = [shard(prepared, r, world, batch_size=batch_size, shuffle=shuffle, seed=7) for r in range(world)]
        for s in ranks:
            if saved is not None:
                s.load_state_dict(saved)
                s.reset(s._rank, world)
        for _ in range(steps):
            if ranks[0].epoch >= epochs:
                break
            iters = [s.iter_batches(batch_size=batch_size) for s in ranks]
            batches = [next(it, None) for it in iters]
            if batches[0] is None:  # the epoch is over on every rank (lock step)
                assert all(b is None for b in batches)
                for s in ranks:
                    s.set_epoch(s.epoch + 1)
                continue
            for s, batch in zip(ranks, batches):
                seen[s.epoch, batch["id"]] += 1
                s.record_batch()
        saved = ranks[0].state_dict()
        assert all(s.state_dict() == saved for s in ranks), "every rank agrees on the position"
    return seen


def test_every_row_once_per_epoch_through_a_shrink_and_a_grow_without_ray():
    prepared = fake_dataset()
    seen = drive(prepared, [(3, 3), (2, 4), (3, 100)])
    assert (seen == 1).all(), seen


def test_every_row_once_per_epoch_in_dataset_order_and_with_uneven_tails():
    prepared = fake_dataset([1, 2, 30, 4])
    seen = drive(prepared, [(4, 2), (1, 3), (3, 5), (2, 100)], batch_size=3, epochs=3, shuffle=False)
    assert (seen == 1).all(), seen


def test_a_rank_reads_each_block_about_once_per_epoch():
    prepared = fake_dataset([40] * 6)
    ranks = [shard(prepared, r, 2, batch_size=4, shuffle=True, seed=1) for r in range(2)]
    for s in ranks:
        rows = sum(len(b["id"]) for b in s.iter_batches(batch_size=4, prefetch_batches=0))
        assert rows == 120
        assert s.block_fetches == len(prepared.blocks), s.block_fetches


def test_prefetched_blocks_are_the_same_rows():
    prepared = fake_dataset([3] * 10)
    a = [b["id"].tolist() for b in shard(prepared, batch_size=4).iter_batches(batch_size=4, prefetch_batches=0)]
    b = [b["id"].tolist() for b in shard(prepared, batch_size=4).iter_batches(batch_size=4, prefetch_batches=3)]
    assert a == b and sorted(sum(a, [])) == list(range(30))


def test_a_block_span_reads_only_its_rows():
    table = pa.table({"id": np.arange(100, 110)})
    prepared = PreparedDataset("t", (BlockSpan(table, 2, 5), BlockSpan(table, 8, 2)))
    ids = [i for b in shard(prepared, shuffle=False).iter_batches(batch_size=3) for i in b["id"].tolist()]
    assert ids == [102, 103, 104, 105, 106, 108, 109]


# ------------------------------------------------------------------ batches
def test_batches_come_in_ray_datas_formats():
    s = shard(shuffle=False)
    numpy_batch = next(s.iter_batches(batch_size=4))
    assert set(numpy_batch) == {"id", "x"} and numpy_batch["id"].tolist() == [0, 1, 2, 3]
    assert isinstance(numpy_batch["x"], np.ndarray)
    assert next(s.iter_batches(batch_size=4, batch_format="pandas"))["x"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert next(s.iter_batches(batch_size=4, batch_format="pyarrow")).num_rows == 4
    tensors = next(s.iter_torch_batches(batch_size=4, dtypes=torch.float32, device="cpu"))
    assert tensors["x"].dtype == torch.float32 and tensors["id"].tolist() == [0.0, 1.0, 2.0, 3.0]
    per_column = next(s.iter_torch_batches(batch_size=4, dtypes={"x": torch.float16}))
    assert per_column["id"].dtype == torch.int64 and per_column["x"].dtype == torch.float16
    collated = next(s.iter_torch_batches(batch_size=4, collate_fn=lambda b: torch.tensor(b["id"]) + 1))
    assert collated.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="batch_format"):
        s.iter_batches(batch_format="arrow")
    with pytest.raises(ValueError, match="collate_fn cannot be used with dtypes"):
        s.iter_torch_batches(collate_fn=lambda b: b, dtypes=torch.float32)


def test_numpy_batches_gathered_from_cached_columns_equal_the_block_path():
    prepared = fake_dataset([4, 9, 2, 11])
    for shuffle in (False, True):
        numpy_path = [b["x"].tolist() for b in shard(prepared, shuffle=shuffle).iter_batches(batch_size=5)]
        block_path = [b.column("x").to_pylist()
                      for b in shard(prepared, shuffle=shuffle).iter_batches(batch_size=5, batch_format="pyarrow")]
        assert numpy_path == block_path and len(numpy_path) == 26 // 5
    s = shard(prepared, shuffle=False)
    first = next(s.iter_torch_batches(batch_size=5))
    first["x"] += 100  # the batch owns its memory: the cached block is untouched
    again = shard(prepared, shuffle=False)
    again._cache = s._cache
    assert next(again.iter_torch_batches(batch_size=5))["x"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_a_rank_past_the_tail_gets_an_empty_batch_with_the_columns():
    s = shard(fake_dataset([2]), rank=2, world=3, batch_size=1)
    batches = list(s.iter_batches(batch_size=1))
    assert len(batches) == 1 and set(batches[0]) == {"id", "x"} and len(batches[0]["id"]) == 0


def test_the_batch_size_is_set_by_the_first_iteration_of_a_partition_and_then_fixed():
    s = shard(world=2)  # 256 by default: one batch
    assert len(s) == 1
    it = s.iter_batches(batch_size=3)
    assert len(s) == 30 // 6 and s.batch_size == 3
    next(it)
    s.record_batch()
    with pytest.raises(ValueError, match="batch_size=4.*1 batch.*batch_size=3"):
        s.iter_batches(batch_size=4)
    s.iter_batches(batch_size=3)  # the same size is fine
    for bad, match in ((None, "whole blocks"), (0, "batch_size")):
        with pytest.raises(ValueError, match=match):
            s.iter_batches(batch_size=bad)
    with pytest.raises(ValueError, match="drop_last"):
        s.iter_torch_batches(batch_size=3, drop_last=True)
    with pytest.raises(ValueError, match="local_shuffle_buffer_size"):
        s.iter_batches(batch_size=3, local_shuffle_buffer_size=10)


# ------------------------------------------------------------------ state
def test_the_position_resumes_only_on_the_same_dataset():
    s = shard(batch_size=4)
    next(s.iter_batches(batch_size=4))
    s.record_batch()
    saved = s.state_dict()
    again = shard(batch_size=4)
    again.load_state_dict(saved)
    assert again.processed == 4
    rebuilt = shard(fake_dataset([5, 7, 3, 8, 7]), batch_size=4)  # same rows, other blocks
    with pytest.raises(ValueError, match="fingerprint .*same rows in the same blocks"):
        rebuilt.load_state_dict(saved)
    plain = {k: v for k, v in saved.items() if k != "dataset"}
    again.load_state_dict(plain)  # a plain ElasticSampler's state: the sampler's own checks only


def test_the_shard_is_the_states_linked_sampler():
    s = shard(batch_size=2)
    model = torch.nn.Linear(1, 1)
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    state = TorchState(model=model, optimizer=optimizer, sampler=s)
    assert state.step_linked
    state.commit()
    assert state._snapshot["sampler"]["dataset"]["rows"] == 30


def test_get_dataset_shard_names_the_fix():
    data.install(None)
    with pytest.raises(ValueError, match=r"no datasets; pass them to the trainer as ElasticTrainer\(datasets="):
        data.get_dataset_shard("train")
    data.install(PreparedDatasets({"train": fake_dataset(), "val": fake_dataset(name="val")}))
    try:
        with pytest.raises(ValueError, match=r"'test'.*\['train', 'val'\]"):
            data.get_dataset_shard("test")
        assert data.get_dataset_shard("val").num_samples == 30
    finally:
        data.install(None)
    with pytest.raises(TypeError, match="prepare_datasets"):
        data.install({"train": 1})
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        data.prepare_datasets({"train": [1, 2]})


# ------------------------------------------------------------------ real Ray
KILL = (1, 1, 6)  # (round, rank, step): rank 1 of the first ring, right after its 6th applied step
N_ROWS, FULL = 480, 3


def rows_dataset(n=N_ROWS, blocks=6):
    import ray.data

    g = np.random.default_rng(5)
    xs, ys = g.standard_normal((n, 4)).astype(np.float32), g.standard_normal((n, 1)).astype(np.float32)
    return ray.data.from_items([{"id": i, "x": xs[i], "y": ys[i]} for i in range(n)], override_num_blocks=blocks)


def train_rows(config: dict):
    """Linear regression on the shard's batches; a `hits` parameter counts each row id's trained uses."""
    n, epochs = config["rows"], config["epochs"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.hits = torch.nn.Parameter(torch.zeros(n))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                        op=er.Sum)
    shard = data.get_dataset_shard("train", seed=3)
    state = TorchState(model=model, optimizer=optimizer, sampler=shard, epoch=0)
    kill = tuple(config["kill"]) if config.get("kill") else None

    @er.elastic.run
    def loop(state):
        while state.epoch < epochs:
            for batch in shard.iter_torch_batches(batch_size=config["batch"]):
                ids = batch["id"]
                onehot = torch.zeros(n)
                onehot[ids] = 1.0
                optimizer.zero_grad()
                loss = ((model(batch["x"]) - batch["y"]) ** 2).mean() if len(ids) else torch.zeros(())
                (loss - (model.hits * onehot).sum()).backward()
                optimizer.step()
                if kill == (er.round_id(), er.rank(), shard.step):
                    os.kill(os.getpid(), signal.SIGKILL)  # after the apply, before the loop's own collective
                logged = er.allreduce(loss.detach(), name="loss for the log")
                if er.rank() == 0:
                    er.report(loss=float(logged), step=shard.step, round=er.round_id(), epoch=state.epoch,
                              position=shard.processed)
                time.sleep(config["step_delay_s"] * (4 if er.size() < FULL else 1))  # hold on until the join
            state.epoch += 1
            shard.set_epoch(state.epoch)
            state.commit()
        params = er.allgather_object([p.detach() for p in model.parameters()])
        identical = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
        seen = (model.hits.detach() / 0.01).round().tolist()  # SGD, lr 0.01, Sum of -1 per use
        return {"seen": seen, "identical": identical, "world": er.size(), "fetches": er.allgather_object(
            shard.block_fetches)}

    return loop(state)


def test_prepare_datasets_records_every_block_in_order(ray_session):
    prepared = data.prepare_datasets({"train": rows_dataset(60, blocks=4)})
    described = prepared.datasets["train"]
    assert described.num_rows == 60 and len(described.blocks) == 4
    assert [c for c, _ in described.columns] == ["id", "x", "y"]
    again = data.prepare_datasets({"train": rows_dataset(60, blocks=4)})
    assert again.datasets["train"].fingerprint == described.fingerprint, "a deterministic dataset resumes"
    ids = [i for b in ElasticDataShard(described, shuffle=False).iter_batches(batch_size=7) for i in b["id"].tolist()]
    assert ids == list(range(60)), "global row i is the dataset's row i"
    assert data.prepare_datasets({}) is None and data.prepare_datasets(None) is None


def test_every_row_exactly_once_through_a_kill_and_a_join(ray_session):
    from ray_integration import ElasticTrainer

    epochs, batch = 2, 4
    started = time.monotonic()
    result = ElasticTrainer(min_workers=2, max_workers=FULL, progress=False, datasets={"train": rows_dataset()}).run(
        train_rows, config={"rows": N_ROWS, "epochs": epochs, "batch": batch, "kill": KILL,
                            "step_delay_s": 0.03})
    wall = time.monotonic() - started
    value = result.value
    kinds = [e.kind for e in result.events]
    print(f"ray data: {wall:.1f} s, world {value['world']}, block fetches per rank {value['fetches']}; events {kinds}")
    for kind in ("worker_lost", "recovered", "worker_joined", "finished"):
        assert kind in kinds, kinds
    assert value["seen"] == [float(epochs)] * N_ROWS, "every row exactly once per epoch"
    assert value["identical"], "every replica of the final ring holds the same parameters"
    reports = [m for m in result.metrics_history if "position" in m]  # rank 0's er.report records
    join_round = next(e.round_id for e in result.events if e.kind == "worker_joined")
    before = [m for m in reports if m["round"] < join_round]
    after = [m for m in reports if m["round"] == join_round]
    assert before and after and after[0]["epoch"] == before[-1]["epoch"] and 0 < before[-1]["position"] < N_ROWS, \
        "the joiner joined mid-epoch"
