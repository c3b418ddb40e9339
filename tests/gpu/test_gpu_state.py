"""State sync over NCCL keeps every leaf's device: each value lands where the receiver's own copy lives
(CUDA parameters and moments on the GPU; Adam's ``step`` counters, RNG states and CPU values on the CPU),
and the synced state trains and commits."""

import pytest
import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from state import TorchState

pytestmark = pytest.mark.gpu


def _build(rank, device):
    torch.manual_seed(10 + rank)  # every rank starts from different values: the sync must replace them
    model = torch.nn.Linear(4, 2).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, device=device)).sum().backward()
    optimizer.step()
    return TorchState(model=model, optimizer=optimizer, rng=torch.get_rng_state(),
                      on_gpu=torch.full((3,), float(rank), device=device), on_cpu=torch.full((2,), float(rank)),
                      mixed={"g": torch.full((1,), float(rank), device=device), "c": [torch.full((1,), float(rank))]},
                      step=rank)


def _leaves(state):
    """(name, device, CPU copy) of every tensor the state holds, in a fixed order."""
    out = [(f"model.{n}", t.device.type, t.detach().cpu()) for n, t in state.model.state_dict().items()]
    for i, p in enumerate(state.optimizer.param_groups[0]["params"]):
        for key, value in sorted(state.optimizer.state[p].items()):
            out.append((f"optimizer.{i}.{key}", value.device.type, value.detach().cpu()))
    out += [("rng", state.rng.device.type, state.rng.clone()), ("on_gpu", state.on_gpu.device.type, state.on_gpu.cpu()),
            ("on_cpu", state.on_cpu.device.type, state.on_cpu.clone()),
            ("mixed.g", state.mixed["g"].device.type, state.mixed["g"].cpu()),
            ("mixed.c", state.mixed["c"][0].device.type, state.mixed["c"][0].clone())]
    return out


def _sync_keeps_devices():
    comm = runtime.current()
    device = comm.device
    state = _build(comm.rank, device)
    before = [(name, kind) for name, kind, _ in _leaves(state)]
    state.sync(root_rank=0)
    after = _leaves(state)
    moved = [(name, was, now) for (name, was), (_, now, _) in zip(before, after) if was != now]
    root = er.broadcast_object([value for _, _, value in after] if comm.rank == 0 else None, root_rank=0)
    differs = [name for (name, _, value), expected in zip(after, root) if not torch.equal(value, expected)]
    # the synced state is usable: Adam steps (its step counters on the CPU), the RNG state is settable
    try:
        state.model(torch.randn(3, 4, device=device)).sum().backward()
        state.optimizer.step()
        torch.set_rng_state(state.rng)
        state.commit()
        unusable = None
    except Exception as exc:  # reported to the test with the devices that moved
        unusable = f"{type(exc).__name__}: {exc}"
    return {"moved": moved, "differs": differs, "unusable": unusable, "step": state.step, "leaves": len(after)}


def test_state_sync_keeps_every_leafs_device(gpu_ring):
    results = gpu_ring.run(_sync_keeps_devices, world_size=2, timeout_s=120, collective_timeout_s=20.0)
    for rank, result in enumerate(results):
        assert result["moved"] == [], f"rank {rank}: leaves changed device in the sync: {result['moved']}"
        assert result["differs"] == [], f"rank {rank}: leaves differ from root's after the sync: {result['differs']}"
        assert result["unusable"] is None, f"rank {rank}: the synced state cannot train: {result['unusable']}"
        assert result["step"] == 0 and result["leaves"] == 2 + 2 * 3 + 5
