"""A training job with an exact, closed-form result, and deterministic fault hooks (chaos suite).

The model is one float64 vector ``w`` (starting at 0), trained with SGD at
lr=1 on gradients *summed* over the ring. Sample ``i`` contributes the
integer-valued vector ``v(i)``, so one epoch moves ``w`` by exactly
``-sum_i v(i)`` whatever the order, the batch layout or the world size. With
every sample processed exactly once per epoch in committed work,
``w == -epochs * sum_i v(i)`` holds bit for bit, and ``seen[i] == epochs``.

The per-sample hit counts ride in the same reduction as ``w``'s gradient (a
parameter ``count`` whose gradient is the batch's hits, so ``seen = -count``):
a step's bookkeeping is atomic with its update. One more element of ``count``
carries "the stop file exists" the same way, so every rank agrees when to stop.
Like the loops people write, the job allreduces its loss for the log after
every ``optimizer.step()`` (a collective of its own, between the apply and
``record_batch()``): kills land there too, and must cost at most the step in
flight. Commits happen every ``commit_every`` steps (0: only at epoch ends);
joins, drains and stops happen at the next step. Every process appends
``round step time`` to ``steps-{pid}.log`` after each completed step (``time``: its wall clock, which the
tests on one machine compare with the moment they sent a preemption notice). With ``ask_preemption``,
every step calls ``get_preemption_info()`` (a collective, as in Ray Train) and rank 0 writes the first
answer that is not None to ``preemption.json``.

Faults are armed by the test through a file (:class:`FaultFile`): each a kind
and a rank. Each fires once (an ``O_EXCL`` marker file), at its hook point, on the
process that holds that rank:

* ``sigkill`` / ``sigstop``: at the start of a step;
* ``kill_in_commit``: inside ``state.commit()``, while the state is snapshotted;
* ``kill_in_reform``: in the reset callback, after the new ring is formed and
  before the state is synced (peers are re-forming);
* ``kill_in_sync``: on the root, while it serializes the state for a joiner
  (armed at a re-form that brought a joiner, if two ranks hold the state);
* ``kill_in_first_sync``: on the root of the job's first sync, while it sends the
  state (resumed from a checkpoint, if there is one) to the others;
* ``kill_in_join``: in the reset callback of a re-form that brought a joiner
  (a death during a membership re-form, before the sync);
* ``kill_in_formation``: armed at the start of a step, it kills its process at the
  very start of the next ring's formation (a second death while the survivors
  form the ring after a first one: they must not wait out ``connect_timeout_s``);
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
from elastic_ring.ring import runtime
from state import ElasticSampler, TorchState

N_SAMPLES = 96
DIM = 8
_ARMED: str | None = None  # the hook point armed in this process ("commit" or "sync")
_FORMATION_ARMED = False   # die when this process next forms a ring (kill_in_formation)


def _arm_formation_fault() -> None:
    """Make this process die at the start of its next ring formation (the runtime's communicator factory)."""
    global _FORMATION_ARMED
    _FORMATION_ARMED = True
    create = runtime._create

    def dying_create(spec, *args, **kwargs):
        if _FORMATION_ARMED:
            _die()
        return create(spec, *args, **kwargs)

    runtime._create = dying_create


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

    def all_fired(self, but: tuple[str, ...] = ("kill_at_end",)) -> bool:
        """Whether every armed fault (those of the kinds ``but`` aside: they fire after the stop) has fired."""
        try:
            with open(self.path) as f:
                faults = json.load(f)
        except FileNotFoundError:
            return True
        return all(os.path.exists(self.marker(f["id"])) for f in faults if f["kind"] not in but)


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


def _note_preemption(directory: str, step: int) -> None:
    import ray.train  # noqa: F401  (a Ray Train script imports it: its PreemptionInfo is then the type answered)

    from ray_integration.train import get_preemption_info

    info = get_preemption_info()  # every rank, every step: a collective
    path = os.path.join(directory, "preemption.json")
    if info is not None and er.rank() == 0 and not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"type": f"{type(info).__module__}.{type(info).__name__}", "step": step, "time": time.time(),
                       "deadline_ms": info.deadline_ms, "ranks": info.preempted_ranks,
                       "nodes": info.preempted_node_ids}, f)


def train(config: dict):
    global _ARMED
    if config.get("clock_skew_s"):
        _skew_clock(config["clock_skew_s"])
    faults = FaultFile(config["chaos_dir"])
    vectors = torch.stack([sample_vector(i) for i in range(N_SAMPLES)])
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    holder.count = torch.nn.Parameter(torch.zeros(N_SAMPLES + 1, dtype=torch.float64))  # -hits, then -stop votes
    optimizer = er.DistributedOptimizer(torch.optim.SGD(holder.parameters(), lr=1.0), holder.named_parameters(),
                                        op=er.Sum)
    sampler = ElasticSampler(N_SAMPLES, batch_size=config.get("batch", 2), seed=11)
    extra = {"flaky": Flaky(config["flaky_flag"])} if config.get("flaky_flag") else {}
    state = TorchState(model=holder, optimizer=optimizer, sampler=sampler, epoch=0, step=0, probe=FaultPoint(),
                       **extra)

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
        fault = faults.pending(("kill_in_first_sync",), er.rank())
        if fault and holding == 0 and faults.claim(fault):  # the job's first sync: the root sends what it resumed
            _ARMED = "sync"
        fault = faults.pending(("kill_in_join",), er.rank())
        if fault and 2 <= holding < er.size() and faults.claim(fault):  # a membership re-form with a joiner
            _die()

    state.register_reset_callbacks([on_reset])
    commit_every = config.get("commit_every", 0)
    step_log = os.path.join(config["chaos_dir"], f"steps-{os.getpid()}.log")

    def commit() -> None:
        global _ARMED
        fault = faults.pending(("kill_in_commit",), er.rank())
        _ARMED = "commit" if fault and faults.claim(fault) else None
        try:
            state.commit()
        finally:
            _ARMED = None

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
                fault = faults.pending(("kill_in_formation",), er.rank())
                if fault and not _FORMATION_ARMED and faults.claim(fault):
                    _arm_formation_fault()
                idx = torch.tensor(batch, dtype=torch.long)
                hits = torch.zeros(N_SAMPLES + 1, dtype=torch.float64)
                hits[idx] += 1
                # config["stop_when_fired"]: not before every armed fault fired (a replacement that starts slowly
                # on a loaded machine must still join before the job ends), but at 4 x min_epochs at the latest
                hits[N_SAMPLES] = float(faults.stop_requested() and (
                    not config.get("stop_when_fired") or faults.all_fired()
                    or state.epoch + 1 >= 4 * config.get("min_epochs", 1)))
                optimizer.zero_grad()
                loss = (holder.w * vectors[idx].sum(0)).sum() + (holder.count * hits).sum()
                loss.backward()
                optimizer.step()
                er.allreduce(loss.detach().reshape(1), name="loss for the log")  # the usual per-step loss log
                state.sampler.record_batch()
                state.step = state.sampler.step
                er.report(step=state.step, epoch=state.epoch)
                with open(step_log, "a") as f:
                    f.write(f"{er.round_id()} {state.step} {time.time():.3f}\n")
                if config.get("ask_preemption"):
                    _note_preemption(config["chaos_dir"], state.step)
                if er.rank() == 0:
                    tmp = os.path.join(config["chaos_dir"], f"progress.tmp{os.getpid()}")
                    with open(tmp, "w") as f:
                        f.write(f"{state.step} {er.size()} {er.round_id()} {state.epoch}")
                    os.replace(tmp, os.path.join(config["chaos_dir"], "progress"))
                if commit_every and state.step % commit_every == 0:
                    commit()
                time.sleep(config.get("step_delay_s", 0.03))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            commit()
            if holder.count[N_SAMPLES].item() < 0 and state.epoch >= config.get("min_epochs", 1):
                break  # a rank saw the stop file during this epoch (every rank has the same count)
        every = er.allgather_object(holder.w.detach().clone())
        fault = faults.pending(("kill_at_end",), er.rank())
        if fault and faults.claim(fault):
            _die()
        seen = -holder.count.detach()[:N_SAMPLES]
        return {"epochs": state.epoch, "step": state.step, "w": holder.w.detach().tolist(),
                "exact": torch.equal(holder.w.detach(), expected_w(state.epoch)),
                "identical": all(torch.equal(every[0], other) for other in every),
                "seen": seen.tolist(), "world": er.size()}

    return loop(state)
