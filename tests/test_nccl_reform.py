"""NCCL re-form by shrink and grow (elastic_ring.backends.nccl.reform): the decisions as tables, and the handle
operations against a fake library (no CUDA needed). The real thing runs in tests/gpu/test_gpu_reform.py."""

from __future__ import annotations

import pytest

import elastic_ring as er
from elastic_ring.backends.nccl import reform as nccl_reform
from elastic_ring.backends.nccl.handle import CommHandle
from elastic_ring.backends.nccl.lib import IN_PROGRESS, SUCCESS
from elastic_ring.backends.nccl.reform import GROW, INIT, SHRINK, Plan
from elastic_ring.core.errors import CommError

from tests.test_nccl import FakeClock, FakeLib

S, G, I = SHRINK, GROW, INIT


@pytest.mark.parametrize("parent_ranks, kind", [
    (None, I),
    ((), I),
    ((0, 1), S),             # the same members (a member's view of the parent's size decides: nothing left out)
    ((0, 2), S),             # rank 1 lost
    ((1, 2), S),             # rank 0 lost: survivors keep the parent's order
    ((2, 0), I),             # reordered: NCCL numbers survivors in the parent's order
    ((0, 1, -1), G),         # one newcomer after the members
    ((0, 1, -1, -1), G),
    ((0, -1, 1), I),         # a newcomer in the middle
    ((1, 0, -1), I),         # members moved
    ((0, 2, -1), I),         # a loss and a join at once: a mix
    ((-1, -1), I),           # nobody of the parent
    ((-1, 0), I),
])
def test_classify(parent_ranks, kind):
    assert nccl_reform.classify(parent_ranks) == kind


@pytest.mark.parametrize("parent_ranks, parent_size, expected", [
    ((0, 2), 3, Plan(S, 4, 2, (1,))),
    ((1, 2), 3, Plan(S, 4, 2, (0,))),
    ((0, 1), 4, Plan(S, 4, 2, (2, 3))),
    ((0, 1), 2, None),               # nothing left out: not a shrink of this parent
    ((0, 3), 3, None),               # a rank the parent does not have
    ((0, 2), None, Plan(S, 4, 2)),   # no parent here: the plan is known, the token will say init
    ((0, 1, -1), 2, Plan(G, 4, 2)),
    ((0, 1, -1), None, Plan(G, 4, 2)),  # the newcomer
    ((0, 1, -1), 3, None),           # the parent had 3: one was lost too, so this is a mix
    ((2, 0), 3, None),
])
def test_plan_for(parent_ranks, parent_size, expected):
    assert nccl_reform.plan_for(4, parent_ranks, parent_size) == expected


def _has(*names):
    return lambda name: name in names


@pytest.mark.parametrize("plan, my_parent_rank, alive, has, token", [
    (Plan(S, 4, 2, (1,)), 0, True, _has("ncclCommShrink"), b"shrink"),
    (Plan(S, 4, 2, (1,)), 0, False, _has("ncclCommShrink"), b"init"),   # its communicator was aborted
    (Plan(S, 4, 2, (1,)), 0, True, _has(), b"init"),                    # libnccl < 2.27
    (Plan(S, 4, 2), 0, True, _has("ncclCommShrink"), b"init"),          # nothing to exclude
    (Plan(G, 4, 2), 1, True, _has("ncclCommGrow"), b"grow"),
    (Plan(G, 4, 2), -1, False, _has("ncclCommGrow"), b"grow"),          # a newcomer needs no parent
    (Plan(G, 4, 2), -1, False, _has("ncclCommShrink"), b"init"),        # libnccl < 2.29
    (Plan(G, 4, 2), 0, False, _has("ncclCommGrow"), b"init"),
    (None, 0, True, _has("ncclCommShrink", "ncclCommGrow"), b"init"),
])
def test_token(plan, my_parent_rank, alive, has, token):
    assert nccl_reform.token(plan, my_parent_rank, alive, has) == token


@pytest.mark.parametrize("tokens, plan, path", [
    ([b"shrink", b"shrink"], Plan(S, 4, 2, (1,)), S),
    ([b"shrink", b"init"], Plan(S, 4, 2, (1,)), I),   # one rank cannot: everyone does a full init
    ([b"grow", b"grow", b"grow"], Plan(G, 4, 2), G),
    ([b"grow", b"grow", b"init"], Plan(G, 4, 2), I),
    ([b"grow", b"shrink"], Plan(G, 4, 2), I),         # a forged or confused token
    ([b"shrink"], None, I),
    ([], Plan(S, 4, 2, (1,)), I),
])
def test_agreed(tokens, plan, path):
    assert nccl_reform.agreed(tokens, plan) == path


def test_ring_spec_validates_the_parent():
    base = dict(round_id=5, rank=0, world_size=2, node_ids=("a", "b"), store=er.StoreAddress("127.0.0.1", 1),
                backend="nccl")
    spec = er.RingSpec(**base, nccl_reform="shrink_grow", parent_round=4, parent_ranks=(0, 2))
    again = er.RingSpec.from_wire(spec.to_wire(), None)
    assert again == spec and again.parent_ranks == (0, 2)
    with pytest.raises(ValueError, match="nccl_reform='fast' is unknown"):
        er.RingSpec(**base, nccl_reform="fast")
    with pytest.raises(ValueError, match="go together"):
        er.RingSpec(**base, parent_round=4)
    with pytest.raises(ValueError, match="parent_round=5 must be an int >= 0 and <= 4"):
        er.RingSpec(**base, parent_round=5, parent_ranks=(0, 1))
    with pytest.raises(ValueError, match="must be a tuple of world_size=2 ints"):
        er.RingSpec(**base, parent_round=4, parent_ranks=(0,))
    with pytest.raises(ValueError, match="twice"):
        er.RingSpec(**base, parent_round=4, parent_ranks=(1, 1))


# ---------------------------------------------------------------- handle operations, fake library
class _Out:
    """Stands in for nccl_lib.OutComm: NCCL's asynchronous job may write the handle late."""

    def __init__(self, value):
        self.value, self.abandoned = value, False

    def abandon(self, lib):
        self.abandoned = True


class ReformLib(FakeLib):
    """FakeLib with shrink, grow and per-communicator ids; new communicators get ``new_ptr``."""

    def __init__(self, states=(SUCCESS,), status=IN_PROGRESS, new_ptr=0xBEEF, writes_at_once=True):
        super().__init__(states)
        self.status, self.new_ptr, self.writes_at_once, self.outs = status, new_ptr, writes_at_once, []

    def async_error(self, ptr):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def _out(self):
        out = _Out(self.new_ptr if self.writes_at_once else None)
        self.outs.append(out)
        return out

    def shrink_nonblocking(self, comm, exclude, abort):
        self.calls.append(("shrink", comm, tuple(exclude), abort))
        return self._out(), self.status

    def grow_nonblocking(self, comm, world_size, unique_id, rank):
        self.calls.append(("grow", comm, world_size, unique_id, rank))
        return self._out(), self.status

    def split(self, comm, color, key, blocking):
        self.calls.append(("split", comm, color, key, blocking))
        return self._out(), SUCCESS if blocking else self.status

    def comm_unique_id(self, comm):
        self.calls.append(("uid", comm))
        return b"g" * 128

    def abort(self, ptr):
        self.calls.append(("abort", ptr))
        return SUCCESS


def test_shrink_derives_a_settled_handle_from_a_healthy_parent():
    lib, clock = ReformLib([IN_PROGRESS, SUCCESS]), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    child = nccl_reform.shrink(parent, (1,), clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)
    assert child.alive and parent.alive  # the runtime frees the parent afterwards
    assert lib.calls == [("shrink", 0xC0FFEE, (1,), False)]  # NCCL_SHRINK_DEFAULT: the parent is idle


def test_a_handle_nccl_writes_after_the_call_returned_is_awaited():
    lib, clock = ReformLib([IN_PROGRESS, SUCCESS], writes_at_once=False), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    real_sleep = clock.sleep

    def sleep(seconds):  # NCCL's job sets the out-pointer while the caller waits
        real_sleep(seconds)
        if len(clock.sleeps) == 3:
            lib.outs[-1].value = 0xBEEF

    child = nccl_reform.shrink(parent, (1,), clock() + 3, "rank 0/2 round 5", 3.0, clock, sleep)
    assert child.alive and child.keep is lib.outs[-1] and not lib.outs[-1].abandoned


def test_a_handle_that_never_comes_is_abandoned_with_its_buffers_not_freed():
    lib, clock = ReformLib(writes_at_once=False), FakeClock()
    with pytest.raises(CommError, match="ncclCommShrink gave no communicator within connect_timeout_s=3"):
        nccl_reform.shrink(CommHandle(lib, 0xC0FFEE), (1,), clock() + 3, "r", 3.0, clock, clock.sleep)
    assert lib.outs[-1].abandoned  # NCCL may still write into it: kept for the life of the process


def test_a_failing_parent_ends_the_wait_for_its_child():
    lib, clock = ReformLib([3], writes_at_once=False), FakeClock()  # the parent reports ncclInternalError
    with pytest.raises(CommError, match="the parent communicator reports ncclInternalError"):
        nccl_reform.shrink(CommHandle(lib, 0xC0FFEE), (1,), clock() + 3, "r", 3.0, clock, clock.sleep)
    assert lib.outs[-1].abandoned


def test_a_shrink_past_its_deadline_aborts_the_new_communicator():
    lib, clock = ReformLib([IN_PROGRESS]), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    with pytest.raises(CommError, match="ncclCommShrink did not finish within connect_timeout_s=3"):
        nccl_reform.shrink(parent, (2,), clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)
    assert lib.calls[-1] == ("abort", 0xBEEF)


def test_a_shrink_of_an_aborted_parent_fails_clearly():
    lib, clock = ReformLib(), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    parent.detach()
    with pytest.raises(CommError, match="ncclCommShrink failed.*aborted or destroyed"):
        nccl_reform.shrink(parent, (1,), clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)


def test_a_blocking_split_gives_a_settled_child_of_every_rank():
    lib, clock = ReformLib([SUCCESS]), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    child = nccl_reform.split(parent, 1, True, clock() + 3, "rank 1/2 round 5", 3.0, clock, clock.sleep)
    assert child.alive and parent.alive and lib.calls == [("split", 0xC0FFEE, 0, 1, True)]
    lib.states = [3]  # a parent that failed meanwhile: the late child is not awaited forever
    lib.writes_at_once = False
    with pytest.raises(CommError, match="ncclCommSplit failed: the parent communicator reports ncclInternalError"):
        nccl_reform.split(parent, 1, False, clock() + 3, "rank 1/2 round 5", 3.0, clock, clock.sleep)


def test_grow_members_pass_their_parent_and_newcomers_their_rank():
    lib, clock = ReformLib(), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    uid = nccl_reform.grow_id(parent, "rank 0/3 round 6")
    nccl_reform.grow(lib, parent, 3, uid, 0, clock() + 3, "rank 0/3 round 6", 3.0, clock, clock.sleep)
    nccl_reform.grow(lib, None, 3, uid, 2, clock() + 3, "rank 2/3 round 6", 3.0, clock, clock.sleep)
    assert lib.calls == [("uid", 0xC0FFEE), ("grow", 0xC0FFEE, 3, uid, -1), ("grow", None, 3, uid, 2)]


def test_a_failed_grow_names_ncclss_error_and_leaves_nothing_behind():
    lib, clock = ReformLib(status=3, new_ptr=None), FakeClock()  # ncclInternalError, no handle
    with pytest.raises(CommError, match="ncclCommGrow failed"):
        nccl_reform.grow(lib, None, 3, b"g" * 128, 2, clock() + 3, "rank 2/3 round 6", 3.0, clock, clock.sleep)
    assert not any(c[0] == "abort" for c in lib.calls if isinstance(c, tuple)) and lib.outs[-1].abandoned


# ---------------------------------------------------------------- the runtime keeps the parent for the child
class _FakeComm:
    """Stands in for NcclCommunicator in elastic_ring.ring.runtime (no CUDA): records what happens to it."""

    made: list = []

    def __init__(self, spec, parent):
        self.spec, self.parent, self.log = spec, parent, []
        self.errored = self.closed = False
        _FakeComm.made.append(self)

    def abort(self):
        self.log.append("abort")

    def close(self):
        self.log.append("close")

    def release(self):
        self.log.append("release")

    def lend(self):
        self.log.append("lend")


def test_the_runtime_hands_the_previous_communicator_to_a_round_derived_from_it_then_frees_it(monkeypatch):
    from elastic_ring.ring import runtime
    from tests.process_ring import TEST_SECRET
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = er.StoreAddress("127.0.0.1", server.port)
    monkeypatch.setattr(runtime, "_create", lambda spec, store, formation, parent: _FakeComm(spec, parent))
    _FakeComm.made = []

    def spec(round_id, world, **fields):
        return er.RingSpec(round_id=round_id, rank=0, world_size=world, node_ids=("n",) * world, store=address,
                           backend="nccl", job_id="reform-runtime", auth_key=TEST_SECRET, **fields)

    try:
        first = runtime.init(spec(1, 3, nccl_reform="shrink_grow"))
        second = runtime.init(spec(2, 2, nccl_reform="shrink_grow", parent_round=1, parent_ranks=(0, 2)))
        assert second.parent is first and first.log == ["lend", "release"]  # kept alive for the shrink, then freed
        third = runtime.init(spec(3, 2, nccl_reform="shrink_grow", parent_round=1, parent_ranks=(0, 1)))
        assert third.parent is None  # round 1 is not this process's current round: a full init
        assert second.log == ["close", "release"]
        fourth = runtime.init(spec(4, 3, parent_round=3, parent_ranks=(0, 1, -1)))  # nccl_reform="init"
        assert fourth.parent is None and third.log == ["close", "release"]
        # a child that fails to form: the parent is freed all the same, and the error is the child's
        monkeypatch.setattr(runtime, "_create", lambda spec, store, formation, parent: (_ for _ in ()).throw(
            er.CommError("the shrink failed")))
        fifth = spec(5, 2, nccl_reform="shrink_grow", parent_round=4, parent_ranks=(0, 1))
        assert fifth.parent_round == 4
        with pytest.raises(er.CommError, match="the shrink failed"):
            runtime.init(fifth)
        assert fourth.log == ["lend", "release"]  # lent to the attempt, freed after it failed
    finally:
        runtime.shutdown()


# ---------------------------------------------------------------- the agreement over a store
class DictStore:
    """The store calls the agreement makes (set, multi_get, wait, get), in memory."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = bytes(value)

    def get(self, key):
        return self.values[key]

    def multi_get(self, keys):
        return [self.values[k] for k in keys]

    def wait(self, keys, timeout):
        missing = [k for k in keys if k not in self.values]
        if missing:
            raise RuntimeError(f"wait timeout, keys: {missing}")


def _spec(rank, world, parent_ranks, round_id=6):
    return er.RingSpec(round_id=round_id, rank=rank, world_size=world, node_ids=("n",) * world,
                       store=er.StoreAddress("127.0.0.1", 1), backend="nccl", nccl_reform="shrink_grow",
                       parent_round=round_id - 1, parent_ranks=parent_ranks)


GROW_HAS = _has("ncclCommShrink", "ncclCommGrow")


@pytest.mark.parametrize("holds, usable, path", [
    # what each rank holds of the parent (size, rank) and whether it is usable -> the path all take
    ([(3, 0), (3, 2)], [True, True], SHRINK),
    ([(3, 0), (3, 2)], [True, False], INIT),         # one rank's parent failed (or is busy): all do a full init
    ([(3, 0), None], [True, False], INIT),           # one holds no parent at all
    ([(3, 0), (3, 1)], [True, True], INIT),          # the second holds rank 1, the spec says it was rank 2
    ([(2, 0), (3, 2)], [True, True], INIT),          # a parent of another size: not a shrink of it
])
def test_the_agreement_over_a_store_shrinks_only_when_every_rank_can(holds, usable, path):
    store, plans = DictStore(), []
    for rank, (held, ok) in enumerate(zip(holds, usable)):
        spec = _spec(rank, 2, (0, 2))
        plans.append(nccl_reform.publish_token(store, spec, held and held[0], held and held[1], ok,
                                               _has("ncclCommShrink")))
    for rank in range(2):
        assert nccl_reform.agree(store, _spec(rank, 2, (0, 2)), plans[rank], lambda: b"x", 1.0) == (path, None)


def test_a_grow_root_publishes_the_id_members_pass_none_and_the_newcomer_reads_it():
    store, made = DictStore(), []
    holds = [(2, 0), (2, 1), None]
    plans = [nccl_reform.publish_token(store, _spec(r, 3, (0, 1, -1)), h and h[0], h and h[1], h is not None,
                                       GROW_HAS) for r, h in enumerate(holds)]
    grow_id = lambda: made.append(1) or b"g" * 128  # noqa: E731
    root = nccl_reform.agree(store, _spec(0, 3, (0, 1, -1)), plans[0], grow_id, 1.0)
    member = nccl_reform.agree(store, _spec(1, 3, (0, 1, -1)), plans[1], grow_id, 1.0)
    newcomer = nccl_reform.agree(store, _spec(2, 3, (0, 1, -1)), plans[2], grow_id, 1.0)
    assert (root, member, newcomer) == ((GROW, b"g" * 128), (GROW, None), (GROW, b"g" * 128)) and made == [1]


def test_a_newcomer_without_grow_in_its_libnccl_makes_everyone_do_a_full_init():
    store = DictStore()
    holds, has = [(2, 0), (2, 1), None], [GROW_HAS, GROW_HAS, _has("ncclCommShrink")]
    plans = [nccl_reform.publish_token(store, _spec(r, 3, (0, 1, -1)), h and h[0], h and h[1], h is not None,
                                       has[r]) for r, h in enumerate(holds)]
    assert {nccl_reform.agree(store, _spec(r, 3, (0, 1, -1)), plans[r], lambda: b"x", 1.0)[0]
            for r in range(3)} == {INIT}


@pytest.mark.parametrize("environ, shares", [
    ({}, False), ({"NCCL_COMM_SHRINK_SHARE_RESOURCES": "0"}, False),
    ({"NCCL_COMM_SHRINK_SHARE_RESOURCES": "1"}, True), ({"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}, True),
])
def test_a_child_that_would_share_its_parents_resources_is_not_derived(environ, shares):
    assert nccl_reform.shares_resources(environ) is shares


def test_a_parent_aborted_while_its_child_forms_ends_the_wait():
    lib, clock = ReformLib([IN_PROGRESS], writes_at_once=False), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)

    def sleep(seconds):
        clock.sleep(seconds)
        parent.detach()  # aborted by another thread

    with pytest.raises(CommError, match="the parent communicator was aborted meanwhile"):
        nccl_reform.shrink(parent, (1,), clock() + 3, "r", 3.0, clock, sleep)
    assert lib.outs[-1].abandoned


def test_an_abandoned_child_that_comes_late_is_aborted_by_the_reaper():
    import time

    from elastic_ring.backends.nccl.lib import OutComm

    aborted = []

    class Lib:
        def abort(self, ptr):
            aborted.append(ptr)

    out = OutComm()
    out.abandon(Lib())
    out.ptr.value = 0xBEEF  # NCCL's job writes the handle after everyone gave up
    deadline = time.monotonic() + 5
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted == [0xBEEF] and out in OutComm._abandoned  # its buffers stay alive


# ---------------------------------------------------------------- lending: a parent is not aborted under its child
def test_a_lent_parent_records_a_failure_but_is_aborted_only_by_release(monkeypatch):
    import contextlib

    import torch

    from tests.test_nccl_teardown import make_comm

    calls = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    comm = make_comm(FakeLib(), calls)
    comm.lend()
    comm.fail(CommError("abort_round: a member of the round is lost"))  # what abort_round does
    comm.watchdog_failed(CommError("the watchdog's deadline"))
    assert comm.errored and comm.reform_handle() is not None and calls == []  # the derivation may go on
    comm.release()
    assert calls == ["abort", "empty_cache"] and comm.reform_handle() is None
    comm.release()
    assert calls == ["abort", "empty_cache"]
