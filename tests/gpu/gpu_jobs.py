"""Training functions that the GPU tests hand to ElasticTrainer (importable by Ray workers)."""

from __future__ import annotations

import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from state import ElasticSampler, TorchState

N_SAMPLES = 32


def train_on_gpu(config: dict):
    """An exact-invariant job on the worker's GPU: every sample's hit count ends at ``epochs``."""
    from ray_integration.worker.devices import worker_cuda_device

    expected_device = worker_cuda_device()
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(N_SAMPLES, 4, generator=g).to(device), torch.randn(N_SAMPLES, 1, generator=g).to(device)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = er.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters())
    state = TorchState(model=model, optimizer=optimizer, sampler=ElasticSampler(N_SAMPLES, batch_size=2, seed=3),
                       epoch=0, step=0, seen=torch.zeros(N_SAMPLES, device=device))

    @er.elastic.run
    def loop(state):
        while state.epoch < config.get("epochs", 2):
            for batch in state.sampler:
                idx = torch.tensor(batch, dtype=torch.long, device=device)
                optimizer.zero_grad()
                ((model(xs[idx]) - ys[idx]) ** 2).sum().backward()
                optimizer.step()
                hits = torch.zeros(N_SAMPLES, device=device)
                hits[idx] += 1
                state.seen = state.seen + er.allreduce(hits, op=er.Sum)
                state.sampler.record_batch()
                state.step += 1
                if state.step % 2 == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        params = er.allgather_object([p.detach().cpu() for p in model.parameters()])
        identical = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
        return {"device": str(device), "expected_device": expected_device,
                "comm_device": str(runtime.current().device), "param_device": str(next(model.parameters()).device), "seen": state.seen.cpu().tolist(),
                "identical": identical, "world": er.size(), "step": state.step}

    return loop(state)
