"""The job script of the cluster recipe: elastic GPU training with durable checkpoints on S3 or GCS.

On the cluster (see README.md beside this file), from this directory:

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python train.py --checkpoint-uri s3://YOUR-BUCKET/elastic-ring/run-1 --max-workers 8

On one machine, without a GPU (what tests/test_cluster_config.py runs):

    python examples/cluster/train.py --address local --cpu --checkpoint-uri /tmp/er-ckpt --epochs 2

The checkpoint location comes from ``--checkpoint-uri`` or the ``CHECKPOINT_URI`` environment
variable. Run the same command again after losing the cluster and the job resumes from the newest
checkpoint there (epoch, step and the sampler's position in the epoch included). On SIGTERM
(``ray job stop``, a Kubernetes pod eviction, the head shutting down) it stops at the next commit,
writes it, and exits with status 75 (``EX_TEMPFAIL``): the job is unfinished and a rerun resumes it,
so whatever runs this script (a Kubernetes Job, a KubeRay RayJob with ``backoffLimit``, a scheduler)
must retry it; 0 means training completed. See :data:`EXIT_STOPPED` and README.md.

The data set is synthetic (labels from fixed random projections), so the script runs
anywhere with no download; replace :func:`make_dataset` with yours. Everything else is what a real
job needs: one worker per GPU, gradients averaged by fused ring-allreduce, an in-memory commit every
``--commit-every`` steps, a durable checkpoint every ``--checkpoint-every-s`` seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import ray
import torch

import elastic_ring as er
from ray_integration import ElasticTrainer
from state import ElasticSampler, TorchState


def make_dataset(samples: int, features: int, classes: int, seed: int) -> torch.utils.data.TensorDataset:
    """Synthetic classification data: random inputs, each labelled by the largest of ``classes`` fixed
    random projections. The same on every worker (same seed), as a real data set would be."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(samples, features, generator=g)
    projections = torch.randn(features, classes, generator=g)
    return torch.utils.data.TensorDataset(xs, (xs @ projections).argmax(dim=1))


def train(config: dict) -> dict:
    """Runs on every worker: build everything, then the elastic loop (rank 0's return value is the result)."""
    torch.manual_seed(0)
    # ElasticTrainer(use_gpu=True) gives each worker one GPU and makes it the current device
    device = torch.device("cuda", torch.cuda.current_device()) if config["use_gpu"] else torch.device("cpu")
    dataset = make_dataset(config["samples"], config["features"], config["classes"], seed=1)
    model = torch.nn.Sequential(
        torch.nn.Linear(config["features"], config["width"]), torch.nn.ReLU(),
        torch.nn.Linear(config["width"], config["width"]), torch.nn.ReLU(),
        torch.nn.Linear(config["width"], config["classes"])).to(device)
    optimizer = er.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=config["lr"]),
                                        model.named_parameters())
    sampler = ElasticSampler(dataset, batch_size=config["batch_size"], seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    state = TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)

    @er.elastic.run
    def loop(state):
        while state.epoch < config["epochs"]:
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch()
                state.step += 1
                if state.step % config["commit_every"] == 0:
                    state.commit()  # in memory; joins, preemption drains and SIGTERM stops happen here
                    er.report(loss=float(er.allreduce(loss.detach()).cpu()), epoch=state.epoch, step=state.step)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        with torch.no_grad():  # accuracy on the first 4096 samples, the same on every rank
            xs, ys = dataset.tensors[0][:4096].to(device), dataset.tensors[1][:4096].to(device)
            accuracy = (model(xs).argmax(dim=1) == ys).float().mean().item()
        resumed = state.resumed_from
        return {"epochs": state.epoch, "steps": state.step, "train_accuracy": accuracy, "world_size": er.size(),
                "resumed_from": resumed["uri"] if resumed else None}

    return loop(state)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="elastic_ring on an autoscaling cluster (examples/cluster)")
    parser.add_argument("--checkpoint-uri", default=os.environ.get("CHECKPOINT_URI"),
                        help="durable checkpoints: s3://bucket/path, gs://bucket/path or an absolute path "
                             "(default: $CHECKPOINT_URI)")
    parser.add_argument("--checkpoint-every-s", type=float, default=120.0,
                        help="seconds between durable checkpoints (also one at every SIGTERM stop and before "
                             "a drain leaves fewer than --min-workers)")
    parser.add_argument("--checkpoint-every-commits", type=int, default=None,
                        help="also write a durable checkpoint every this many commits")
    parser.add_argument("--address", default=None,
                        help="Ray address: none inside `ray job submit` (it sets RAY_ADDRESS); 'local' for a new "
                             "local instance")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=8, help="at most the GPUs the cluster can grow to")
    parser.add_argument("--cpu", action="store_true", help="no GPUs: one worker per CPU, gloo instead of NCCL")
    parser.add_argument("--capacity-wait-s", type=float, default=1800.0,
                        help="how long to wait for --min-workers to start, or to come back after losses")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--commit-every", type=int, default=20, help="steps between in-memory commits")
    args = parser.parse_args(argv)
    if not args.checkpoint_uri:
        parser.error("give --checkpoint-uri s3://BUCKET/PATH (or set CHECKPOINT_URI): without durable checkpoints "
                     "a lost head node loses all training")
    return args


#: Exit status when training completed.
EXIT_COMPLETED = 0
#: Exit status of a run stopped before training completed (SIGTERM; also a forced stop): sysexits.h's
#: EX_TEMPFAIL, "a temporary failure; retry". Not 0, so job runners retry it (a rerun resumes from the
#: checkpoint); not 1 (a crash) nor 143 (ended by SIGTERM without stopping cleanly), so a Kubernetes
#: podFailurePolicy can tell a clean preemption (onExitCodes [75]: Ignore) from a failure.
EXIT_STOPPED = 75
#: Exit status of a stop whose final checkpoint write failed: a failure (the storage needs a look),
#: though a rerun still resumes from the newest checkpoint that was written.
EXIT_CHECKPOINT_FAILED = 1


def exit_code(result) -> int:
    """What this job's process reports: completed (0), stopped and resumable (75), final write failed (1)."""
    if result.completed:
        return EXIT_COMPLETED
    if result.checkpoint_error is not None:
        return EXIT_CHECKPOINT_FAILED
    return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ray.init(address=args.address)
    trainer = ElasticTrainer(
        min_workers=args.min_workers, max_workers=args.max_workers, use_gpu=not args.cpu,
        checkpoint_uri=args.checkpoint_uri, checkpoint_every_s=args.checkpoint_every_s,
        checkpoint_every_n_commits=args.checkpoint_every_commits,
        # on a cold cluster the first GPU nodes must boot and run their setup commands (installing torch
        # takes minutes), and after a spot loss below min_workers a replacement may take as long
        start_timeout_s=args.capacity_wait_s, elastic_timeout_s=args.capacity_wait_s)
    config = {key: getattr(args, key) for key in ("epochs", "samples", "features", "classes", "width", "batch_size",
                                                  "lr", "commit_every")}
    # SIGTERM from here on is a stop (before run() starts too: run() then returns a stopped Result at once);
    # run() handles it itself while it runs. After ray.init(), which installs its own SIGTERM handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: trainer.stop("SIGTERM"))
    result = trainer.run(train, config={**config, "use_gpu": not args.cpu})
    print(f"result: {result.value}")
    print(f"newest checkpoint: {result.checkpoint_uri}")
    for event in result.events:
        print(f"event: {event.kind} round={event.round_id} world={event.world_size}")
    code = exit_code(result)
    if result.completed:
        print("status: completed")
    else:
        how = "forced stop" if result.forced else "stopped"
        print(f"status: {how} ({result.stop_reason}) before training completed; exit {code} so that the job "
              f"runner retries; the rerun resumes from {result.checkpoint_uri or 'the start (no checkpoint yet)'}")
    if result.checkpoint_error is not None:
        print(f"checkpoint error: {result.checkpoint_error}")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
