"""Ranks that pass different tensors get one clear error on every rank, never a hang or garbage."""

import time

import pytest
import torch

import elastic_ring as er


def _call_and_capture(fn):
    started = time.monotonic()
    try:
        fn()
    except er.TensorMismatchError as exc:
        message = str(exc)
    else:
        message = None
    er.barrier()  # the ring stays usable: the check runs before any data moves
    return message, time.monotonic() - started


def _shape_mismatch():
    shape = (2, 3) if er.rank() == 0 else (3, 2)
    return _call_and_capture(lambda: er.allreduce(torch.ones(shape), name="fc.weight"))


def _numel_mismatch():
    return _call_and_capture(lambda: er.allreduce(torch.ones(4 + er.rank()), name="bias"))


def _dtype_mismatch():
    dtype = torch.float64 if er.rank() == 1 else torch.float32
    return _call_and_capture(
        lambda: er.grouped_allreduce([torch.ones(3), torch.ones(2, dtype=dtype)], name=["a", "b"])
    )


def _count_mismatch():
    tensors = [torch.ones(2)] * (2 if er.rank() == 0 else 3)
    return _call_and_capture(lambda: er.grouped_allreduce(tensors))


def _kind_mismatch():
    if er.rank() == 0:
        return _call_and_capture(lambda: er.broadcast(torch.ones(3), root_rank=0))
    return _call_and_capture(lambda: er.allreduce(torch.ones(3)))


def _allgather_trailing_dims():
    return _call_and_capture(lambda: er.allgather(torch.ones(2, 3 + er.rank()), name="feats"))


@pytest.mark.parametrize(
    "fn, expected",
    [
        (_shape_mismatch, ["'fc.weight'", "rank 0: 'fc.weight' float32[2, 3]", "rank 1: 'fc.weight' float32[3, 2]"]),
        (_numel_mismatch, ["'bias'", "float32[4]", "float32[5]", "float32[6]"]),
        (_dtype_mismatch, ["tensor #1", "rank 1: 'b' float64[2]", "rank 0: 'b' float32[2]"]),
        (_count_mismatch, ["different numbers of tensors", "rank 0: 2", "rank 1: 3"]),
        (_kind_mismatch, ["different collectives", "grouped_broadcast_", "allreduce"]),
        (_allgather_trailing_dims, ["'feats'", "float32[*, 3]", "float32[*, 4]"]),
    ],
)
def test_mismatch_raises_same_clear_error_on_every_rank(ring, fn, expected):
    results = ring.run(fn, timeout_s=30)
    messages = [m for m, _ in results]
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, "every rank must raise the same message"
    for fragment in expected:
        assert fragment in messages[0], (fragment, messages[0])
    assert max(elapsed for _, elapsed in results) < 5


def _same_numel_other_shape_is_not_garbage():
    # gloo alone would happily sum a [2, 3] with a [3, 2]; we must refuse
    shape = (2, 3) if er.rank() == 0 else (3, 2)
    try:
        er.allreduce_(torch.ones(shape))
    except er.TensorMismatchError:
        return "refused"
    return "reduced"


def test_same_numel_different_shape_is_refused(ring):
    assert ring.run(_same_numel_other_shape_is_not_garbage, world_size=2) == ["refused", "refused"]


# ---------------------------------------------------------------- the optimizer's per-step check

def _tiny_optimizer(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  fusion_threshold_bytes=64, first_bucket_bytes=0, **kwargs)
    return model, opt


def _one_step(model, opt, seed):
    opt.zero_grad()
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
    opt.step()


def _ranks_at_different_steps(mode):
    from elastic_ring.reduction.reducer import GradReducer

    GradReducer.defer_check_on_cpu = mode == "deferred"
    try:  # Max cannot carry the step's agreement in a bucket: a leading check whose verdict is read late
        options = {"strict": dict(strict_checks=True), "deferred": dict(op=er.Max)}.get(mode, {})
        model, opt = _tiny_optimizer(**options)
        _one_step(model, opt, 0)  # a ring's first step is always checked before any bucket is sent
        opt._set_applied_steps(7 if er.rank() == 0 else 5)  # e.g. one rank restored an older commit
        before = [p.detach().clone() for p in model.parameters()]
        try:
            _one_step(model, opt, 1)
        except er.TensorMismatchError as exc:
            message = str(exc)
        else:
            message = None
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        er.barrier()  # the ring is still usable: the buckets (of agreed sizes) were drained
        opt._set_applied_steps(9)
        _one_step(model, opt, 2)  # and training goes on once the steps agree
        return message, unchanged, opt.applied_steps
    finally:
        GradReducer.defer_check_on_cpu = False


@pytest.mark.parametrize("mode", ["strict", "in-bucket", "deferred"],
                         ids=["checked-before-sending", "agreed-in-the-last-bucket", "verdict-in-synchronize"])
def test_ranks_at_different_optimizer_steps_fail_on_every_rank_before_the_update(ring, mode):
    results = ring.run(_ranks_at_different_steps, mode, world_size=2, timeout_s=30)
    messages = [m for m, _, _ in results]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "different optimizer steps (rank 0: 7, rank 1: 5)" in messages[0] and "synced" in messages[0]
    assert all(unchanged for _, unchanged, _ in results), "no update was applied"
    assert [applied for _, _, applied in results] == [10, 10]


def _different_collective_after_deferred_buckets():
    """With the verdict deferred (NCCL's mode), a mismatch found after buckets were sent aborts the ring on every rank."""
    from elastic_ring.reduction.reducer import GradReducer
    from elastic_ring.reduction.signature import signature_hash

    GradReducer.defer_check_on_cpu = True
    try:  # Max: the step's agreement cannot ride in a bucket, so a leading check runs with its verdict deferred
        model, opt = _tiny_optimizer(op=er.Max)
        _one_step(model, opt, 0)
        reducer = opt._er_reducer
        if er.rank() == 1:  # same bucket sizes, another signature: the sends pair up, the verdict says no
            reducer._kind = reducer._kind.replace("DistributedOptimizer step", "DistributedOptimizer step of another model")
            reducer._digest = signature_hash(reducer._kind, reducer._entries)
        try:
            _one_step(model, opt, 1)
        except er.TensorMismatchError as exc:
            message = str(exc)
        else:
            message = None
        try:
            er.barrier()
            after = "usable"
        except er.CommError:
            after = "aborted"
        return message, after
    finally:
        GradReducer.defer_check_on_cpu = False


def test_deferred_verdict_mismatch_raises_on_every_rank_and_aborts_the_ring(ring):
    results = ring.run(_different_collective_after_deferred_buckets, world_size=2, timeout_s=30)
    for message, after in results:
        assert message is not None and "asynchronous check" in message
        assert after == "aborted"


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.", "unreadable"),  # a pickle is never loaded
        (b'{"kind": 3, "entries": [], "step": null}', "malformed"),
        (b'{"kind": "x", "entries": [["a"]], "step": null}', "malformed"),
        (b'{"kind": "x", "entries": [], "step": "7"}', "malformed"),
        (b"[1, 2]", "malformed"),
    ],
)
def test_peer_descriptions_are_validated_json(data, fragment):
    from elastic_ring.reduction.signature import _decode

    with pytest.raises(er.TensorMismatchError, match=f"rank 3's description is {fragment}"):
        _decode(data, 3)
    assert _decode(b'{"kind": "k", "entries": [["w", "float32[2]"]], "step": 4}', 0) == {
        "kind": "k", "entries": [("w", "float32[2]")], "step": 4}


def test_signature_module_does_not_import_pickle():
    import ast
    import inspect

    from elastic_ring.reduction import signature

    tree = ast.parse(inspect.getsource(signature))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "pickle" not in imported and "json" in imported


_KEPT: dict = {}  # one optimizer per worker process, across tasks (rings)


def _first_ring_then_diverge():
    _KEPT["opt"] = _tiny_optimizer()
    model, opt = _KEPT["opt"]
    for step in range(2):
        _one_step(model, opt, step)
    if er.rank() == 1:  # e.g. this rank applied one more step before the ring failed, and nobody re-based
        opt._er_reducer.applied_steps += 1
    return opt.applied_steps


def _next_ring_with_a_joiner():
    if er.rank() == 2:  # the joiner: a fresh optimizer (its count starts at 0)
        _KEPT["opt"] = _tiny_optimizer()
    model, opt = _KEPT["opt"]
    counts = [opt.applied_steps]
    _one_step(model, opt, 10)  # survivors at 2 and 3, joiner at 0: not compared until re-based
    opt._set_applied_steps(20)  # what the state layer does after the sync: every rank agrees now
    _one_step(model, opt, 11)
    counts.append(opt.applied_steps)
    opt._set_applied_steps(30 + (er.rank() == 2))  # a rank that missed the re-base
    try:
        _one_step(model, opt, 12)
    except er.TensorMismatchError as exc:
        return counts, str(exc)
    return counts, None


def test_step_ids_are_compared_once_the_ring_is_rebased(ring):
    assert ring.run(_first_ring_then_diverge, world_size=2) == [2, 3]
    results = ring.run(_next_ring_with_a_joiner, world_size=3, timeout_s=30)
    assert [counts for counts, _ in results] == [[2, 21], [3, 21], [0, 21]]
    messages = [m for _, m in results]
    assert messages[0] is not None and len(set(messages)) == 1
    assert "(rank 0: 30, rank 1: 30, rank 2: 31)" in messages[0]
