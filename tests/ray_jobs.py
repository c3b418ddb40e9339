"""Training functions that the Ray tests hand to ElasticTrainer (importable by Ray workers)."""

from __future__ import annotations

import os
import signal
import time

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

import elastic_ring as er
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
                    if er.round_id() == rnd and er.rank() == rank and state.step == step:
                        if kind == "hang":  # stuck in user code; the heartbeat thread keeps running
                            time.sleep(10**6)
                        if kind == "rendezvous":  # this worker loses the driver's store for good
                            raise er.RendezvousError("lost the rendezvous store (injected)")
                        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                idx = torch.tensor(batch, dtype=torch.long)
                optimizer.zero_grad()
                ((model(xs[idx]) - ys[idx]) ** 2).sum().backward()
                optimizer.step()
                hits = torch.zeros(N_SAMPLES)
                hits[idx] += 1
                state.seen = state.seen + er.allreduce(hits, op=er.Sum)
                state.sampler.record_batch()
                state.step += 1
                er.report(step=state.step, epoch=state.epoch)
                if config.get("progress_file") and er.rank() == 0:
                    with open(config["progress_file"], "w") as f:
                        f.write(f"{state.step} {er.size()}")
                if state.step % config.get("commit_every", 2) == 0:
                    state.commit()
                if delay_s:
                    time.sleep(delay_s)
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
