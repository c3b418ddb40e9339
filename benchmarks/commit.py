"""Cost of State.commit() for a 100 M-parameter model with Adam state, vs copying the same bytes once;
then the host memory and time of persisting that state durably and loading it back.

The baseline copies every tensor of the model and optimizer state once into
preallocated host buffers (one memcpy of the same bytes: the floor of any
in-memory snapshot). Prints the median of each and the ratio commit/copy
(target <= 2.0). Runs in one process (a ring of one), so no collective
cost is included. The first commit, which allocates its buffers, is reported
separately.

Persisting: peak growth of the process's resident memory (sampled every millisecond from
/proc/self/statm) while ``state.persist_now()`` writes the last commit to a local directory,
as a multiple of the state's bytes (target <= 1.5), for the first write (which allocates the
writer's buffer) and the next ones (which reuse it); the same for loading it back, and for
the previous way of persisting (copy the tree, torch.save into a BytesIO, getvalue), measured
in the same run as the reference.

    python -m benchmarks.commit [--params-m 100] [--reps 7] [--persist-dir /tmp] [--no-persist]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import elastic_ring as er
from state import TorchState
from state.checkpoints.store import CheckpointStore
from state.snapshot import copy_tree


def build(params_m: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg and exp_avg_sq
    return model, opt


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn: Callable[[], Any]) -> tuple[int, float, Any]:
    """Peak resident-memory growth (bytes) while ``fn`` runs, its seconds, and its result."""
    base, peak, stop = _rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - started
        stop.set()
        sampler.join()
    return max(peak[0], _rss()) - base, seconds, result


def old_way(snapshot: Any) -> int:
    """How persisting worked before: a copy of the tree, torch.save into memory, the bytes, a checksum."""
    tree = copy_tree(snapshot)
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    data = buffer.getvalue()
    hashlib.sha256(data).hexdigest()
    return len(data)


def persist_benchmark(state: TorchState, nbytes: int, directory: str) -> None:
    root = tempfile.mkdtemp(prefix="er-bench-ckpt-", dir=directory)
    try:
        state.enable_checkpoints(os.path.join(root, "ckpt"), every_n_commits=10**9, keep_last=1)
        state.commit()
        first, first_s, _ = peak_growth(lambda: state.persist_now(timeout_s=600))
        state.commit()
        steady, steady_s, _ = peak_growth(lambda: state.persist_now(timeout_s=600))
        store = CheckpointStore(os.path.join(root, "ckpt"))
        loaded_growth, load_s, loaded = peak_growth(store.load_latest)
        del loaded
        reference, reference_s, _ = peak_growth(lambda: old_way(state._snapshot))
        gib = nbytes / 2**30
        print(f"persist {gib:.2f} GiB to {directory} (write, fsync, read back, verify): peak host memory growth "
              f"{first / nbytes:.2f}x the state's bytes on the first write ({first_s:.1f} s, allocates the writer's "
              f"buffer), {steady / nbytes:.2f}x on the next ({steady_s:.1f} s, reuses it); target <= 1.5x")
        print(f"load it back (stream, verify, weights_only): {loaded_growth / nbytes:.2f}x ({load_s:.1f} s; the "
              f"loaded state itself is 1.00x); the previous way of persisting, in memory only: "
              f"{reference / nbytes:.2f}x ({reference_s:.1f} s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=int, default=100)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--persist-dir", default=tempfile.gettempdir(), help="where the persist benchmark writes")
    parser.add_argument("--no-persist", action="store_true", help="skip the persist benchmark")
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
    del targets
    if not args.no_persist:
        persist_benchmark(state, nbytes, args.persist_dir)
    er.shutdown()


if __name__ == "__main__":
    main()
