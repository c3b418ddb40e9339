"""DistributedOptimizer over a real NCCL ring equals one process training on the whole batch on the GPU."""

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime

pytestmark = pytest.mark.gpu

IN, HIDDEN, OUT, PER_RANK = 12, 32, 4, 6


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)).to(device)


def _batch(step, n, device):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n * PER_RANK, IN, generator=g).to(device), torch.randn(n * PER_RANK, OUT, generator=g).to(device)


def _optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9) if kind == "sgd" else torch.optim.Adam(params, lr=0.01)


def _reference(kind, n, steps, passes, device):
    """One process, every rank's batch: the mean per rank's batch, summed over passes, averaged over ranks."""
    model = _model(device)
    opt = _optimizer(kind, model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(step * passes + k, n, device)
            for r in range(n):
                sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
                (torch.nn.functional.mse_loss(model(x[sl]), y[sl]) / n).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _distributed(kind, steps, passes, threshold, compression_name):
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference and the ring must compute alike
    n, r, device = er.size(), er.rank(), runtime.current().device
    model = _model(device)
    opt = er.DistributedOptimizer(_optimizer(kind, model.parameters()), model.named_parameters(),
                                  backward_passes_per_step=passes, fusion_threshold_bytes=threshold,
                                  compression=getattr(er.Compression, compression_name))
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(step * passes + k, n, device)
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
    assert all(p.device == device for p in model.parameters())
    expected = _reference(kind, n, steps, passes, device)
    tol = dict(rtol=2e-3, atol=2e-3) if compression_name == "fp16" else dict(rtol=1e-5, atol=1e-5)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach().cpu(), e, **tol)
    everyone = er.allgather_object([p.detach().cpu() for p in model.parameters()])
    identical = all(torch.equal(a, b) for other in everyone for a, b in zip(everyone[0], other))
    return identical, len(opt.fusion_buckets)


@pytest.mark.parametrize("kind, passes, threshold, compression, world", [
    ("sgd", 1, 64 << 20, "none", 3),
    ("adam", 1, 2048, "none", 3),
    ("sgd", 2, 4096, "none", 2),
    ("adam", 3, 64 << 20, "none", 2),
    ("sgd", 1, 2048, "fp16", 3),
])
def test_distributed_optimizer_matches_single_process(gpu_ring, kind, passes, threshold, compression, world):
    results = gpu_ring.run(_distributed, kind, 4, passes, threshold, compression, world_size=world, timeout_s=150)
    assert all(identical for identical, _ in results), "ranks must hold identical parameters"
    buckets = results[0][1]
    assert buckets == (1 if threshold == 64 << 20 else buckets) and buckets >= 1
    if threshold == 2048:
        assert buckets > 1, "a small threshold must split the gradients into several buckets"
