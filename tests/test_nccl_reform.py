"""NCCL re-form by shrink and grow (elastic_ring.nccl_reform): the decisions as tables, and the handle
operations against a fake library (no CUDA needed). The real thing runs in tests/gpu/test_gpu_reform.py."""

from __future__ import annotations

import pytest

import elastic_ring as er
from elastic_ring import nccl_reform
from elastic_ring.errors import CommError
from elastic_ring.nccl_handle import CommHandle
from elastic_ring.nccl_lib import IN_PROGRESS, SUCCESS
from elastic_ring.nccl_reform import GROW, INIT, SHRINK, Plan

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

    def abandon(self):
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

    def comm_unique_id(self, comm):
        self.calls.append(("uid", comm))
        return b"g" * 128

    def abort(self, ptr):
        self.calls.append(("abort", ptr))
        return SUCCESS


def test_shrink_derives_a_settled_handle_from_the_parent_and_aborts_in_flight_work_of_a_failed_one():
    lib, clock = ReformLib([IN_PROGRESS, SUCCESS]), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    child = nccl_reform.shrink(parent, (1,), True, clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)
    assert child.alive and parent.alive  # the runtime frees the parent afterwards
    assert lib.calls == [("shrink", 0xC0FFEE, (1,), True)]


def test_a_handle_nccl_writes_after_the_call_returned_is_awaited():
    lib, clock = ReformLib([IN_PROGRESS, SUCCESS], writes_at_once=False), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    real_sleep = clock.sleep

    def sleep(seconds):  # NCCL's job sets the out-pointer while the caller waits
        real_sleep(seconds)
        if len(clock.sleeps) == 3:
            lib.outs[-1].value = 0xBEEF

    child = nccl_reform.shrink(parent, (1,), False, clock() + 3, "rank 0/2 round 5", 3.0, clock, sleep)
    assert child.alive and child.keep is lib.outs[-1] and not lib.outs[-1].abandoned


def test_a_handle_that_never_comes_is_abandoned_with_its_buffers_not_freed():
    lib, clock = ReformLib(writes_at_once=False), FakeClock()
    with pytest.raises(CommError, match="ncclCommShrink gave no communicator within connect_timeout_s=3"):
        nccl_reform.shrink(CommHandle(lib, 0xC0FFEE), (1,), False, clock() + 3, "r", 3.0, clock, clock.sleep)
    assert lib.outs[-1].abandoned  # NCCL may still write into it: kept for the life of the process


def test_a_failing_parent_ends_the_wait_for_its_child():
    lib, clock = ReformLib([3], writes_at_once=False), FakeClock()  # the parent reports ncclInternalError
    with pytest.raises(CommError, match="the parent communicator reports ncclInternalError"):
        nccl_reform.shrink(CommHandle(lib, 0xC0FFEE), (1,), False, clock() + 3, "r", 3.0, clock, clock.sleep)
    assert lib.outs[-1].abandoned


def test_a_shrink_past_its_deadline_aborts_the_new_communicator():
    lib, clock = ReformLib([IN_PROGRESS]), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    with pytest.raises(CommError, match="ncclCommShrink did not finish within connect_timeout_s=3"):
        nccl_reform.shrink(parent, (2,), False, clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)
    assert lib.calls[-1] == ("abort", 0xBEEF)


def test_a_shrink_of_an_aborted_parent_fails_clearly():
    lib, clock = ReformLib(), FakeClock()
    parent = CommHandle(lib, 0xC0FFEE)
    parent.detach()
    with pytest.raises(CommError, match="ncclCommShrink failed.*aborted or destroyed"):
        nccl_reform.shrink(parent, (1,), True, clock() + 3, "rank 0/2 round 5", 3.0, clock, clock.sleep)


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
    """Stands in for NcclCommunicator in elastic_ring.runtime (no CUDA): records what happens to it."""

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


def test_the_runtime_hands_the_previous_communicator_to_a_round_derived_from_it_then_frees_it(monkeypatch):
    from elastic_ring import runtime
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
        assert second.parent is first and first.log == ["release"]  # kept alive for the shrink, then freed
        third = runtime.init(spec(3, 2, nccl_reform="shrink_grow", parent_round=1, parent_ranks=(0, 1)))
        assert third.parent is None  # round 1 is not this process's current round: a full init
        assert second.log == ["close", "release"]
        fourth = runtime.init(spec(4, 3, parent_round=3, parent_ranks=(0, 1, -1)))  # nccl_reform="init"
        assert fourth.parent is None and third.log == ["close", "release"]
    finally:
        runtime.shutdown()
    assert _FakeComm.made[-1].log == ["close", "release"]
