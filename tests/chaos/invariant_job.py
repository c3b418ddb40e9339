"""A training job with an exact, closed-form result, and deterministic fault hooks (chaos suite).

The model is one float64 vector ``w`` (starting at 0), trained with SGD at
lr=1 on gradients *summed* over the ring. Sample ``i`` contributes the
integer-valued vector ``v(i)``, so one epoch moves ``w`` by exactly
``-sum_i v(i)`` whatever the order, the batch layout or the world size. With
every sample processed exactly once per epoch in committed work,
``w == -epochs * sum_i v(i)`` holds bit for bit, and ``seen[i] == epochs``.

Faults are armed by the test through a file (:class:`FaultFile`): each a kind
and a rank. Each fires once (an ``O_EXCL`` marker file), at its hook point, on the
process that holds that rank:

* ``sigkill`` / ``sigstop``: at the start of a step;
* ``kill_in_commit``: inside ``state.commit()``, while the state is snapshotted;
* ``kill_in_reform``: in the reset callback, after the new ring is formed and
  before the state is synced (peers are re-forming);
* ``kill_in_sync``: on the root, while it serializes the state for a joiner
  (armed at a re-form that brought a joiner, if two ranks hold the state);
* ``kill_in_join``: in the reset callback of a re-form that brought a joiner
  (a death during a membership re-form, before the sync);
* ``kill_at_end``: after the last collective, just before ``fn`` returns (the
  other ranks return: the job must finish, not re-form).

``clock_skew_s`` in the config shifts every worker's wall clock (``time.time``)
by plus or minus that many seconds (by the parity of its pid), as on hosts whose
clocks disagree. Every rank writes its pid to ``pid-rank{r}`` for the test.

The job stops at the first epoch end after the test writes the stop file, so
that it outlasts any storm; the final epoch count goes into the closed form.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

import elastic_ring as er
from state import ElasticSampler, TorchState

N_SAMPLES = 96
DIM = 8
_ARMED: str | None = None  # the hook point armed in this process ("commit" or "sync")


def sample_vector(i: int) -> torch.Tensor:
    return torch.tensor([float((i * (k + 3)) % 11 - 5) for k in range(DIM)], dtype=torch.float64)


def expected_w(epochs: int) -> torch.Tensor:
    return -epochs * torch.stack([sample_vector(i) for i in range(N_SAMPLES)]).sum(0)


def _die(sig: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), sig)


class FaultPoint:
    """A state value that kills its process when copied (commit) or pickled (sync) while armed."""

    def __deepcopy__(self, memo):
        if _ARMED == "commit":
            _die()
        return FaultPoint()

    def __reduce__(self):
        if _ARMED == "sync":
            _die()
        return (FaultPoint, ())


# FaultPoint is plain data to a checkpoint: let a safe (weights_only) load accept it, as users do for their types
torch.serialization.add_safe_globals([FaultPoint])


class FaultFile:
    """The test arms faults by writing ``[{"id": n, "kind": ..., "rank": r}, ...]`` into ``path``."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, "faults.json")

    def pending(self, kinds: tuple[str, ...], rank: int) -> dict | None:
        try:
            with open(self.path) as f:
                faults = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        for fault in faults:
            if fault["kind"] in kinds and fault["rank"] == rank and not os.path.exists(self.marker(fault["id"])):
                return fault
        return None

    def claim(self, fault: dict) -> bool:
        """Mark the fault fired; False if another process already did."""
        try:
            os.close(os.open(self.marker(fault["id"]), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def marker(self, fault_id: int) -> str:
        return os.path.join(self.dir, f"fired-{fault_id}")

    def stop_requested(self) -> bool:
        return os.path.exists(os.path.join(self.dir, "stop"))


class Flaky:
    """A state value that cannot be saved once the file ``flag`` exists (a writer error on demand)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __deepcopy__(self, memo):  # a commit copies it fine; only saving (pickling) fails
        return Flaky(self.flag)

    def __reduce__(self):
        if os.path.exists(self.flag):
            raise TypeError(f"Flaky cannot be saved: {self.flag} exists")
        return (Flaky, (self.flag,))


def _skew_clock(seconds: float) -> None:
    real = time.time
    offset = seconds if os.getpid() % 2 else -seconds
    time.time = lambda: real() + offset


def _write_pid(directory: str) -> None:
    tmp = os.path.join(directory, f"pid.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(directory, f"pid-rank{er.rank()}"))


def train(config: dict):
    global _ARMED
    if config.get("clock_skew_s"):
        _skew_clock(config["clock_skew_s"])
    faults = FaultFile(config["chaos_dir"])
    vectors = torch.stack([sample_vector(i) for i in range(N_SAMPLES)])
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    optimizer = er.DistributedOptimizer(torch.optim.SGD([holder.w], lr=1.0), holder.named_parameters(), op=er.Sum)
    sampler = ElasticSampler(N_SAMPLES, batch_size=config.get("batch", 2), seed=11)
    extra = {"flaky": Flaky(config["flaky_flag"])} if config.get("flaky_flag") else {}
    state = TorchState(model=holder, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                       seen=torch.zeros(N_SAMPLES, dtype=torch.float64), probe=FaultPoint(), **extra)

    def on_reset() -> None:
        global _ARMED
        holding = int(er.allreduce(torch.tensor([float(state.committed)]), op=er.Sum).item())
        fault = faults.pending(("kill_in_reform",), er.rank())
        if fault and holding >= 2 and faults.claim(fault):
            _die()
        fault = faults.pending(("kill_in_sync",), er.rank())
        if fault and 2 <= holding < er.size():   # a joiner is here, and a second rank holds the state
            _ARMED = "sync"
            if not faults.claim(fault):
                _ARMED = None
        fault = faults.pending(("kill_in_join",), er.rank())
        if fault and 2 <= holding < er.size() and faults.claim(fault):  # a membership re-form with a joiner
            _die()

    state.register_reset_callbacks([on_reset])

    @er.elastic.run
    def loop(state):
        global _ARMED
        _ARMED = None  # the sync is over
        _write_pid(config["chaos_dir"])
        while True:
            for batch in state.sampler:
                fault = faults.pending(("sigkill", "sigstop"), er.rank())
                if fault and faults.claim(fault):
                    _die(signal.SIGKILL if fault["kind"] == "sigkill" else signal.SIGSTOP)
                idx = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                (holder.w * vectors[idx].sum(0)).sum().backward()
                optimizer.step()
                hits = torch.zeros(N_SAMPLES, dtype=torch.float64)
                hits[idx] += 1
                state.seen = state.seen + er.allreduce(hits, op=er.Sum)
                state.sampler.record_batch()
                state.step += 1
                er.report(step=state.step, epoch=state.epoch)
                if er.rank() == 0:
                    tmp = os.path.join(config["chaos_dir"], f"progress.tmp{os.getpid()}")
                    with open(tmp, "w") as f:
                        f.write(f"{state.step} {er.size()} {er.round_id()} {state.epoch}")
                    os.replace(tmp, os.path.join(config["chaos_dir"], "progress"))
                if state.step % config.get("commit_every", 3) == 0:
                    fault = faults.pending(("kill_in_commit",), er.rank())
                    _ARMED = "commit" if fault and faults.claim(fault) else None
                    try:
                        state.commit()
                    finally:
                        _ARMED = None
                time.sleep(config.get("step_delay_s", 0.03))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            stop = er.allreduce(torch.tensor([float(faults.stop_requested())]), op=er.Max).item() > 0
            state.commit()
            if stop and state.epoch >= config.get("min_epochs", 1):
                break
        every = er.allgather_object(holder.w.detach().clone())
        fault = faults.pending(("kill_at_end",), er.rank())
        if fault and faults.claim(fault):
            _die()
        return {"epochs": state.epoch, "step": state.step, "w": holder.w.detach().tolist(),
                "exact": torch.equal(holder.w.detach(), expected_w(state.epoch)),
                "identical": all(torch.equal(every[0], other) for other in every),
                "seen": state.seen.tolist(), "world": er.size()}

    return loop(state)
