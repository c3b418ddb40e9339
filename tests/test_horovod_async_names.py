"""Horovod's duplicate-name error (test_torch.py: test_horovod_{allreduce,allgather,broadcast,reducescatter}
_duplicate_name_error): an ``_async`` call whose ``name`` an operation of this process not synchronized yet
holds raises ``ValueError`` at once, before anything is sent, so the ring stays usable; ``synchronize`` frees
the name (``poll`` does not), as do a new round and ``hvd.init()``. On real gloo rings (the pairing of named
operations by name, whatever order the ranks submit them in: tests/test_horovod_async_pairing.py)."""

from __future__ import annotations

import time

import torch

import ray_integration.horovod as hvd


def _duplicate(launch) -> tuple[str | None, float]:
    """What a second call of the same name raised, and how long it took (nothing is sent: no waiting)."""
    started = time.monotonic()
    try:
        launch()
    except ValueError as exc:
        ok = "'dup'" in str(exc) and "hvd.synchronize(handle)" in str(exc) and "another name" in str(exc)
        return ("ValueError" if ok else f"ValueError without the name or the fix: {exc}"), time.monotonic() - started
    return None, time.monotonic() - started


def _listed(result) -> list[torch.Tensor]:
    return result if isinstance(result, list) else [result]


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def _every_async_form():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    t = torch.full((3, 2), float(rank + 1))
    forms = {
        "allreduce_async": lambda: hvd.allreduce_async(t, name="dup", op=hvd.Sum),
        "allreduce_async_": lambda: hvd.allreduce_async_(t.clone(), name="dup", op=hvd.Sum),
        "grouped_allreduce_async": lambda: hvd.grouped_allreduce_async([t, t], name="dup", op=hvd.Sum),
        "allreduce_async(prescale)": lambda: hvd.allreduce_async(t, name="dup", op=hvd.Sum, prescale_factor=2.0),
        "allgather_async": lambda: hvd.allgather_async(t, name="dup"),
        "grouped_allgather_async": lambda: hvd.grouped_allgather_async([t], name="dup"),
        "broadcast_async": lambda: hvd.broadcast_async(t, 1, name="dup"),
        "broadcast_async_": lambda: hvd.broadcast_async_(t.clone(), 1, name="dup"),
        "reducescatter_async": lambda: hvd.reducescatter_async(t.repeat(size, 1), name="dup", op=hvd.Sum),
        "alltoall_async": lambda: hvd.alltoall_async(t.repeat(size, 1), name="dup"),
        "sparse_allreduce_async": lambda: hvd.sparse_allreduce_async(t.to_sparse(), "dup", hvd.Sum),
    }
    out = {}
    for form, launch in forms.items():
        first = launch()
        error, seconds = _duplicate(launch)
        hvd.barrier()  # pairs with the peers' barrier: the refused call sent nothing
        result = hvd.synchronize(first)  # the first one still delivers its result
        again = hvd.synchronize(launch())  # its name is free again once synchronized
        same = all(torch.equal(_dense(a), _dense(b)) for a, b in zip(_listed(result), _listed(again)))
        out[form] = (error, seconds < 0.5, same)
    return out


def test_every_async_form_refuses_a_name_in_flight_at_once_and_frees_it_at_synchronize(ring):
    for out in ring.run(_every_async_form, world_size=2, timeout_s=60):
        assert out == {form: ("ValueError", True, True) for form in out}, out
        assert len(out) == 11


def _what_holds_a_name():
    hvd.init()
    rank = hvd.rank()
    t = torch.ones(4)
    evens = hvd.add_process_set([0])
    out = {}
    first = hvd.allreduce_async(t, name="dup")
    hvd.synchronize(hvd.allreduce_async(t, name="other"))  # another name: runs
    hvd.synchronize(hvd.allreduce_async(t))  # name=None holds nothing
    hvd.synchronize(hvd.allreduce_async(t))
    if rank == 0:  # the same name on another process set: its own names (as Horovod's per-set queues)
        hvd.synchronize(hvd.allreduce_async(t, name="dup", process_set=evens))
    hvd.allreduce(t, name="dup")  # a synchronous call is not an _async one: runs
    deadline = time.monotonic() + 10
    while not hvd.poll(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    out["poll_then_duplicate"] = _duplicate(lambda: hvd.allreduce_async(t, name="dup"))[0]  # done, not synchronized
    out["first"] = hvd.synchronize(first).tolist()
    out["second_synchronize"] = hvd.synchronize(first)  # Horovod's: None, and nothing is freed twice
    out["after"] = hvd.synchronize(hvd.allreduce_async(t * 2, name="dup", op=hvd.Sum)).tolist()
    hvd.allreduce_async(t, name="left")  # never synchronized: the next task (a new round) may use the name
    return out


def _left_in_an_older_round():
    """No hvd.init() here: the same session, a new round (the pool formed it; a re-form does the same)."""
    return hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="left", op=hvd.Sum)).tolist()


def _left_before_init():
    hvd.allreduce_async(torch.ones(2), name="left")  # this round, then a new session
    hvd.init()
    return hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="left", op=hvd.Sum)).tolist()


def test_names_are_held_per_process_set_until_synchronize_and_not_across_rounds_or_sessions(ring):
    for out in ring.run(_what_holds_a_name, world_size=2, timeout_s=60):
        assert out == {"poll_then_duplicate": "ValueError", "first": [1.0] * 4, "second_synchronize": None,
                       "after": [4.0] * 4}
    assert ring.run(_left_in_an_older_round, world_size=2, timeout_s=60) == [[2.0, 2.0]] * 2
    hvd_init_resets = ring.run(_left_before_init, world_size=2, timeout_s=60)
    assert hvd_init_resets == [[2.0, 2.0]] * 2
