"""Training functions that misuse the API, for the bad-input tests (importable by Ray workers)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

import elastic_ring as er
from state import ObjectState


def returns_unpicklable(config: dict):
    state = ObjectState(step=0)

    @er.elastic.run
    def loop(state):
        state.step += 1
        state.commit()
        return {"lock": threading.Lock()}  # cannot be pickled

    return loop(state)


def never_commits(config: dict):
    """Trains ``steps`` steps without a single commit; rank ``kill_rank`` dies at ``kill_step`` in round 1."""
    state = ObjectState(step=0, total=0.0)

    @er.elastic.run
    def loop(state):
        while state.step < config["steps"]:
            if er.round_id() == 1 and er.rank() == config["kill_rank"] and state.step == config["kill_step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(er.allreduce(torch.ones(1), op=er.Sum))
            state.step += 1
            time.sleep(config["step_delay_s"])
        return {"step": state.step, "world": er.size()}

    return loop(state)


def commits_on_rank0_only(config: dict):
    state = ObjectState(step=0)

    @er.elastic.run
    def loop(state):
        while state.step < 10:
            er.allreduce(torch.ones(1))
            state.step += 1
            if state.step == 3 and er.rank() == 0:
                state.commit()  # the other ranks do not: a collective called on some ranks only
        return state.step

    return loop(state)


def uses_the_ring_before_the_loop(config: dict):
    """er.rank()/er.size() and a collective before @er.elastic.run: the ring forms on first use; with
    ``kill_rank`` set, that rank dies before the loop, so the collective fails outside the loop."""
    rank, size = er.rank(), er.size()
    if config.get("kill_rank") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    total = er.allreduce(torch.tensor([1.0]), op=er.Sum).item()
    state = ObjectState(step=0)

    @er.elastic.run
    def loop(state):
        state.step += 1
        state.commit()
        return {"rank_before": rank, "size_before": size, "total": total, "world": er.size()}

    return loop(state)
