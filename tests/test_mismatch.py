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
