"""The background checkpoint writer cannot die silently: every error is an event, flush() always ends,
repeated failures stop training at a commit, the newest request is the one written."""

import itertools
import json
import threading
import time
import uuid
import weakref

import pytest
import torch
import torch.distributed as dist

import elastic_ring as er
from state import CheckpointError, ObjectState, TorchState, flush_checkpoints
from state.checkpoints import hooks as checkpoint_writer
from state.checkpoints.background import BackgroundWriter
from state.checkpoints.hooks import set_checkpoint_listener
from state.checkpoints.store import CheckpointStore

_rounds = itertools.count(1000)


class Unpicklable:
    """Copies fine (it can sit in a State), but pickling it raises a TypeError in the writer thread."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("Unpicklable objects cannot be saved")


@pytest.fixture
def events():
    seen = []
    set_checkpoint_listener(seen.append)
    yield seen
    set_checkpoint_listener(None)


@pytest.fixture
def solo_ring():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    er.init(er.RingSpec(round_id=next(_rounds), rank=0, world_size=1, node_ids=("local",),
                        store=er.StoreAddress("127.0.0.1", store.port), job_id=f"ckw{id(store)}"))
    yield store
    er.shutdown()


def source(tree, meta=None):
    return lambda: (tree, meta or {})


def test_an_unexpected_exception_class_becomes_an_event_and_flush_raises_promptly(tmp_path, events):
    store = CheckpointStore(str(tmp_path), keep_last=1)
    writer = BackgroundWriter(store)
    writer.submit(source({"w": torch.ones(3), "step": 1}, {"commits": 1}))
    first = writer.flush(timeout_s=30)
    writer.submit(source({"w": torch.ones(3), "bad": Unpicklable()}, {"commits": 2}))
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"last checkpoint write failed: .*TypeError: Unpicklable objects "
                                              r"cannot be saved; checkpoint 1 is still the newest"):
        writer.flush(timeout_s=30)
    assert time.monotonic() - started < 5 and not writer.busy
    assert [e["kind"] for e in events] == ["checkpoint_written", "checkpoint_failed"]
    failed = events[-1]
    assert failed["uri"] == store.uri and failed["seq"] == 2 and failed["commits"] == 2
    assert failed["consecutive_failures"] == 1 and "TypeError" in failed["error"]
    assert events[0]["uri"] == first and events[0]["seq"] == 1 and events[0]["bytes"] == 12
    json.dumps(events)  # JSON-plain
    # the previous checkpoint is intact and still loads; the failed one left nothing
    assert store.complete() == [1] and store.load_latest()[0]["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000001"]


def test_repeated_failures_raise_at_the_next_commit_with_cause_and_fix(solo_ring, tmp_path, events):
    state = ObjectState(step=0, bad=None)
    state.enable_checkpoints(str(tmp_path), every_n_commits=1, max_consecutive_failures=2)
    state.commit()
    state._writer.flush(timeout_s=30)
    state.bad = Unpicklable()
    state.commit()  # failure 1 (in the background)
    with pytest.raises(CheckpointError):
        state._writer.flush(timeout_s=30)
    state.commit()  # failure 2
    with pytest.raises(CheckpointError):
        state._writer.flush(timeout_s=30)
    with pytest.raises(CheckpointError, match=r"2 checkpoint writes in a row to .* failed; the last: .*TypeError.*"
                                              r"fix the cause .*resume from the newest valid checkpoint"):
        state.commit()
    assert [e["consecutive_failures"] for e in events if e["kind"] == "checkpoint_failed"] == [1, 2]
    state.bad = None  # fixed: the commit is taken (and still says so), the next write succeeds, the count resets
    with pytest.raises(CheckpointError, match="2 checkpoint writes in a row"):
        state.commit()
    assert state.persist_now(timeout_s=30).endswith("ckpt-000000000002")
    state.commit()
    assert state._writer.consecutive_failures == 0


def test_a_listener_that_raises_is_reported_at_the_next_check(tmp_path):
    def listener(event):
        raise ValueError("listener bug")

    set_checkpoint_listener(listener)
    try:
        writer = BackgroundWriter(CheckpointStore(str(tmp_path)))
        writer.submit(source({"x": 1}))
        assert writer.flush(timeout_s=30).endswith("ckpt-000000000001")  # the write itself succeeded
        with pytest.raises(CheckpointError, match="listener raised ValueError: listener bug"):
            writer.check()
        writer.check()  # reported once
    finally:
        set_checkpoint_listener(None)
    with pytest.raises(TypeError, match="set_checkpoint_listener"):
        set_checkpoint_listener("not callable")


class BlockingStore(CheckpointStore):
    """A store whose save() waits for a gate: a write in flight for as long as the test wants."""

    def __init__(self, uri):
        super().__init__(uri, keep_last=10)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def save(self, tree, meta=None):
        self.entered.set()
        if not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        return super().save(tree, meta)


def test_flush_has_a_deadline_and_the_newest_waiting_request_wins(tmp_path):
    store = BlockingStore(str(tmp_path))
    writer = BackgroundWriter(store)
    calls = []

    def numbered(i):
        def src():
            calls.append(i)
            return {"i": i, "w": torch.full((4,), float(i))}, {"commits": i}
        return src

    writer.submit(numbered(0))
    assert store.entered.wait(10)
    for i in range(1, 5):  # while 0 is in flight: each replaces the one waiting, nothing is copied yet
        writer.submit(numbered(i))
    assert calls == [0]
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"did not finish within 0.3 s"):
        writer.flush(timeout_s=0.3)
    assert time.monotonic() - started < 2
    store.gate.set()
    newest = writer.flush(timeout_s=30)
    assert calls == [0, 4]  # the older waiting requests were never copied nor written
    assert [store.load(s)[0]["i"] for s in store.complete()] == [0, 4] and newest.endswith("ckpt-000000000002")


def test_a_request_of_a_live_committing_thread_is_started_by_that_thread(tmp_path):
    store = BlockingStore(str(tmp_path))
    writer = BackgroundWriter(store)
    poll_now, done = threading.Event(), threading.Event()

    def trainer():
        writer.submit(source({"i": 0}))
        store.entered.wait(10)
        writer.submit(source({"i": 1}))  # deferred: a write is in flight
        poll_now.wait(30)
        writer.poll()  # its next commit starts it
        done.wait(30)

    t = threading.Thread(target=trainer)
    t.start()
    try:
        assert store.entered.wait(10)
        store.gate.set()
        with pytest.raises(CheckpointError, match="did not finish"):
            writer.flush(timeout_s=0.5)  # another thread's request: this flush must not copy its buffers
        poll_now.set()
        assert writer.flush(timeout_s=30).endswith("ckpt-000000000002")
    finally:
        poll_now.set()
        done.set()
        t.join(30)


def test_flush_checkpoints_flushes_every_writer_of_the_process(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "_writers", weakref.WeakSet())  # not the other tests' writers
    a = BackgroundWriter(CheckpointStore(str(tmp_path / "a")))
    b = BackgroundWriter(CheckpointStore(f"memory://flush-{uuid.uuid4().hex}"))
    a.submit(source({"x": 1}))
    b.submit(source({"x": 2}))
    newest = flush_checkpoints(timeout_s=30)
    assert newest in (a.written[-1], b.written[-1]) and newest == max((a, b), key=lambda w: w.last_written_at).written[-1]
    b.submit(source({"bad": Unpicklable()}))
    with pytest.raises(CheckpointError, match="TypeError: Unpicklable"):
        flush_checkpoints(timeout_s=30)
    with pytest.raises(ValueError, match="timeout_s=-1"):
        flush_checkpoints(timeout_s=-1)
    b.submit(source({"x": 3}))
    assert flush_checkpoints(timeout_s=30).startswith("memory://")


def test_persisting_keeps_at_most_one_writer_copy_of_the_state(solo_ring, tmp_path):
    model = torch.nn.Linear(256, 256)
    state = TorchState(model=model, step=0)
    state.enable_checkpoints(str(tmp_path), every_n_commits=1, keep_last=1)
    for _ in range(5):
        state.step += 1
        state.commit()
    assert state.persist_now(timeout_s=30).endswith(f"ckpt-{state.checkpoint_store.complete()[-1]:012d}")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert state._writer._buffer.nbytes == nbytes  # one buffer, reused from write to write
    tree, info = state.checkpoint_store.load_latest(expected_names=state.names)
    assert tree["step"] == 5 and info["meta"]["commits"] == 5
