"""Training functions written against ``ray_integration.train`` for the drop-in tests (importable by Ray workers)."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import torch
from torch.utils.data import DataLoader

import elastic_ring as er
import ray_integration.train as train
from ray_integration.train.torch import prepare_data_loader, prepare_model
from state import ElasticSampler, TorchState


def stateful(config: dict):
    """The second level: a Ray Train function that also holds its model, optimizer and sampler in a ``TorchState``
    and trains in ``@er.elastic.run`` (``er.DistributedOptimizer``, ``ElasticSampler``), reporting a checkpoint from
    rank 0 every few steps. ``seen`` counts every sample's uses exactly (the ranks' one-hot hits, summed before the
    step and added right after it). ``kill``: (round, rank, step) SIGKILLs that rank after its optimizer step."""
    n, batch = config["samples"], config["batch"]
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    optimizer = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    sampler = ElasticSampler(n, batch_size=batch, seed=3)
    loader = prepare_data_loader(DataLoader(list(range(n)), batch_sampler=sampler))  # kept: it splits itself
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0, seen=torch.zeros(n))
    entered_with = train.get_checkpoint()
    kill = tuple(config.get("kill", ()))

    @er.elastic.run
    def loop(state):
        while state.epoch < config["epochs"]:
            for idx in loader:
                idx = torch.as_tensor(idx, dtype=torch.long)
                optimizer.zero_grad()
                ((model(xs[idx]) - ys[idx]) ** 2).sum().backward()
                hits = torch.zeros(n)
                hits[idx] += 1
                reduced = er.allreduce(hits, op=er.Sum)
                optimizer.step()
                state.seen = state.seen + reduced
                state.sampler.record_batch()
                state.step += 1
                if kill and (er.round_id(), er.rank(), state.step) == kill:
                    os.kill(os.getpid(), signal.SIGKILL)  # after the apply, before the report's collective
                with tempfile.TemporaryDirectory() as d:
                    checkpoint = None
                    if er.rank() == 0 and state.step % 3 == 0:
                        torch.save({"step": state.step}, os.path.join(d, "step.pt"))
                        checkpoint = train.Checkpoint.from_directory(d)
                    train.report({"step": state.step, "epoch": state.epoch}, checkpoint=checkpoint)
                if er.size() < config.get("slow_below_size", 0):  # hold the job open until a replacement joins
                    time.sleep(0.3)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        params = er.allgather_object([p.detach() for p in model.parameters()])
        return {"seen": state.seen.tolist(), "world": er.size(), "round": er.round_id(), "step": state.step,
                "identical": all(torch.equal(a, b) for other in params for a, b in zip(params[0], other)),
                "wrapper_reduces": model._reducer is not None, "entered_with": entered_with is not None}

    return loop(state)


def raises(config: dict):
    """Reports a checkpoint every step (every rank: its step number) and raises ``ValueError`` on rank 1 at step
    ``raise_at`` of each entry whose checkpoint is ``raise_after`` or older; returns what each entry resumed from."""
    model = prepare_model(torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = train.get_checkpoint()
    start = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = torch.load(os.path.join(d, "step.pt"))["step"]
    for step in range(start, config["steps"]):
        if train.get_context().get_world_rank() == 1 and step == start + config["raise_at"]:
            raise ValueError(f"a bug at step {step}, resumed from {start}")
        optimizer.zero_grad()
        model(torch.ones(3, 2)).sum().backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            torch.save({"step": step + 1}, os.path.join(d, "step.pt"))
            train.report({"step": step + 1, "resumed_from": start}, checkpoint=train.Checkpoint.from_directory(d))
    return start


def rank0_reports_then_dies(config: dict):
    """Ray's DDP pattern: only rank 0 reports a checkpoint (a large one, so that an upload in the background would
    still be in flight). Rank 0 of the first ring is SIGKILLed right after ``report(step kill_after)`` returned;
    every entry logs the step it resumed from."""
    import json

    checkpoint, start = train.get_checkpoint(), 0
    if checkpoint is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "s.json")) as f:
            start = json.load(f)["step"]
    with open(config["log"], "a") as f:
        f.write(json.dumps({"rank": er.rank(), "round": er.round_id(), "resumed_from": start}) + "\n")
    for step in range(start + 1, config["steps"] + 1):
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if train.get_context().get_world_rank() == 0:
                with open(os.path.join(d, "s.json"), "w") as f:
                    json.dump({"step": step}, f)
                with open(os.path.join(d, "blob.bin"), "wb") as f:
                    f.write(os.urandom(config["blob_mib"] << 20))
                ckpt = train.Checkpoint.from_directory(d)
            train.report({"step": step}, checkpoint=ckpt)
        if step == config["kill_after"] and er.round_id() == 1 and er.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return start


def partition(config: dict):
    """Each rank's share of a shuffled loader from ``prepare_data_loader`` in two epochs (``set_epoch``), written to
    ``config["out"]/rank-R.json`` with the ring's world size (real files: every rank's, not only rank 0's value)."""
    import json

    loader = prepare_data_loader(DataLoader(list(range(config["samples"])), batch_size=3, shuffle=True))
    rank = train.get_context().get_world_rank()
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([int(i) for batch in loader for i in batch])
    with open(os.path.join(config["out"], f"rank-{rank}.json"), "w") as f:
        json.dump({"world": train.get_context().get_world_size(), "epochs": epochs,
                   "sampler": type(loader.sampler).__name__}, f)
