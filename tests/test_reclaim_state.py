"""Issue 32, the state's side of a reclaim: the driver's write asked for alone (the ring trains on), a drain's write
that never holds up the re-form, "newest" as the newest state (a late write of an older state never wins nor prunes
a newer one), the lease fence on state checkpoints, and a State with several sampler positions refused (real gloo
rings and real files, no Ray)."""

from __future__ import annotations

import errno
import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from state import CheckpointError, ElasticSampler, TorchState, membership
from state.checkpoints.config import CheckpointConfig
from state.checkpoints import hooks
from state.checkpoints.hooks import flush_checkpoints, set_checkpoint_listener
from state.checkpoints.lease import CheckpointLease
from state.checkpoints.store import CheckpointStore

_rounds = itertools.count(1)


def _linked(n=40, batch=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    state = TorchState(model=model, optimizer=opt, sampler=ElasticSampler(n, batch_size=batch, seed=1), step=0)
    return model, opt, state


def _train(model, opt, state, steps, notice_at=None, notice=None):
    """Train ``steps`` steps; post ``notice`` (this round's) before step ``notice_at``. Returns (what was raised,
    seconds from the step that carried the notice to the raise)."""
    started = None
    try:
        for batch in state.sampler:
            if state.sampler.step == steps:
                model(torch.randn(1, 3))  # the next training forward runs a due boundary
                break
            if notice is not None and state.sampler.step == notice_at:
                membership.post(membership.Notice(er.round_id(), **notice))
                started = time.monotonic()
            opt.zero_grad()
            model(torch.randn(len(batch), 3)).sum().backward()
            opt.step()
            state.sampler.record_batch()
            state.step = state.sampler.step
    except er.MembershipChanged:
        return "changed", time.monotonic() - started
    return None, None


def _persist_alone(uri, notice_rank):
    events = []
    set_checkpoint_listener(events.append)
    model, opt, state = _linked()
    state.enable_checkpoints(uri, every_n_commits=1000)
    state.sync()
    raised, _ = _train(model, opt, state, 8, notice_at=3,
                       notice=dict(persist=True, persist_id=7) if er.rank() == notice_rank else None)
    flush_checkpoints(10)
    set_checkpoint_listener(None)
    membership.reset()
    return raised, state.sampler.step, state.commits, [(e["kind"], e.get("persist"), e.get("order")) for e in events]


def test_a_write_asked_for_alone_commits_at_the_next_step_and_the_ring_trains_on(ring, tmp_path):
    """The driver's just-in-time write: one rank (not the writer) gets the notice; at the next step boundary every
    rank commits, rank 0 writes that commit tagged with the driver's number, and nobody re-forms."""
    results = ring.run(_persist_alone, str(tmp_path / "ckpt"), 1, world_size=2)
    assert [r[:3] for r in results] == [(None, 8, 1), (None, 8, 1)], results  # one commit: the boundary's
    events = results[0][3]
    round_id = events[0][2][1]
    assert events == [("persist_started", 7, [0, round_id, 5]), ("checkpoint_written", 7, [0, round_id, 5])], events
    tree, info = CheckpointStore(str(tmp_path / "ckpt")).load_latest()
    assert tree["step"] == 4 and tree["sampler"]["step"] == 4 and info["meta"]["order"] == [0, round_id, 5]


def _drain_write(uri):
    from tests import ray_jobs  # noqa: F401  (registers slowfile://)

    events = []
    set_checkpoint_listener(events.append)
    model, opt, state = _linked()
    state.enable_checkpoints(f"slowfile://{uri}", every_n_commits=1000)
    state.sync()
    open(os.path.join(uri, "SLOW_WRITE_S"), "w").write("2")
    raised, seconds = _train(model, opt, state, 30, notice_at=3, notice=dict(change=True, persist=True, persist_id=4))
    before = [e["kind"] for e in events]
    flush_checkpoints(30)
    set_checkpoint_listener(None)
    membership.reset()
    return raised, seconds, before, [(e["kind"], e.get("persist")) for e in events]


def test_a_drains_write_does_not_hold_up_the_re_form(ring, tmp_path):
    """The drain's commit goes to the writer and the ring re-forms at once (the live handover never waits on
    the durable write); the write lands later, tagged, and the leaving worker's flush waits for it."""
    (tmp_path / "ckpt").mkdir()
    raised, seconds, before, after = ring.run(_drain_write, str(tmp_path / "ckpt"), world_size=1)[0]
    assert raised == "changed" and seconds < 1.5, (raised, seconds)   # the write takes 2 s
    assert before == ["persist_started"], before
    assert after == [("persist_started", 4), ("checkpoint_written", 4)], after


def _store(uri, **kw):
    return CheckpointStore(uri, keep_last=1, run_id="run", **kw)


def test_a_late_write_of_an_older_state_is_never_newest_nor_prunes_a_newer_one(tmp_path):
    """The new rank 0 writes round 6's state; then a leaving former rank 0's queued write of round 5 lands (a
    later number). With keep_last=1 the newer state stays, and it is the one loaded."""
    uri = str(tmp_path / "ckpt")
    newer = _store(uri).save({"step": 120}, {"order": [0, 6, 120]})
    older = _store(uri).save({"step": 100}, {"order": [0, 5, 100]})
    store = _store(uri)
    assert older.endswith("ckpt-000000000002") and newer.endswith("ckpt-000000000001")
    assert store.newest_uri() == newer
    assert store.load_latest()[0] == {"step": 120}
    _store(uri).save({"step": 130}, {"order": [0, 6, 130]})  # the next write prunes both older states
    assert store.complete() == [3]


def test_checkpoints_without_an_order_still_load_and_sort_below_ordered_ones(tmp_path):
    uri = str(tmp_path / "ckpt")
    _store(uri).save({"step": 1}, {"commits": 1})               # written before the order existed
    assert _store(uri).load_latest()[0] == {"step": 1}
    _store(uri).save({"step": 2}, {"commits": 2, "order": [1, 1, 3]})
    CheckpointStore(uri, keep_last=3, run_id="run").save({"step": 0}, {"commits": 9})  # an old writer, later
    assert CheckpointStore(uri).load_latest()[0] == {"step": 2}


@pytest.fixture
def solo():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def ring(round_id):
        er.shutdown()
        er.init(er.RingSpec(round_id=round_id, rank=0, world_size=1, node_ids=("local",),
                            store=er.StoreAddress("127.0.0.1", store.port), job_id=f"solo{next(_rounds)}"))

    yield ring
    er.shutdown()


def test_a_resumed_state_is_newer_than_what_it_resumed_from_though_its_rounds_start_again(solo, tmp_path):
    uri = str(tmp_path / "ckpt")
    solo(9)
    model, opt, state = _linked()
    state.enable_checkpoints(uri, every_n_commits=1)
    state.sync()
    state.step = 5
    state.commit()
    flush_checkpoints(10)
    assert state.commit_order.lineage == 0 and state.commit_order.round_id == 9
    solo(1)   # the next run: its rounds start again
    _, _, resumed = _linked()
    resumed.enable_checkpoints(uri, every_n_commits=1)
    resumed.sync()
    assert resumed.step == 5 and resumed.commit_order.lineage == 1
    resumed.step = 6
    resumed.commit()
    flush_checkpoints(10)
    assert CheckpointStore(uri).load_latest()[0]["step"] == 6


def test_state_checkpoints_are_fenced_by_the_runs_lease_generation(solo, tmp_path):
    """A stalled run whose lease was taken over (and released again by the run that took it) must not publish a
    state checkpoint there: State passes its lease generation to the store, as reported checkpoints do."""
    uri = str(tmp_path / "ckpt")
    lease = CheckpointLease(uri, "run-a", ttl_s=5).acquire()
    solo(next(_rounds))
    model, opt, state = _linked()
    state._use_checkpointing(CheckpointConfig(uri, every_n_commits=1000, run_id="run-a",
                                              lease_generation=lease.generation))
    state.sync()
    assert state.persist_now(10) is not None
    lease.release()
    CheckpointLease(uri, "run-b", ttl_s=5).acquire().release()   # run b took the location over, then ended
    state.step = 3
    state.commit()
    with pytest.raises(CheckpointError, match="no longer holds the lease"):
        state.persist_now(10)
    assert CheckpointStore(uri).complete() == [1]
    hooks._writers.discard(state._writer)  # the run that lost its lease is over: later tests' flushes skip its writer


def test_a_state_with_two_sampler_positions_and_an_optimizer_is_refused_by_name(solo):
    solo(next(_rounds))
    model = torch.nn.Linear(3, 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    with pytest.raises(ValueError, match=r"2 sampler positions \(train, val\).*Keep only the training"):
        TorchState(model=model, optimizer=opt, train=ElasticSampler(10, batch_size=2),
                   val=ElasticSampler(6, batch_size=2))
    state = TorchState(model=model, optimizer=opt, train=ElasticSampler(10, batch_size=2))
    assert state.step_linked
    with pytest.raises(ValueError, match="2 sampler positions"):
        state.val = ElasticSampler(6, batch_size=2)   # added later: refused the same way, at the next link
        state.sync()


def test_a_manifest_that_cannot_be_read_for_a_moment_never_makes_the_newest_state_look_oldest(tmp_path, monkeypatch):
    """Found by a review: a read error on a manifest (not a missing one) made its checkpoint "unordered", sorted
    below every other: a late write of an older state then pruned the newest, and resuming passed it over."""
    from state.checkpoints import transport
    from state.checkpoints.lease import CheckpointLease
    from state.checkpoints.sequenced import CheckpointPruneError

    uri = str(tmp_path / "ckpt")
    lease = CheckpointLease(uri, "run", ttl_s=30).acquire()
    store = lambda: CheckpointStore(uri, keep_last=1, run_id="run")  # noqa: E731
    store().save({"step": 120}, {"order": [0, 6, 120]})      # the new rank 0's write: the newest state
    real = transport.Location.read_bytes

    def blip(self, path, limit=1 << 20):
        if path.endswith("ckpt-000000000001/MANIFEST.json"):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, path, limit)

    try:
        monkeypatch.setattr(transport.Location, "read_bytes", blip)
        with pytest.raises(CheckpointPruneError):
            store().save({"step": 100}, {"order": [0, 5, 100]})  # a leaver's late write of an older state
        with pytest.raises(OSError, match="Input/output error"):
            store().load_latest()   # raised (and retried by the resume), never an older state silently
        monkeypatch.setattr(transport.Location, "read_bytes", real)
        assert store().complete() == [2, 1] and store().load_latest()[0] == {"step": 120}
    finally:
        lease.release()
