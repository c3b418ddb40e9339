"""Horovod's ``_async`` semantics on real gloo rings (issue 33): every ``_async`` call runs in the background on its
communicator's ordered queue (``poll`` False while in flight, synchronous calls after it), and named operations
are paired by name, whatever order the ranks submitted them in, with other collectives overtaking them; the
cross-rank checks, deadlines, join and the ring's abort keep working."""

from __future__ import annotations

import threading
import time

import torch

import elastic_ring as er
import ray_integration.horovod as hvd
from elastic_ring.collectives import negotiation
from elastic_ring.ring import runtime


def _in_flight_until_the_peer_calls():
    """Rank 1 calls each _async form 0.3 s after rank 0: rank 0's poll is False meanwhile, for every form."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    t = torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * rank
    forms = {
        "allreduce_async": lambda: hvd.allreduce_async(t, op=hvd.Sum),
        "allreduce_async(prescale)": lambda: hvd.allreduce_async(t, op=hvd.Sum, prescale_factor=2.0),
        "allgather_async": lambda: hvd.allgather_async(t),
        "grouped_allgather_async": lambda: hvd.grouped_allgather_async([t, t]),
        "broadcast_async": lambda: hvd.broadcast_async(t, 1),
        "reducescatter_async": lambda: hvd.reducescatter_async(t.repeat(size, 1), op=hvd.Sum),
        "alltoall_async": lambda: hvd.alltoall_async(t.repeat(size, 1)),
        "sparse_allreduce_async": lambda: hvd.sparse_allreduce_async(t.to_sparse(), None, hvd.Sum),
    }
    out = {}
    for form, launch in forms.items():
        hvd.barrier()
        if rank == 1:
            time.sleep(0.3)
        started = time.monotonic()
        handle = launch()
        returned_s = time.monotonic() - started
        polled = hvd.poll(handle)
        result = hvd.synchronize(handle)
        result = [r.to_dense() if r.is_sparse else r for r in (result if isinstance(result, list) else [result])]
        expected = launch()  # the same call again, synchronized at once: the reference
        expected = hvd.synchronize(expected)
        expected = expected if isinstance(expected, list) else [expected]
        expected = [e.to_dense() if e.is_sparse else e for e in expected]
        out[form] = (returned_s < 0.2, polled, all(torch.equal(a, b) for a, b in zip(result, expected)))
    return out


def test_every_async_form_returns_at_once_and_polls_false_until_its_peer_calls(ring):
    results = ring.run(_in_flight_until_the_peer_calls, world_size=2, timeout_s=120)
    assert results[0] == {form: (True, False, True) for form in results[0]}
    assert all(returned and same for returned, _, same in results[1].values())
    assert len(results[0]) == 8


def _ordered_with_the_synchronous_calls():
    rank = er.rank()
    a = torch.full((4,), float(rank + 1))
    handles = [er.allgather_async(a * i) for i in range(5)] + [er.allreduce_async(a, op=er.Sum)]
    # synchronous calls come after every _async one called before them, on every rank
    summed = er.allreduce(a * 100, op=er.Sum)
    er.barrier()
    gathered = [er.synchronize(h) for h in handles]
    sub = torch.zeros(4)
    if rank < 2:
        with er.process_sets.scope([0, 1]):  # a process set's sub-ring has its own queue
            sub = er.synchronize(er.allreduce_async(a, op=er.Sum))
    er.barrier()
    return summed.tolist(), [g.tolist() for g in gathered], sub.tolist()


def test_async_calls_and_synchronous_calls_keep_the_call_order(ring):
    results = ring.run(_ordered_with_the_synchronous_calls, world_size=3, timeout_s=60)
    for summed, gathered, sub in results:
        assert summed == [600.0] * 4
        assert gathered[:5] == [[float(i)] * 4 + [2.0 * i] * 4 + [3.0 * i] * 4 for i in range(5)]
    for rank, (summed, gathered, sub) in enumerate(results):
        assert gathered[5] == [6.0] * 4 and sub == ([3.0] * 4 if rank < 2 else [0.0] * 4)


def _named_out_of_order():
    hvd.init()
    rank = hvd.rank()
    tensors = {name: torch.full((3,), float(ord(name) + 100 * rank)) for name in "abcd"}
    order = "abcd" if rank == 0 else "dcba"
    handles = {name: hvd.allreduce_async(tensors[name], name=name, op=hvd.Sum) for name in order}
    polled = [hvd.poll(h) for h in handles.values()]  # parked: nothing moves until synchronize
    out = {name: hvd.synchronize(handles[name]).tolist() for name in order}
    # the duplicate-name tests' shape: rank 0's named operation waits while both ranks pass a barrier
    if rank == 0:
        pending = hvd.allgather_async(torch.tensor([rank]), name="late")
    hvd.barrier()
    if rank == 1:
        pending = hvd.allgather_async(torch.tensor([rank]), name="late")
    hvd.barrier()
    out["late"] = hvd.synchronize(pending).tolist()
    # the same name on another op type is another operation (Horovod's prefixes)
    h1 = hvd.allreduce_async(torch.ones(1), name="same", op=hvd.Sum)
    h2 = hvd.allgather_async(torch.ones(1), name="same")
    out["prefixes"] = (hvd.synchronize(h2).tolist(), hvd.synchronize(h1).tolist())
    return polled, out


def test_named_operations_pair_by_name_in_any_order_and_let_other_collectives_overtake(ring):
    for polled, out in ring.run(_named_out_of_order, world_size=2, timeout_s=60):
        assert polled == [False] * 4
        assert out == {**{name: [2.0 * ord(name) + 100] * 3 for name in "abcd"}, "late": [0, 1],
                       "prefixes": ([1.0, 1.0], [2.0])}


def _named_mistakes():
    hvd.init()
    rank = hvd.rank()
    out = {}
    # the same name with another shape: the operation's own check, on every rank; the ring stays usable
    try:
        hvd.synchronize(hvd.allreduce_async(torch.ones(2 + rank), name="shape"))
    except er.TensorMismatchError as exc:
        out["shape"] = "shape" in str(exc)
    # a name only rank 0 submits: every rank gives up in the same negotiation round, at the deadline
    started = time.monotonic()
    try:
        hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="only-0" if rank == 0 else "only-1"))
    except er.TensorMismatchError as exc:
        out["stalled"] = ("not submitted by rank(s) [" + str(1 - rank) + "]" in str(exc), time.monotonic() - started)
    # a peer in another collective: both raise (Horovod's background thread would have waited)
    try:
        if rank == 0:
            hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="other"))
        else:
            hvd.barrier()
    except er.TensorMismatchError as exc:
        text = str(exc)
        out["other"] = "synchronize() too" in text if rank == 0 else "rank 0: hvd.synchronize(named _async" in text
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    # hvd.shutdown() fails what waits to be paired (as Horovod's); hvd.init() starts anew
    parked = hvd.allreduce_async(torch.ones(1), name="cut")
    hvd.shutdown()
    hvd.init()
    try:
        hvd.synchronize(parked)
    except ValueError as exc:
        out["shutdown"] = "hvd.shutdown()" in str(exc)
    out["again"] = hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="cut", op=hvd.Sum)).item()
    return out


def test_named_mistakes_raise_on_every_rank_within_the_deadline_and_the_ring_stays_usable(ring):
    for rank, out in enumerate(ring.run(_named_mistakes, world_size=2, timeout_s=90, collective_timeout_s=2.0)):
        assert out["shape"] is True and out["other"] is True and out["after"] == 2.0
        assert out["stalled"][0] is True and 1.5 < out["stalled"][1] < 15, out["stalled"]
        assert out["shutdown"] is True and out["again"] == 2.0


def _join_with_named():
    hvd.init()
    rank = hvd.rank()
    if rank == 1:
        return ("joined", hvd.join())
    a = hvd.allreduce_async(torch.full((2,), 4.0), name="a")  # Average over 2 ranks, the joined one gives zeros
    b = hvd.allreduce_async(torch.full((3,), 8.0), name="b")
    out = (hvd.synchronize(b).tolist(), hvd.synchronize(a).tolist())
    return (out, hvd.join())


def test_named_operations_pair_while_a_rank_waits_in_join(ring):
    results = ring.run(_join_with_named, world_size=2, timeout_s=60)
    assert results[0] == (([4.0] * 3, [2.0] * 2), 0) and results[1] == ("joined", 0)


def _abort_releases_the_queue():
    rank = er.rank()
    if rank == 1:
        time.sleep(1.0)  # never calls: rank 0's allgather waits on its queue's thread
        return None
    handle = er.allgather_async(torch.ones(2))
    round_id = runtime.current().spec.round_id
    threading.Timer(0.3, runtime.abort_round, (round_id, "test: a peer was declared lost")).start()
    started = time.monotonic()
    try:
        er.synchronize(handle)
    except er.CommError as exc:
        return ("a peer was declared lost" in str(exc), time.monotonic() - started)
    return ("no error", time.monotonic() - started)


def test_the_rings_abort_fails_a_queued_collective_at_once(ring):
    out = ring.run(_abort_releases_the_queue, world_size=2, timeout_s=60)[0]
    assert out[0] is True and out[1] < 1.5, out


def test_named_hashes_are_stable_and_distinct():
    assert negotiation.name_hash("allreduce.a") == negotiation.name_hash("allreduce.a") >= 0
    assert negotiation.name_hash("allreduce.a") != negotiation.name_hash("allgather.a")


def _async_beside_lean_steps():
    """An _async collective still waiting for a slow peer while backward launches a lean step's buckets (no check
    of their own): every rank issues the buckets after it, so both come out right."""
    rank = er.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                        autotune=False, strict_checks=False, fusion_threshold_bytes=4096)
    gathered = []
    for step in range(4):
        x = torch.randn(8, 32) + rank
        if rank == 1:
            time.sleep(0.1)  # rank 0's _async collective waits for this one meanwhile
        handle = er.allgather_async(torch.full((step + 1,), float(rank)))
        model(x).pow(2).mean().backward()  # its buckets go out in its hooks
        optimizer.step()
        optimizer.zero_grad()
        gathered.append(er.synchronize(handle).tolist())
    return gathered, [p.detach().sum().item() for p in model.parameters()]


def test_a_queued_collective_comes_before_a_lean_steps_buckets_on_every_rank(ring):
    (gathered0, params0), (gathered1, params1) = ring.run(_async_beside_lean_steps, world_size=2, timeout_s=90)
    assert gathered0 == gathered1 == [[0.0] * (s + 1) + [1.0] * (s + 1) for s in range(4)]
    assert params0 == params1
