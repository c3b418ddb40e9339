"""``er.join()``: Horovod's join for uneven inputs, over real gloo rings of processes.

The cases of Horovod's own join tests (allreduce Sum / Average of two tensors with int and float dtypes, every
rank joining first in turn, the return value; allgather; a broadcast whose root joined), the neutral elements of
the other ops, a ``DistributedOptimizer(strict_checks=True)`` loop with uneven batches checked against a
reference computed here, the lean optimizer refused at ``join()``, and a process set.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import elastic_ring as er

_DTYPES = [torch.int32, torch.int64, torch.float32, torch.float64]


def _expected_average(t: torch.Tensor, size: int) -> torch.Tensor:
    """Every rank but the joined one sent ``t``; the joined one zeros; Average divides by the full size."""
    total = t * (size - 1)
    return total.div(size, rounding_mode="trunc") if not t.is_floating_point() else total / size  # Horovod's trunc


def _horovod_join_allreduce():
    rank, size = er.rank(), er.size()
    bad, returns = [], []
    for dtype, dim, first, op in itertools.product(_DTYPES, (1, 2, 3), range(size), ("average", "sum")):
        torch.manual_seed(1234)
        a = torch.randint(-100, 100, [5] * dim).to(dtype)  # two tensors: fused in one bucket
        b = torch.randint(-100, 100, [17] * dim).to(dtype)
        if rank == first:
            ret = er.join()
        else:
            ha, hb = er.allreduce_async(a, op=op, name="a"), er.allreduce_async(b, op=op, name="b")
            ra, rb = er.synchronize(ha), er.synchronize(hb)
            ret = er.join()
            for got, t in ((ra, a), (rb, b)):
                want = _expected_average(t, size) if op == "average" else t * (size - 1)
                if got.dtype != dtype or not torch.equal(got, want):
                    bad.append((str(dtype), dim, first, op))
        returns.append((first, ret))
    every = er.allgather_object(returns)
    return bad, returns, every


def test_join_allreduce_as_horovods_test_every_rank_joining_first(ring):
    results = ring.run(_horovod_join_allreduce, world_size=3, timeout_s=120)
    for bad, returns, every in results:
        assert bad == []
        assert every == [returns] * 3  # join() returned the same value on every rank
        for first, ret in returns:
            assert ret != first and 0 <= ret < 3  # the rank that joined last, never the first


def _neutral_elements():
    rank, size = er.rank(), er.size()
    out = {}
    for op, dtype in itertools.product(("min", "max", "product"), (torch.int64, torch.float32, torch.uint8)):
        if rank == 0:
            er.join()
        else:
            out[(op, str(dtype))] = er.allreduce(torch.tensor([rank + 2, 7 - rank]).to(dtype), op=op).tolist()
            er.join()
    # a grouped in-place allreduce with compression, and autograd through an allreduce
    x = torch.full((4,), float(rank + 1), requires_grad=True)
    if rank == 0:
        last = er.join()
    else:
        y = er.allreduce(x, op="sum", name="g")
        y.sum().backward()  # the backward allreduce is answered by the joined rank too
        out["grad"] = x.grad.tolist()
        ts = [torch.ones(3) * rank, torch.ones(2, 2, dtype=torch.float64)]
        er.grouped_allreduce_(ts, op="sum", compression=er.Compression.fp16)
        out["grouped"] = [t.tolist() for t in ts]
        last = er.join()
    out["last"] = last
    return out


def test_joined_rank_contributes_the_neutral_element_of_every_op(ring):
    results = ring.run(_neutral_elements, world_size=3, timeout_s=60)
    for rank in (1, 2):
        out = results[rank]
        for dtype in ("torch.int64", "torch.float32", "torch.uint8"):
            assert out[("min", dtype)] == [3, 5]   # ranks 1, 2 sent [3, 6] and [4, 5]; rank 0 nothing
            assert out[("max", dtype)] == [4, 6]
            assert out[("product", dtype)] == [12, 30]
        assert out["grad"] == [2.0] * 4  # backward: the sum of the two upstream gradients of ones
        assert out["grouped"] == [[3.0] * 3, [[2.0, 2.0], [2.0, 2.0]]]
    assert [r["last"] for r in results] == [2, 2, 2]  # ranks 1 and 2 joined together: the higher one is named


def _allgather_broadcast_barrier():
    rank = er.rank()
    out = {}
    if rank == 0:
        out["join"] = er.join()
        out["objects_after"] = er.allgather_object(rank), er.broadcast_object(rank, root_rank=0)
        return out
    out["gathered"] = er.allgather(torch.full((rank, 2), float(rank))).tolist()
    out["bcast"] = er.broadcast(torch.full((3,), float(rank)), root_rank=2).tolist()
    out["object"] = er.broadcast_object({"from": rank}, root_rank=1)
    er.barrier()
    out["agree_max"] = er.agree_max("flags", [rank, 1])
    try:
        er.broadcast(torch.zeros(3), root_rank=0)  # its root has joined: an error on every rank that called it
    except er.TensorMismatchError as exc:
        out["root_joined"] = str(exc)
    try:
        er.reducescatter(torch.ones(4))
    except er.TensorMismatchError as exc:
        out["reducescatter"] = str(exc)
    try:
        er.allreduce(torch.ones(2 + rank), name="x")  # the others disagree: they raise, the joined rank waits
    except er.TensorMismatchError as exc:
        out["mismatch"] = str(exc)
    out["after"] = er.allreduce(torch.ones(2), op="sum").tolist()  # the ring is still usable
    out["join"] = er.join()
    # the joined rank answered broadcast_object: its object collectives' sequence numbers (bound into their
    # MACs) stayed in step with the others', so the next ones authenticate
    out["objects_after"] = er.allgather_object(rank), er.broadcast_object(rank, root_rank=0)
    return out


def test_allgather_broadcast_barrier_and_errors_with_a_joined_rank(ring):
    started = time.monotonic()
    results = ring.run(_allgather_broadcast_barrier, world_size=3, timeout_s=60)
    assert time.monotonic() - started < 30  # no error waited for a timeout
    assert [r["join"] for r in results] == [2, 2, 2]
    assert [r["objects_after"] for r in results] == [([0, 1, 2], 0)] * 3
    for rank in (1, 2):
        out = results[rank]
        assert out["gathered"] == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]  # no rows from the joined rank 0
        assert out["bcast"] == [2.0] * 3
        assert out["object"] == {"from": 1}
        assert out["agree_max"] == [2, 1]
        assert "root, rank 0, has joined" in out["root_joined"]
        assert "cannot run while rank 0 have joined" in out["reducescatter"]
        assert "rank 1:" in out["mismatch"] and "rank 2:" in out["mismatch"]
        assert out["after"] == [2.0, 2.0]


def _horovod_join_broadcast():
    """Horovod's test: the others broadcast from their own rank while one rank waits in join()."""
    rank, size = er.rank(), er.size()
    errors, returns = [], []
    for first in range(size):
        if rank == first:
            ret = er.join()
        else:
            try:
                er.broadcast(torch.ones(17, 17), root_rank=first)
                errors.append(None)
            except RuntimeError as exc:  # what Horovod's test catches
                errors.append(type(exc).__name__)
            ret = er.join()
        returns.append(ret)
    return errors, returns, er.allgather_object(returns)


def test_broadcast_from_a_joined_root_raises_on_every_caller_and_join_still_returns(ring):
    results = ring.run(_horovod_join_broadcast, world_size=2, timeout_s=60)
    for errors, returns, every in results:
        assert errors == ["TensorMismatchError"]
        assert returns == [1, 0] and every == [returns, returns]


# ------------------------------------------------------------------ DistributedOptimizer with uneven batches
_STEPS = (2, 4, 3)  # batches per rank


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Linear(3, 1)


def _uneven_training(strict: bool):
    rank = er.rank()
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  strict_checks=strict, autotune=False)
    for k in range(_STEPS[rank]):
        x, y = _batch(rank, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = er.join()
    er.broadcast_parameters(model.state_dict(), root_rank=last)
    return last, [p.detach().clone() for p in model.parameters()]


def _reference(size: int) -> list[torch.Tensor]:
    """The same training in one process: at step k, the gradients of the ranks that still have a batch, summed
    and divided by the full size (a joined rank's zeros count)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(max(_STEPS)):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(size):
            if k < _STEPS[rank]:
                model.zero_grad()
                x, y = _batch(rank, k)
                torch.nn.functional.mse_loss(model(x), y).backward()
                for g, p in zip(grads, model.parameters()):
                    g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / size
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_uneven_batches_train_with_a_strict_optimizer_and_join(ring):
    results = ring.run(_uneven_training, True, world_size=3, timeout_s=60)
    want = _reference(3)
    assert [last for last, _ in results] == [1, 1, 1]
    for _, params in results:
        for got, expected in zip(params, want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _first_step_of_a_lean_optimizer():
    """A rank joins before the ring's first step: every step of a lean optimizer then leads with a check."""
    rank = er.rank()
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  autotune=False)
    steps = 0 if rank == 0 else 3
    for k in range(steps):
        x, y = _batch(rank, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = er.join()
    er.broadcast_parameters(model.state_dict(), root_rank=last)
    # after the join, the ranks' step counts differ; the ring trains on (lean again after one checked step)
    for k in range(3):
        x, y = _batch(rank, 10 + k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_lean_optimizer_joins_when_the_rank_joins_before_the_rings_first_step(ring):
    results = ring.run(_first_step_of_a_lean_optimizer, world_size=3, timeout_s=60)
    for params in results[1:]:
        for got, ref in zip(params, results[0]):
            assert torch.equal(got, ref)


def _lean_then_join():
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  autotune=False)
    for k in range(2):
        x, y = _batch(er.rank(), k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    started = time.monotonic()
    try:
        er.join()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - started
    return None, time.monotonic() - started


def test_a_lean_optimizer_refuses_join_at_once(ring):
    for message, seconds in ring.run(_lean_then_join, world_size=2, timeout_s=30):
        assert message is not None and "strict_checks=True" in message
        assert seconds < 1.0


def _process_set_join():
    rank = er.rank()
    if rank == 2:
        return None
    with er.process_sets.scope([0, 1]):
        if rank == 0:
            return er.join()
        out = er.allreduce(torch.full((2,), 4.0), op="average").tolist()
        return out, er.join()


def test_join_inside_a_process_set(ring):
    results = ring.run(_process_set_join, world_size=3, timeout_s=60)
    assert results == [1, ([2.0, 2.0], 1), None]


def _join_while_a_peer_dies():
    import os

    rank = er.rank()
    started = time.monotonic()
    try:
        if rank == 0:
            er.join()
        for _ in range(20):
            er.allreduce(torch.ones(3), op="sum")
        if rank == 2:
            os._exit(1)  # a peer lost while rank 0 waits in join() and rank 1 reduces
        for _ in range(1000):
            er.allreduce(torch.ones(3), op="sum")
    except er.CommError as exc:
        return type(exc).__name__, time.monotonic() - started
    return None, time.monotonic() - started


def test_a_peer_lost_while_a_rank_waits_in_join_raises_comm_error_there(ring):
    """The joined rank does not hang: its wait fails with CommError, as every survivor's collective does (the
    elastic loop then re-forms and re-enters; the joined state belongs to the join() call)."""
    results = ring.start(_join_while_a_peer_dies, world_size=3).results(timeout_s=60, raise_errors=False)
    for rank in (0, 1):
        kind, seconds = results[rank]
        assert kind == "CommError" and seconds < 30


# ------------------------------------------------------------------ the joined rank's own deadline
def _peer_busy_longer_than_the_collective_timeout(busy_s: float, join_timeout_s: float | None):
    """Rank 0 joins at once; rank 1 works ``busy_s`` (longer than collective_timeout_s) before its allreduce."""
    rank = er.rank()
    started = time.monotonic()
    try:
        if rank == 0:
            out = ("joined", er.join(timeout_s=join_timeout_s))
        else:
            time.sleep(busy_s)  # an evaluation pass, a checkpoint write
            value = er.allreduce(torch.ones(2), op="sum").tolist()
            out = ("reduced", value, er.join())
        after = er.allreduce(torch.ones(1), op="sum").item()  # the ring is still usable
    except er.CommError as exc:
        return "CommError", str(exc)[:200], time.monotonic() - started
    return out, after, time.monotonic() - started


def test_a_joined_rank_outwaits_a_gap_longer_than_the_collective_timeout(ring):
    """A joined rank's wait has its own long deadline (JOIN_WAIT_S), not collective_timeout_s (2 s here)."""
    results = ring.run(_peer_busy_longer_than_the_collective_timeout, 4.0, None, world_size=2, timeout_s=60,
                       collective_timeout_s=2)
    assert results[0][:2] == (("joined", 1), 2.0)
    assert results[1][:2] == (("reduced", [1.0, 1.0], 1), 2.0)
    assert er.collectives.join.JOIN_WAIT_S >= 600


def test_reaching_the_join_deadline_fails_the_ring_on_every_rank(ring):
    """``join(timeout_s=1)`` while the peer works 3 s: CommError on the joined rank after about 1 s, and the
    peer's next collective fails at once (documented: the ring must re-form)."""
    results = ring.start(_peer_busy_longer_than_the_collective_timeout, 3.0, 1.0, world_size=2,
                         collective_timeout_s=20).results(timeout_s=60)
    kind, _, seconds = results[0]
    assert kind == "CommError" and 0.9 < seconds < 10, results[0]
    kind, _, seconds = results[1]
    assert kind == "CommError" and seconds < 15, results[1]  # not its own 20 s deadline after the sleep


def test_join_timeout_must_be_positive():
    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ValueError, match="join\\(timeout_s="):
            er.join(timeout_s=bad)


# ------------------------------------------------------------------ plans a joined rank cannot mirror
def _unmirrorable_plans():
    from elastic_ring.collectives.agreement import agree
    from elastic_ring.reduction.signature import start_check
    from elastic_ring.ring import runtime

    rank = er.rank()
    comm = runtime.current()
    if rank == 0:
        started = time.monotonic()
        try:
            er.join()
        except er.CommError:
            return "CommError", time.monotonic() - started
        return "returned", time.monotonic() - started
    out = {}
    bad = {"run": "allreduce", "op": "sum", "compression": "bogus", "threshold": 0, "tensors": [["float32", [2]]]}
    try:  # validated by the callers before it is sent: every caller raises, the joined rank waits on
        agree(comm, "custom call", [], None, None, join_plan=bad)
        out["agree"] = None
    except er.TensorMismatchError as exc:
        out["agree"] = str(exc)
    out["after"] = er.allreduce(torch.ones(2), op="sum").tolist()  # answered by the joined rank
    # a plan that passes no caller's validation (a peer on another version): the joined rank fails the ring at
    # once instead of leaving the callers waiting for their 20 s deadline
    started = time.monotonic()
    try:
        start_check(comm, "odd step", [], None, join_plan={"run": "buckets", "op": "sum",
                                                            "buckets": [["no_such_dtype", 3]]}).finish()
        er.allreduce(torch.ones(3), op="sum")
        out["odd"] = None
    except er.CommError:
        out["odd"] = "CommError"
    out["odd_s"] = time.monotonic() - started
    return out


def test_a_plan_a_joined_rank_cannot_mirror_raises_on_the_callers_or_fails_the_ring_at_once(ring):
    results = ring.start(_unmirrorable_plans, world_size=3, collective_timeout_s=20).results(timeout_s=60)
    assert results[0][0] == "CommError" and results[0][1] < 15
    for out in results[1:]:
        assert out["agree"] is not None and "compression 'bogus'" in out["agree"], out
        assert out["after"] == [2.0, 2.0]
        assert out["odd"] == "CommError" and out["odd_s"] < 15, out


# ------------------------------------------------------------------ which optimizers join() asks
def _switched_optimizers(alternate: bool):
    """A lean optimizer steps twice, then a strict one (another model) takes over; with ``alternate`` the lean
    one keeps stepping in turn with it (as a GAN's two optimizers)."""
    rank = er.rank()
    old, new = _model(), _model()
    lean = er.DistributedOptimizer(torch.optim.SGD(old.parameters(), lr=0.1), old.named_parameters(),
                                   autotune=False)
    strict = er.DistributedOptimizer(torch.optim.SGD(new.parameters(), lr=0.1), new.named_parameters(),
                                     strict_checks=True, autotune=False)

    def step(model, opt, k):
        x, y = _batch(rank, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for k in range(2):
        step(old, lean, k)
    for k in range(2):
        step(new, strict, k)
        if alternate:
            step(old, lean, k)
    if rank == 1 and not alternate:  # one more batch on rank 1: rank 0 joins first and answers its strict step
        step(new, strict, 5)
    try:
        return er.join()
    except RuntimeError as exc:
        if "strict_checks=True" not in str(exc):
            raise
        return "refused"


def test_join_ignores_an_optimizer_another_has_superseded_on_the_ring(ring):
    assert ring.run(_switched_optimizers, False, world_size=2, timeout_s=60) == [1, 1]


def test_join_still_refuses_a_lean_optimizer_stepped_in_turn_with_a_strict_one(ring):
    assert ring.run(_switched_optimizers, True, world_size=2, timeout_s=60) == ["refused", "refused"]


# ------------------------------------------------------------------ what a joined rank learns from an agreement
class _Notice(Exception):
    pass


def _raise_on_notice(values: list[int]) -> None:
    if values[0]:
        raise _Notice(f"notice {values[:2]}")


def _agreement_raises_on_the_joined_rank_too():
    from elastic_ring.collectives import join as join_module

    join_module.add_answer_listener("test.notices", _raise_on_notice)
    try:
        rank = er.rank()
        out = []
        if rank == 0:
            try:
                er.join()
            except _Notice as exc:
                out.append(str(exc))
        else:
            quiet = er.agree_max("test.notices", [0, rank])  # answered, nothing raised on the joined rank
            values = er.agree_max("test.notices", [rank - 1, 7])  # rank 2 has a notice: every caller acts on it
            out.append((quiet, values))
        out.append(er.allreduce(torch.ones(1), op="sum").item())  # the ring is usable, every rank out of join()
        return out
    finally:
        join_module.remove_answer_listener("test.notices", _raise_on_notice)


def test_a_joined_rank_raises_what_an_agreement_makes_the_callers_raise(ring):
    """The hook the state layer's commit agreement uses: on a joined rank, a registered listener sees the values
    the callers agreed on and raises out of join() (MembershipChanged / TrainingStopped there)."""
    results = ring.run(_agreement_raises_on_the_joined_rank_too, world_size=3, timeout_s=60)
    assert results[0] == ["notice [1, 7]", 3.0]
    assert results[1] == results[2] == [([0, 2], [1, 7]), 3.0]
