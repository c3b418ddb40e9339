"""Cost of State.commit() for a 100 M-parameter model with Adam state, vs copying the same bytes once.

The baseline copies every tensor of the model and optimizer state once into
preallocated host buffers (one memcpy of the same bytes: the floor of any
in-memory snapshot). Prints the median of each and the ratio commit/copy
(target <= 2.0). Runs in one process (a ring of one), so no collective
cost is included. The first commit, which allocates its buffers, is reported
separately.

    python -m benchmarks.commit [--params-m 100] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import elastic_ring as er
from state import TorchState


def build(params_m: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg and exp_avg_sq
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=int, default=100)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    er.init(er.RingSpec(round_id=1, rank=0, world_size=1, node_ids=("local",), store=er.StoreAddress("127.0.0.1", store.port)))
    model, opt = build(args.params_m)
    state = TorchState(model=model, optimizer=opt, epoch=0)
    sources = [t for t in model.state_dict().values()] + [
        t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    targets = [torch.empty_like(t) for t in sources]

    started = time.perf_counter()
    state.commit()
    first = time.perf_counter() - started
    copies, commits = [], []
    for _ in range(args.reps):
        started = time.perf_counter()
        torch._foreach_copy_(targets, sources)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        state.commit()
        commits.append(time.perf_counter() - started)
    params = sum(p.numel() for p in model.parameters())
    copy_ms, commit_ms = statistics.median(copies) * 1000, statistics.median(commits) * 1000
    print(f"{params / 1e6:.0f} M parameters + Adam state: {nbytes / 2**30:.2f} GiB; {args.reps} interleaved reps, 1 thread")
    print(f"median copy of the same bytes once: {copy_ms:.0f} ms; median commit: {commit_ms:.0f} ms; "
          f"ratio commit/copy {commit_ms / copy_ms:.2f} (first commit, allocating its buffers: {first * 1000:.0f} ms)")
    er.shutdown()


if __name__ == "__main__":
    main()
