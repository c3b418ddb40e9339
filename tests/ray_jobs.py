"""Training functions that the Ray tests hand to ElasticTrainer (importable by Ray workers)."""

from __future__ import annotations

import json
import os
import signal
import time

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

import elastic_ring as er
from elastic_ring.core import allocator
from state import ElasticSampler, TorchState

N_SAMPLES = 48


class SlowFileSystem(LocalFileSystem):
    """The local file system, where writing a checkpoint's data file takes as many seconds as the file
    ``SLOW_WRITE_S`` in the checkpoint location holds (slow storage), and is refused (permission denied)
    while a file ``REFUSE_WRITES`` is there (registered wherever this module is imported: the test's
    driver and every worker, which import it to run ``train``)."""

    protocol = ("slowfile", "file", "local")  # "file": the checkpoint code treats it as a local disk

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if any(c in mode for c in "wxa") and path.endswith("/data.pt"):
            root = os.path.dirname(os.path.dirname(path))
            if os.path.exists(os.path.join(root, "REFUSE_WRITES")):
                raise PermissionError(13, "Permission denied (injected)", path)
            control = os.path.join(root, "SLOW_WRITE_S")
            if os.path.exists(control):
                with open(control) as f:
                    time.sleep(float(f.read()))
        return super()._open(path, mode, block_size=block_size, **kwargs)


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


def train(config: dict):
    """Train an exact-invariant job: every sample's hit count ends at `epochs`, on every rank."""
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(N_SAMPLES, 4, generator=g), torch.randn(N_SAMPLES, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    sampler = ElasticSampler(N_SAMPLES, batch_size=config.get("batch", 2), seed=3)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                       seen=torch.zeros(N_SAMPLES))
    faults = {tuple(f) for f in config.get("faults", [])}  # (round, rank, step, kind)
    delay_s = config.get("step_delay_s", 0.0)

    @er.elastic.run
    def loop(state):
        while state.epoch < config.get("epochs", 2):
            for batch in state.sampler:
                if config.get("raise_at_step") == state.step and er.rank() == config.get("raise_rank", 0):
                    raise ValueError(f"user bug at step {state.step}")
                for rnd, rank, step, kind in faults:
                    if kind == "kill_resting":
                        continue  # (after the step: below)
                    if kind.endswith("_forwarder") and er.round_id() == rnd and state.step == step:
                        forwarder_fault(kind, config["forwarder_file"])  # on whichever rank forwards the beats
                    elif er.round_id() == rnd and er.rank() == rank and state.step == step:
                        if kind == "hang":  # stuck in user code; the heartbeat thread keeps running
                            time.sleep(10**6)
                        if kind == "rendezvous":  # this worker loses the driver's store for good
                            raise er.RendezvousError("lost the rendezvous store (injected)")
                        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                idx = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                ((model(xs[idx]) - ys[idx]) ** 2).sum().backward()
                hits = torch.zeros(N_SAMPLES)
                hits[idx] += 1
                # reduced before the step and added right after it, with no collective in between: a failure in
                # this allreduce discards the step in flight like one in a bucket, and after the apply nothing can
                # fail before `seen` has it (a value updated *after* a collective of the loop's own could lag one
                # step: docs/elasticity.md, "A step is a transaction")
                reduced = er.allreduce(hits, op=er.Sum)
                optimizer.step()
                state.seen = state.seen + reduced
                state.sampler.record_batch()
                state.step += 1
                er.report(step=state.step, epoch=state.epoch)
                if config.get("progress_file") and er.rank() == 0:
                    with open(config["progress_file"], "w") as f:
                        f.write(f"{state.step} {er.size()}")
                if state.step % config.get("commit_every", 2) == 0:
                    state.commit()
                resting = [f for f in faults if f[3] == "kill_resting" and er.round_id() == f[0] and state.step == f[2]]
                if resting:  # every rank rests after this step; the victim dies at its start (while no collective runs)
                    if er.rank() == resting[0][1]:
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(config.get("rest_s", 2.0))
                if delay_s:
                    time.sleep(delay_s)
                if er.size() < config.get("slow_below_size", 0):  # hold the job open until a replacement joins
                    time.sleep(config.get("slow_step_s", 0.3))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            if config.get("refuse_writes_in") and state.epoch == config.get("epochs", 2):
                open(os.path.join(config["refuse_writes_in"], "REFUSE_WRITES"), "w").close()  # the last write fails
            state.commit()
        params = er.allgather_object([p.detach() for p in model.parameters()])
        identical = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
        return {"step": state.step, "seen": state.seen.tolist(), "identical": identical, "world": er.size(),
                "round": er.round_id(), "resumed_from": state.resumed_from}

    return loop(state)


def forwarder_fault(kind: str, note: str) -> None:
    """``heartbeats="node"``: if this worker process forwards its node's heartbeats (the leader's stamp names its
    pid), write its worker id to ``note``, then SIGSTOP (``stop_forwarder``) or SIGKILL (``kill_forwarder``) it."""
    import ray

    from elastic_ring.ring import runtime
    from ray_integration.worker.node_beats import STAMP_NAME, node_directory

    path = os.path.join(node_directory(runtime.current().spec.job_id, ray.get_runtime_context().get_node_id()),
                        STAMP_NAME)
    deadline = time.monotonic() + 5.0
    while not os.path.exists(path) and time.monotonic() < deadline:  # the leader's first forward
        time.sleep(0.05)
    with open(path) as f:
        stamp = json.loads(f.read()[64:])  # (after its MAC: the test only looks)
    if stamp["pid"] == os.getpid():
        with open(note, "w") as f:
            f.write(stamp["worker"])
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop_forwarder" else signal.SIGKILL)


def train_loss_logged(config: dict):
    """The loop people write: it allreduces its loss for the log after every step and commits only at
    epoch ends. Hits ride in the gradient reduction (a parameter whose gradient is the batch's hits), so
    every sample's count is exact whatever a failure interrupts. ``kill``: (round, rank, step) SIGKILLs
    that rank between ``optimizer.step()`` and the loss allreduce. Rank 0 reports every step with the
    sampler's position, so the test can read steps redone and where joins happened."""
    g = torch.Generator().manual_seed(5)
    n = config.get("samples", 240)
    xs, ys = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.hits = torch.nn.Parameter(torch.zeros(n))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                        op=er.Sum)
    sampler = ElasticSampler(n, batch_size=config.get("batch", 2), seed=3)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)
    kill = tuple(config["kill"]) if config.get("kill") else None

    @er.elastic.run
    def loop(state):
        while state.epoch < config.get("epochs", 2):
            for batch in state.sampler:
                idx = torch.tensor(batch, dtype=torch.long)
                onehot = torch.zeros(n)
                onehot[idx] = 1.0
                optimizer.zero_grad()
                loss = ((model(xs[idx]) - ys[idx]) ** 2).mean() if len(batch) else xs.new_zeros(())
                (loss - (model.hits * onehot).sum()).backward()
                optimizer.step()
                if kill == (er.round_id(), er.rank(), state.sampler.step):
                    os.kill(os.getpid(), signal.SIGKILL)  # after the apply, before the loop's own collective
                logged = er.allreduce(loss.detach(), name="loss for the log")
                state.sampler.record_batch()
                if er.rank() == 0:
                    er.report(loss=float(logged), step=state.sampler.step, round=er.round_id(),
                              position=state.sampler.processed)
                time.sleep(config.get("step_delay_s", 0.0))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        params = er.allgather_object([p.detach() for p in model.parameters()])
        identical = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
        # SGD with lr 0.01 on Sum-reduced gradients of -hits: every sample's hits parameter ends at epochs * 0.01
        seen = (model.hits.detach() / 0.01).round().tolist()
        return {"step": state.sampler.step, "seen": seen, "identical": identical, "world": er.size()}

    return loop(state)


GB_N, GB_DIM, GB_G, GB_MICRO = 48, 5, 8, 2


def gb_vectors(n: int = GB_N) -> torch.Tensor:
    """Integer-valued sample vectors of the global-batch job (its closed form is exact in float64)."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(-50, 50, (n, GB_DIM), generator=g).to(torch.float64)


def gb_expected(epochs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` and ``c`` after ``epochs`` epochs when every sample of every step weighs exactly 1/G."""
    return -epochs * gb_vectors().sum(0) / GB_G, torch.full((GB_N,), -epochs / GB_G, dtype=torch.float64)


def train_global_batch(config: dict):
    """A plain loop (zero_grad, forward, backward, step per micro-batch) with a constant global batch of 8
    samples in micro-batches of 2; loss linear in the parameters, integer data: the closed form is exact.
    ``kill``: (round, rank, step) SIGKILLs that rank at the start of that step."""
    v = gb_vectors()
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(GB_DIM, dtype=torch.float64))
    holder.c = torch.nn.Parameter(torch.zeros(GB_N, dtype=torch.float64))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(holder.parameters(), lr=1.0), holder.named_parameters())
    sampler = ElasticSampler(GB_N, batch_size=GB_MICRO, global_batch_size=GB_G, seed=4)
    state = TorchState(model=holder, optimizer=optimizer, sampler=sampler, epoch=0)
    kill = tuple(config["kill"]) if config.get("kill") else None
    worlds = []

    @er.elastic.run
    def loop(state):
        worlds.append(er.size())
        while state.epoch < config.get("epochs", 2):
            for batch in state.sampler:
                if kill == (er.round_id(), er.rank(), state.sampler.step):
                    os.kill(os.getpid(), signal.SIGKILL)
                idx = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                ((v[idx] * holder.w).sum(1) + holder.c[idx]).mean().backward()
                optimizer.step()
                state.sampler.record_batch()
                time.sleep(config.get("step_delay_s", 0.0))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        w, c = gb_expected(state.epoch)
        every = er.allgather_object((holder.w.detach(), holder.c.detach()))
        return {"exact": torch.equal(holder.w.detach(), w) and torch.equal(holder.c.detach(), c),
                "identical": all(torch.equal(a, every[0][0]) and torch.equal(b, every[0][1]) for a, b in every),
                "worlds": worlds, "passes": optimizer.backward_passes_per_step, "world": er.size()}

    return loop(state)


def allocator_probe(config: dict):
    """Whether the worker tuned glibc's allocator, and :func:`gradient_churn_faults` in the worker."""
    er.rank()  # join the ring: the driver counts a worker as started when it asks for its first ring
    return {"applied": allocator.applied(), "faults": gradient_churn_faults()}


def gradient_churn_faults() -> int:
    """Minor page faults of 5 steps' worth of fresh gradients (10 x 16 MiB, touched, freed together), after a
    warm-up step."""
    import resource

    def churn() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            grads = [torch.ones(4 * 2**20) for _ in range(10)]
            del grads
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    churn()
    return churn()


def returns_without_the_ring(config: dict):
    """Returns at once, never touching the ring (no er.* call, no collective)."""
    return {"nothing": "trained"}
