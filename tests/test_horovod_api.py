"""What a Horovod PyTorch user calls, through ``ray_integration.horovod`` on real gloo rings (issue 24):
broadcast_parameters' argument forms, HorovodInternalError, sparse tensors and gradients, process sets, the
untested _async and grouped forms, and every collective x every dtype against a local reference."""

from __future__ import annotations

import pytest
import torch

import elastic_ring as er
import ray_integration.horovod as hvd


# ------------------------------------------------------------------ the public names
#: What ``horovod.torch`` exports (its ``__init__``'s imports, Horovod 0.28 / master 2026).
HOROVOD_TORCH_NAMES = {
    "elastic", "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize", "init",
    "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size", "rank", "local_rank",
    "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "DistributedOptimizer", "SyncBatchNorm",
}
#: Ours beyond Horovod's (``horovod.common.exceptions.HostsUpdatedInterrupt``; ``is_homogeneous`` of its basics).
EXTRA_NAMES = {"HostsUpdatedInterrupt", "is_homogeneous"}


def test_the_public_names_are_horovods():
    assert set(hvd.__all__) == HOROVOD_TORCH_NAMES | EXTRA_NAMES
    missing = [name for name in hvd.__all__ if not hasattr(hvd, name)]
    assert not missing, f"__all__ names what hvd lacks: {missing}"
    namespace: dict = {}
    exec("from ray_integration.horovod import *", namespace)  # noqa: S102 - what a script's star import gets
    assert HOROVOD_TORCH_NAMES <= set(namespace)


# ------------------------------------------------------------------ broadcast_parameters
def _broadcast_parameter_forms():
    rank = er.rank()
    out = {}

    def model():
        torch.manual_seed(100 + rank)  # every rank starts elsewhere
        return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))

    def root_values():
        torch.manual_seed(100)  # what rank 0 holds
        return [t.detach().clone() for t in torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
                .state_dict().values()]

    expected = root_values()
    forms = {
        "list of tensors": lambda m: list(m.parameters()),
        "list of (name, tensor)": lambda m: list(m.named_parameters()),
        "generator of (name, tensor)": lambda m: m.named_parameters(),
        "state_dict": lambda m: m.state_dict(),
        "dict": lambda m: dict(m.named_parameters()),
        "module": lambda m: m,
    }
    for label, form in forms.items():
        m = model()
        hvd.broadcast_parameters(form(m), root_rank=0)
        got = list(m.state_dict().values())
        params_only = label not in ("state_dict", "module")
        pairs = list(zip(got, expected))
        pairs = [pairs[i] for i in (0, 1, 2, 3)] if params_only else pairs  # weight, bias, bn weight, bn bias
        out[label] = all(torch.equal(a, b) for a, b in pairs)
    m = model()
    hvd.broadcast_parameters(list(m.parameters()), 1, prefix="model")  # root_rank positional, a prefix
    out["root 1"] = m[0].weight.detach().clone()
    for bad in (torch.ones(2), 3, "params"):
        try:
            hvd.broadcast_parameters(bad, root_rank=0)
        except (TypeError, ValueError) as exc:
            out.setdefault("bad", []).append(type(exc).__name__)
    hvd.barrier()
    return out


def test_broadcast_parameters_takes_every_form_horovod_accepts(ring):
    results = ring.run(_broadcast_parameter_forms, world_size=2, timeout_s=60)
    for out in results:
        for label in ("list of tensors", "list of (name, tensor)", "generator of (name, tensor)", "state_dict", "dict",
                      "module"):
            assert out[label] is True, label
        assert out["bad"] == ["ValueError", "ValueError", "ValueError"]
    assert torch.equal(results[0]["root 1"], results[1]["root 1"])


# ------------------------------------------------------------------ HorovodInternalError
def test_horovod_internal_error_is_a_runtime_error_and_a_comm_error_and_not_a_membership_change():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.HorovodInternalError, er.CommError)
    assert not issubclass(hvd.HorovodInternalError, er.MembershipChanged)
    assert hvd.HostsUpdatedInterrupt is er.MembershipChanged and not issubclass(er.MembershipChanged, er.CommError)
    plain = er.CommError("peer lost")
    plain.live_state_consistent = True
    translated = hvd.errors._internal_error(plain)
    assert isinstance(translated, hvd.HorovodInternalError) and str(translated) == "peer lost"
    assert translated.live_state_consistent is True  # what the elastic loop reads survives


def _failed_collectives():
    from elastic_ring.ring import runtime

    rank = er.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # a healthy first step
    try:  # once rank 0 passed it, rank 1's step is complete; rank 0's abort may still hit rank 1's barrier
        hvd.barrier()
    except RuntimeError:
        pass
    if rank == 0:
        runtime.abort_round(er.round_id(), "test: a peer is declared lost")  # this rank's ring fails
    caught = {}
    for label, call in (("allreduce", lambda: hvd.allreduce(torch.ones(3))),
                        ("synchronize", lambda: hvd.synchronize(hvd.allgather_async(torch.ones(2)))),
                        ("broadcast_parameters", lambda: hvd.broadcast_parameters(list(model.parameters()), 0)),
                        ("optimizer", lambda: (model(torch.ones(1, 2)).sum().backward(), opt.step()))):
        try:
            call()
        except RuntimeError as exc:  # a Horovod script's clause
            caught[label] = (type(exc).__name__, isinstance(exc, er.CommError))
    return caught


def test_a_failed_collective_raises_horovod_internal_error_caught_by_except_runtime_error(ring):
    results = ring.run(_failed_collectives, world_size=2, timeout_s=60, collective_timeout_s=2)
    for caught in results:
        assert caught == {label: ("HorovodInternalError", True)
                          for label in ("allreduce", "synchronize", "broadcast_parameters", "optimizer")}


# ------------------------------------------------------------------ sparse
def _random_sparse(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(rows, 5, generator=g)
    t[t < 0.7] = 0
    return t.to_sparse()


def _sparse_allreduce():
    rank, size = er.rank(), er.size()
    out = {}
    tensors = [_random_sparse(rows, 10 * rank + i) for i, rows in enumerate((7, 12, 1))]
    handles = [hvd.sparse_allreduce_async(t, name=f"s{i}", op=hvd.Average) for i, t in enumerate(tensors)]
    gathered = [handle() for handle in handles]  # Horovod's handles are called
    dense = [hvd.allreduce(t.to_dense(), name=f"d{i}") for i, t in enumerate(tensors)]
    out["average"] = all(g.is_sparse and torch.allclose(g.to_dense(), d) for g, d in zip(gathered, dense))
    summed = hvd.synchronize(hvd.sparse_allreduce_async(tensors[0], name="sum", op=hvd.Sum))
    out["sum"] = torch.allclose(summed.to_dense(), hvd.allreduce(tensors[0].to_dense(), op=hvd.Sum))
    direct = hvd.allreduce(tensors[1], name="direct")  # allreduce of a sparse tensor
    out["allreduce"] = direct.is_sparse and torch.allclose(direct.to_dense(), dense[1])
    expected = sum(_random_sparse(7, 10 * r).to_dense() for r in range(size)) / size
    out["reference"] = torch.allclose(gathered[0].to_dense(), expected)
    return out


def test_sparse_allreduce_by_allgather_equals_the_dense_allreduce(ring):
    for out in ring.run(_sparse_allreduce, world_size=3, timeout_s=60):
        assert out == {"average": True, "sum": True, "allreduce": True, "reference": True}


def _inputs(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]])


def _sparse_embedding_steps(sparse_as_dense: bool, optimizer: str):
    rank, size = er.rank(), er.size()

    def model():
        torch.manual_seed(3)
        return torch.nn.Embedding(10, 3, sparse=True)

    def make_opt(params):
        return torch.optim.SparseAdam(params, lr=0.1) if optimizer == "sparseadam" else torch.optim.SGD(params, lr=0.5)

    emb = model()
    opt = hvd.DistributedOptimizer(make_opt(list(emb.parameters())), emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    grads_sparse = []
    for _ in range(3):
        opt.zero_grad()
        emb(_inputs(rank)).pow(2).sum().backward()
        opt.step()
        grads_sparse.append(emb.weight.grad.is_sparse)
    # the reference: one process, the gradient averaged over both ranks' inputs, handed over sparse
    ref = model()
    ref_opt = make_opt(list(ref.parameters()))
    for _ in range(3):
        total = torch.zeros(10, 3)
        for r in range(size):
            ref.zero_grad()
            ref(_inputs(r)).pow(2).sum().backward()
            total += ref.weight.grad.to_dense()
        ref.weight.grad = (total / size).to_sparse() if sparse_as_dense else (total / size).to_sparse(1)
        ref_opt.step()
    return grads_sparse, torch.allclose(emb.weight, ref.weight, atol=1e-6), emb.weight.detach().clone()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("optimizer", ["sparseadam", "sgd"])
def test_sparse_gradients_are_reduced_and_handed_back_sparse(ring, sparse_as_dense, optimizer):
    results = ring.run(_sparse_embedding_steps, sparse_as_dense, optimizer, world_size=2, timeout_s=60)
    for grads_sparse, matches, _ in results:
        assert grads_sparse == [True] * 3 and matches
    assert torch.equal(results[0][2], results[1][2])


def _join_returns_the_last_rank():
    if hvd.rank() == 0:
        return hvd.join()
    averaged = hvd.allreduce(torch.full((2,), 6.0), average=True)  # rank 0 joined: zeros, divided by 2
    return averaged.tolist(), hvd.join()


def test_join_answers_the_others_collectives(ring):  # more in tests/test_horovod_join.py
    assert ring.run(_join_returns_the_last_rank, world_size=2) == [1, ([3.0, 3.0], 1)]


# ------------------------------------------------------------------ process sets
def _process_sets():
    rank = er.rank()
    out = {}
    evens, odd_two = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[evens])
    hvd.add_process_set(odd_two)
    out["ids"] = (evens.process_set_id, odd_two.process_set_id, hvd.global_process_set.process_set_id)
    out["evens"] = (evens.ranks, evens.size(), evens.rank(), evens.included())
    try:
        hvd.add_process_set([0, 2])
    except ValueError as exc:
        out["duplicate"] = "duplicate" in str(exc)
    if rank in (0, 2):
        t = torch.full((4,), float(rank + 1))
        out["allreduce"] = hvd.allreduce(t, op=hvd.Sum, process_set=evens).tolist()
        out["average"] = hvd.allreduce(t, process_set=evens).tolist()  # divided by the set's size
        out["allgather"] = hvd.allgather(torch.full((rank + 1, 1), rank), process_set=evens).view(-1).tolist()
        out["broadcast"] = hvd.broadcast(t, root_rank=2, process_set=evens).tolist()  # a global root rank
        out["reducescatter"] = hvd.reducescatter(torch.arange(4.0) * (rank + 1), op=hvd.Sum,
                                                 process_set=evens).tolist()
        out["alltoall"] = hvd.alltoall(torch.tensor([10 * rank, 10 * rank + 1]), process_set=evens).tolist()
        out["object"] = hvd.broadcast_object({"from": rank}, root_rank=2, process_set=evens)
        out["objects"] = hvd.allgather_object(rank, process_set=evens)
        handle = hvd.allreduce_async(torch.ones(2) * rank, op=hvd.Sum, process_set=evens)
        out["async"] = hvd.synchronize(handle).tolist()
        x = torch.ones(3, requires_grad=True)
        hvd.allreduce(x * (rank + 1), op=hvd.Sum, process_set=evens).sum().backward()  # backward on the set too
        out["grad"] = x.grad.tolist()
        hvd.barrier(process_set=evens)
        try:
            hvd.broadcast(t, root_rank=1, process_set=evens)
        except ValueError as exc:
            out["root outside"] = "not a member" in str(exc)
    if rank in (1, 2):  # rank 2 is in both sets: it comes here after the evens' calls
        out["odd_two"] = hvd.allreduce(torch.tensor([rank]), op=hvd.Sum, process_set=odd_two).tolist()
    else:
        try:
            hvd.allreduce(torch.ones(1), process_set=odd_two)
        except ValueError as exc:
            out["not member"] = "not a member" in str(exc)
    out["global"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()  # the whole ring, as before
    set_opt = hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), process_set=evens)
    out["optimizer on a set"] = set_opt.process_set is evens  # tests/test_horovod_optimizer_forms.py runs it
    out["removed"] = (hvd.remove_process_set(odd_two), hvd.remove_process_set(hvd.global_process_set))
    try:
        hvd.allreduce(torch.ones(1), process_set=odd_two)
    except ValueError as exc:
        out["unregistered"] = "not registered" in str(exc)
    return out


def _process_set_after_reform(expect_usable: bool):
    """The next round (a new task): the set registered in the last one still names ranks 0 and 2."""
    from elastic_ring.ring import process_sets

    evens = next(s for s in hvd.process_sets._Registry.sets.values() if s.ranks == [0, 2])
    leftover = len(process_sets._subrings)  # the last round's sub-rings went with its ring
    rank = er.rank()
    if rank not in (0, 2) and expect_usable:
        result = None
    else:
        try:
            result = hvd.allreduce(torch.tensor([rank + 1]), op=hvd.Sum, process_set=evens).item()
        except ValueError as exc:
            result = "ValueError: " + str(exc)[:80]
    hvd.remove_process_set(evens)
    return leftover, result


def test_process_sets_run_on_sub_rings_that_re_form_with_the_ring(ring):
    results = ring.run(_process_sets, world_size=3, timeout_s=90)
    for rank, out in enumerate(results):
        assert out["ids"] == (1, 2, 0)
        assert out["evens"] == ([0, 2], 2, {0: 0, 1: -1, 2: 1}[rank], rank in (0, 2))
        assert out["duplicate"] is True
        assert out["global"] == 3.0 and out["optimizer on a set"] is True
        assert out["removed"] == (True, False) and out["unregistered"] is True
    for rank in (0, 2):
        out = results[rank]
        assert out["allreduce"] == [4.0] * 4 and out["average"] == [2.0] * 4
        assert out["allgather"] == [0, 2, 2, 2]
        assert out["broadcast"] == [3.0] * 4
        assert out["reducescatter"] == ([[0.0, 4.0]] if rank == 0 else [[8.0, 12.0]])[0]
        assert out["alltoall"] == ([0, 20] if rank == 0 else [1, 21])
        assert out["object"] == {"from": 2} and out["objects"] == [0, 2]
        # the upstream ones summed over the set's two ranks, times this rank's factor
        assert out["async"] == [2.0, 2.0] and out["grad"] == [2.0 * (rank + 1)] * 3
        assert out["root outside"] is True
    assert results[0]["not member"] is True
    assert results[1]["odd_two"] == [3] and results[2]["odd_two"] == [3]
    # a new round of the same three processes: the set is re-formed over whoever holds ranks 0 and 2 now
    again = ring.run(_process_set_after_reform, True, world_size=3, timeout_s=60)
    assert [a[0] for a in again] == [0, 0, 0]
    assert [a[1] for a in again] == [4, None, 4]


def _register_evens():
    hvd.init(process_sets=[hvd.ProcessSet([0, 2])])
    return True


def test_a_process_set_naming_a_rank_the_smaller_ring_lacks_raises_on_use(ring):
    assert ring.run(_register_evens, world_size=3) == [True] * 3
    shrunk = ring.run(_process_set_after_reform, False, world_size=2, timeout_s=60)
    for leftover, result in shrunk:
        assert result.startswith("ValueError: process set [0, 2] names rank(s) [2]")


# ------------------------------------------------------------------ _async and grouped forms
def _async_and_grouped():
    rank, size = er.rank(), er.size()
    out = {}
    a, b = torch.full((rank + 1, 2), float(rank)), torch.arange(3) + 10 * rank
    out["grouped_allgather"] = [t.tolist() for t in hvd.grouped_allgather([a, b])]
    handle = hvd.grouped_allgather_async([a, b])
    out["grouped_allgather_async"] = [t.tolist() for t in hvd.synchronize(handle)]
    out["second synchronize"] = hvd.synchronize(handle)  # Horovod: None, no error
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(a)).tolist()
    t = torch.full((3,), float(rank + 7))
    out["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(t, 1)).tolist()
    inplace = t.clone()
    handle = hvd.broadcast_async_(inplace, 0)
    out["poll"] = isinstance(hvd.poll(handle), bool)
    out["broadcast_async_"] = (hvd.synchronize(handle) is inplace, inplace.tolist())
    x = torch.arange(5.0) * (rank + 1)
    out["reducescatter_async"] = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)).tolist()
    out["grouped_reducescatter"] = [r.tolist() for r in hvd.grouped_reducescatter([x, x * 2], op=hvd.Average)]
    handle = hvd.grouped_reducescatter_async([x, x * 2], op=hvd.Sum, prescale_factor=2.0)
    out["grouped_reducescatter_async"] = [r.tolist() for r in hvd.synchronize(handle)]
    rows = torch.tensor([100 * rank + j for j in range(size)])
    out["alltoall_async"] = hvd.synchronize(hvd.alltoall_async(rows)).tolist()
    out["alltoall_async splits"] = [v.tolist() for v in hvd.synchronize(
        hvd.alltoall_async(torch.arange(3) + 10 * rank, splits=[1, 2] if rank == 0 else [2, 1]))]
    bad = hvd.alltoall_async(torch.ones(3), splits=[3, 0] if rank == 0 else [1, 1])  # bad splits on rank 1 only
    try:
        hvd.synchronize(bad)
    except ValueError as exc:
        out["bad splits"] = type(exc).__name__
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    return out


def test_async_and_grouped_forms_and_a_second_synchronize_as_in_horovod(ring):
    results = ring.run(_async_and_grouped, world_size=2, timeout_s=60)
    for rank, out in enumerate(results):
        gathered = [[[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], [0, 1, 2, 10, 11, 12]]
        assert out["grouped_allgather"] == gathered and out["grouped_allgather_async"] == gathered
        assert out["second synchronize"] is None
        assert out["allgather_async"] == gathered[0]
        assert out["broadcast_async"] == [8.0] * 3 and out["poll"] is True
        assert out["broadcast_async_"] == (True, [7.0] * 3)
        block = [0, 1, 2] if rank == 0 else [3, 4]  # 5 rows over 2 ranks: 3, 2
        assert out["reducescatter_async"] == [3.0 * i for i in block]
        assert out["grouped_reducescatter"] == [[1.5 * i for i in block], [3.0 * i for i in block]]
        assert out["grouped_reducescatter_async"] == [[6.0 * i for i in block], [12.0 * i for i in block]]
        assert out["alltoall_async"] == [rank, 100 + rank]
        assert out["alltoall_async splits"] == ([[0, 10, 11], [1, 2]] if rank == 0 else [[1, 2, 12], [2, 1]])
        assert out["bad splits"] in ("ValueError", "TensorMismatchError")
        assert out["after"] == 2.0


# ------------------------------------------------------------------ every collective x every dtype
NUMERIC = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64)
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


def _values(rank: int, dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """Small values every dtype holds exactly, different per rank (and negative where the dtype can be)."""
    base = torch.arange(n) % 4 + rank
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                 torch.float64):
        base = base - 2 * (torch.arange(n) % 2) * rank
    if dtype == torch.bool:
        return ((torch.arange(n) + rank) % 3 == 0)
    return base.to(dtype)


def _reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    dtype = xs[0].dtype
    stack = torch.stack([x.to(torch.float64) for x in xs])
    if op == "Sum":
        out = stack.sum(0)
    elif op == "Product":
        out = stack.prod(0)
    elif op == "Min":
        out = stack.min(0).values
    elif op == "Max":
        out = stack.max(0).values
    elif dtype.is_floating_point:
        out = stack.sum(0) / len(xs)
    else:  # Horovod: an integer average is the sum times 1 / size, truncated toward zero
        out = torch.trunc(stack.sum(0) / len(xs))
    return out.to(dtype)


def _every_collective_every_dtype():
    rank, size = er.rank(), er.size()
    failures, checks = [], []

    def check(label, got, expected):
        checks.append(label)
        if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
            failures.append(f"{label}: got {got.tolist()} ({got.dtype}), expected {expected.tolist()}")

    for dtype in NUMERIC + (torch.bool,):
        mine = _values(rank, dtype)
        every = [_values(r, dtype) for r in range(size)]
        name = str(dtype).replace("torch.", "")
        for label, op in OPS.items():
            if dtype == torch.bool:
                try:
                    hvd.allreduce(mine, op=op, name=f"{name}.{label}")
                    failures.append(f"allreduce {name} {label}: no error")
                except ValueError:
                    pass
                continue
            check(f"allreduce {name} {label}", hvd.allreduce(mine, op=op, name=f"{name}.{label}"),
                  _reference(label, every))
            inplace = mine.clone()
            hvd.allreduce_(inplace, op=op, name=f"{name}.{label}_")
            check(f"allreduce_ {name} {label}", inplace, _reference(label, every))
        ragged = mine[: rank + 1]
        check(f"allgather {name}", hvd.allgather(ragged, name=name), torch.cat([e[: r + 1] for r, e in enumerate(every)]))
        check(f"broadcast {name}", hvd.broadcast(mine, root_rank=size - 1, name=name), every[-1])
        rows = mine.view(size, -1)
        check(f"alltoall {name}", hvd.alltoall(rows, name=name), torch.stack([e.view(size, -1)[rank] for e in every]))
        splits = [[1, 5], [2, 4]]  # 1-D, uneven: rank s sends splits[s][r] of its 6 values to rank r
        got, received = hvd.alltoall(mine, splits=splits[rank], name=name)
        check(f"alltoall splits {name}", got,
              torch.cat([e[sum(splits[s][:rank]): sum(splits[s][:rank + 1])] for s, e in enumerate(every)]))
        check(f"alltoall received {name}", received, torch.tensor([splits[s][rank] for s in range(size)],
                                                                  dtype=torch.int32))
        if dtype != torch.bool:
            for label in ("Sum", "Average"):
                offset, n = rank * (6 // size), 6 // size
                check(f"reducescatter {name} {label}", hvd.reducescatter(mine, op=OPS[label], name=name),
                      _reference(label, every)[offset: offset + n])
    adasum = hvd.allreduce(torch.full((2,), float(rank + 1)), op=hvd.Adasum)  # parallel vectors: their average
    if not torch.equal(adasum, torch.full((2,), 1.5)):
        failures.append(f"Adasum of parallel vectors: {adasum.tolist()}, not their average 1.5")
    hvd.barrier()
    return failures, len(checks)


def test_every_collective_with_every_op_and_dtype_matches_a_local_reference(ring):
    for failures, checks in ring.run(_every_collective_every_dtype, world_size=2, timeout_s=120):
        assert failures == []
        # per numeric dtype: 5 ops x (allreduce, allreduce_), allgather, broadcast, 3 alltoall checks, 2
        # reducescatters; bool: allgather, broadcast, 3 alltoall checks (its allreduces are refused, as Horovod's)
        assert checks == len(NUMERIC) * 17 + 5


def _lose_a_process_set_member():
    import os
    import time

    hvd.init()  # no set left registered by an earlier task in these processes
    rank = er.rank()
    pair = hvd.add_process_set([0, 1])
    hvd.allreduce(torch.ones(1), process_set=pair) if rank in (0, 1) else None  # the sub-ring forms
    if rank == 1:
        os._exit(1)  # a member is lost
    if rank == 2:
        hvd.remove_process_set(pair)
        return "not a member"
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1), process_set=pair)
        outcome = "no error"
    except RuntimeError as exc:  # a Horovod script's clause
        outcome = f"{type(exc).__name__} {isinstance(exc, er.CommError)}"
    hvd.remove_process_set(pair)
    return outcome, time.monotonic() - started


def test_losing_a_process_set_member_fails_its_collective_with_horovod_internal_error(ring):
    results = ring.start(_lose_a_process_set_member, world_size=3, collective_timeout_s=20).results(
        timeout_s=60, raise_errors=False)
    outcome, elapsed = results[0]
    assert outcome == "HorovodInternalError True" and elapsed < 15
    assert results[1].type_name == "ProcessDied" and results[2] == "not a member"


def _hvd_argument_error_on_one_rank():
    hvd.init()  # no set left registered by an earlier task in these processes
    rank = er.rank()
    cases = {
        "average and op": lambda bad: hvd.allreduce(torch.ones(2), average=True if bad else None, op=hvd.Sum),
        "Adasum": lambda bad: hvd.grouped_allreduce([torch.ones(2)], op=hvd.Adasum if bad else hvd.Sum),  # 3 ranks
        "async Adasum": lambda bad: hvd.synchronize(hvd.allreduce_async(torch.ones(2), op=hvd.Adasum if bad else hvd.Sum)),
        "reducescatter compression": lambda bad: hvd.reducescatter(
            torch.ones(2), compression=hvd.Compression.fp16 if bad else hvd.Compression.none),
        "sparse Max": lambda bad: hvd.sparse_allreduce_async(torch.ones(2, 2).to_sparse(), "s",
                                                            hvd.Max if bad else hvd.Sum)(),
    }
    out = {}
    for label, call in cases.items():
        try:
            call(rank == 1)
            out[label] = "no error"
        except (ValueError, NotImplementedError) as exc:
            out[label] = type(exc).__name__
        hvd.barrier()
    evens = hvd.add_process_set([0, 2])
    if rank in (0, 2):
        try:
            hvd.broadcast(torch.ones(1), root_rank=1 if rank == 2 else 0, process_set=evens)  # rank 2 only: outside
            out["root outside the set"] = "no error"
        except ValueError as exc:
            out["root outside the set"] = type(exc).__name__
        hvd.barrier(process_set=evens)
    hvd.remove_process_set(evens)
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    return out


def test_an_hvd_argument_error_on_one_rank_makes_every_rank_raise(ring):
    results = ring.run(_hvd_argument_error_on_one_rank, world_size=3, timeout_s=60, collective_timeout_s=30)
    for rank, out in enumerate(results):
        assert out.pop("after") == 3.0
        expected_bad = {"average and op": "ValueError", "Adasum": "NotImplementedError",
                        "async Adasum": "NotImplementedError", "reducescatter compression": "NotImplementedError",
                        "sparse Max": "ValueError"}
        for label, kind in expected_bad.items():
            assert out[label] == (kind if rank == 1 else "TensorMismatchError"), (rank, label, out[label])
        if rank in (0, 2):
            assert out["root outside the set"] == ("ValueError" if rank == 2 else "TensorMismatchError")
