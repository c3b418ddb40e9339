"""The driver <-> worker contract (issue 31): message kinds as enums, each with its handler on the driver, the
typed WorkerSettings checked where they are made, and what a worker does with the exception that ended fn."""

from __future__ import annotations

import json

import pytest

import elastic_ring as er
import state
from ray_integration.driver.pool import _HANDLERS
from ray_integration.errors import WorkerError
from ray_integration.wire.protocol import DriverKind, WorkerKind
from ray_integration.wire.settings import WorkerSettings
from ray_integration.worker.actor import Fate, _describe_failure, fate


def test_every_kind_a_worker_sends_has_its_handler_on_the_driver():
    assert set(_HANDLERS) == set(WorkerKind)


def test_kinds_travel_as_their_strings_and_unknown_ones_are_ignored():
    assert json.loads(json.dumps({"k": WorkerKind.HEARTBEAT})) == {"k": "hb"} and f"{DriverKind.RING}" == "ring"
    assert WorkerKind.of({"k": "hb"}) is WorkerKind.HEARTBEAT and DriverKind.of({"k": "pending"}) is DriverKind.PENDING
    assert WorkerKind.of({"k": "ring"}) is None and WorkerKind.of({"k": 3}) is None and WorkerKind.of({}) is None


@pytest.mark.parametrize("changes, error, match", [
    (dict(driver_silence_s=0), ValueError, "WorkerSettings.driver_silence_s=0 must be"),
    (dict(flush_timeout_s=float("nan")), ValueError, "flush_timeout_s"),
    (dict(checkpoint="s3://bucket/run"), TypeError, "must be a state.CheckpointConfig or None"),
    (dict(use_gpu="yes"), ValueError, "use_gpu='yes' must be True or False"),
    (dict(timeline=1), ValueError, "timeline=1 must be True or False"),
])
def test_worker_settings_are_checked_when_made(changes, error, match):
    good = dict(driver_silence_s=60.0, flush_timeout_s=30.0)
    WorkerSettings(**good, checkpoint=state.CheckpointConfig("/tmp/x", every_n_commits=1))
    with pytest.raises(error, match=match):
        WorkerSettings(**{**good, **changes})


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except type(cause) as inner:
            raise error from inner
    except type(error) as outer:
        return outer


@pytest.mark.parametrize("exc, expected", [
    (er.RingStopped("not in the next ring"), Fate.LEAVE),
    (state.TrainingStopped("the job stops"), Fate.LEAVE),
    (WorkerError("w", 0, "node", "host", "tb"), Fate.RAISE),
    (er.RendezvousError("no word from the driver"), Fate.GIVE_UP),
    (_raised_from(er.RendezvousError("the rendezvous failed"), er.AuthenticationError("forged")), Fate.ERROR),
    (er.AuthenticationError("a value failed authentication"), Fate.ERROR),
    (ValueError("fn's own bug"), Fate.ERROR),
])
def test_what_a_worker_does_with_the_exception_that_ended_fn(exc, expected):
    assert fate(exc) is expected


def test_a_rendezvous_failure_from_forged_data_is_named_as_tampering_not_a_lost_worker():
    forged = _raised_from(er.RendezvousError("the rendezvous failed"), er.AuthenticationError("forged"))
    assert "failed authentication" in _describe_failure(forged)
    assert _describe_failure(er.RendezvousError("x")) == "the rendezvous with the driver failed"


def _first_ring_answer(n: int) -> tuple[bytes, er.RingSpec]:
    """The real driver forms a first ring of ``n`` workers (8 per node, Ray node ids of 56 hex digits) and answers
    each through a real store; what the last rank's worker pops from its queue (sealed), and the spec it reads."""
    import queue

    from benchmarks._control_pool import SimPool
    from elastic_ring.core.auth import new_secret
    from elastic_ring.ring.store import StoreServer
    from ray_integration.config import TrainerConfig
    from ray_integration.driver.events import EventLog
    from ray_integration.driver.loop import Driver
    from ray_integration.driver.states import Running, Starting
    from ray_integration.wire.channel import Channel
    from ray_integration.wire.protocol import DRIVER, Keys
    from ray_integration.wire.settings import WorkerSettings

    secret, keys, server = new_secret(), Keys(f"job-answers-{n}"), StoreServer("127.0.0.1")
    try:
        config = TrainerConfig(min_workers=n, max_workers=n, progress=False)
        wakeups: queue.SimpleQueue = queue.SimpleQueue()
        order = [f"{i:032x}" for i in range(n)]
        nodes = {wid: f"{i // 8:056x}" for i, wid in enumerate(order)}
        pool = SimPool(config, Channel(server.store, secret, DRIVER), "127.0.0.1", server.address.port, keys, secret,
                       None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0), wakeups=wakeups,
                       nodes=nodes, order=order, command=lambda kind, wids: None)
        driver = Driver(config, pool, "127.0.0.1", EventLog(), wakeups)
        pool.request(n)
        pool.apply_ray([item for kind, items in [wakeups.get()] for item in items])
        for wid in order:
            pool.apply({"from": wid, "n": 1, "k": WorkerKind.HEARTBEAT.value, "seq": 1, "synced": True,
                        "waiting": 1, "reason": "start"})
        assert isinstance(driver.advance(Starting(since=0.0)), Running) and driver.ring.world_size == n
        last = driver.ring.worker_ids[-1]
        store = server.connect(10.0)
        raw = store.queue_pop(keys.worker_inbox(last))
        msg = Channel(store, secret, last).verify(keys.worker_inbox(last), raw)
        assert DriverKind.of(msg) is DriverKind.RING
        return raw, er.RingSpec.from_wire({**msg["spec"], "cuda_device": None}, secret)  # as the worker reads it
    finally:
        server.close()


def test_a_ring_answer_does_not_grow_with_the_ring():
    """Issue 34: each worker's answer carries its own placement, not the node table (60 KB each at 1,024)."""
    small, small_spec = _first_ring_answer(8)
    large, large_spec = _first_ring_answer(1024)
    assert large_spec.node_ids is None and "node_ids" not in json.dumps(large_spec.to_wire())
    # only the digits of the numbers grow: rank 7 of 8 -> 1023 of 1,024, and their local, cross and node ranks
    assert len(large) - len(small) < 64 and len(large) < 2048, (len(small), len(large))
    assert (large_spec.rank, large_spec.world_size, large_spec.node_id) == (1023, 1024, f"{127:056x}")
    assert large_spec.placement == er.placements([f"{i // 8:056x}" for i in range(1024)])[1023]
    assert (small_spec.local_rank, small_spec.local_size, small_spec.cross_rank, small_spec.cross_size) == (7, 8, 0, 1)


@pytest.mark.parametrize("numbers, taken", [
    ([1, 2, 3], [True, True, True]),
    ([1, 1], [True, False]),                            # a duplicate (a replay)
    ([2, 1, 1], [True, True, False]),                   # out of order within the window: once
    ([1, 70, 6, 7, 69, 7], [True, True, False, True, True, False]),  # 6 is 64 below 70: too old to tell
    ([0], [False]),                                     # no sender numbers from 0
    ([200, 137, 136], [True, True, False]),             # a jump: the window starts again below the new top
])
def test_the_replay_check_takes_each_number_once_within_a_window(numbers, taken):
    from ray_integration.wire.channel import _accept

    seen, got = (0, 0), []
    for n in numbers:
        after = _accept(seen, n)
        got.append(after is not None)
        seen = after or seen
    assert got == taken
