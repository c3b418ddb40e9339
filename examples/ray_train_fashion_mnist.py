"""Ray Train's PyTorch fashion-MNIST example, ported to elastic_ring with the fewest changes.

Original: ray-project/ray ``python/ray/train/examples/pytorch/torch_fashion_mnist_example.py`` (commit
048bcae). Run it (about 16 s on 2 cores; no download: synthetic 28x28 "fashion-like" images, one random
smooth prototype per class plus noise)::

    python examples/ray_train_fashion_mnist.py [--workers 2] [--epochs 10] [--storage-path /abs/dir]

What changed from the original, line by line:

 1. ``import ray.train`` / ``TorchTrainer`` / torchvision -> ``import elastic_ring as er``, ``from state import
    ElasticSampler, TorchState``, ``from ray_integration import ElasticTrainer``, ``from ray_integration.train import get_checkpoint,
    get_context, report`` (``ray.train``'s ``Checkpoint``, ``RunConfig``, ``ScalingConfig`` stay). Added ``er.size()`` first in
    ``train_func_per_worker`` (Ray Train's process group exists before the function runs; elastic_ring forms the
    worker's ring at its first call; optional). Also ``torch.set_num_threads(1)`` and ``torch.manual_seed(0)``
    (2-core machine; the same initial model).
 2. ``get_dataloaders``: ``datasets.FashionMNIST(root="~/data", download=True, transform=...)`` ->
    ``fashion_like(...)`` (same shape, same ``Normalize((0.5,), (0.5,))``); sizes from ``config``.
 3. ``[1] train_dataloader = ray.train.torch.prepare_data_loader(train_dataloader)`` ->
    ``train_sampler = ElasticSampler(dataset, batch_size=batch_size, shuffle=False)`` and
    ``DataLoader(dataset, batch_sampler=train_sampler)`` (``prepare_data_loader`` adds a
    ``DistributedSampler``, with ``shuffle=False`` for a sequential loader, and calls its ``set_epoch``).
 4. ``test_dataloader = ray.train.torch.prepare_data_loader(test_dataloader)`` -> a ``DataLoader`` with
    ``DistributedSampler(test_data, num_replicas=context.get_world_size(), rank=context.get_world_rank(),
    shuffle=False)`` (what ``prepare_data_loader`` builds; the elastic loop re-points it at every new ring, as the
    loop's function names ``test_dataloader``; at the first re-point each worker logs a WARNING meant for
    training data, "that epoch restarts and part of it is seen twice", harmless for this test loader).
 5. ``[2] model = ray.train.torch.prepare_model(model)`` (DDP) -> removed; the optimizer line becomes
    ``er.DistributedOptimizer(torch.optim.SGD(...), model.named_parameters())``.
 6. added ``state = TorchState(model=model, optimizer=optimizer, sampler=train_sampler, epoch=0)``, then Ray
    Train's resume pattern: ``checkpoint = get_checkpoint()``; if there is one, load the model, the optimizer
    and the epoch from its ``checkpoint.pt`` (the original does not checkpoint; this is the pattern of Ray
    Train's checkpointing guide).
 7. ``for epoch in range(epochs):`` -> ``@er.elastic.run def train_loop(state): for state.epoch in
    range(state.epoch, epochs):`` with ``train_sampler.set_epoch(state.epoch)`` first (what
    ``prepare_data_loader``'s loader did), and ``epoch`` -> ``state.epoch`` in the tqdm labels; the
    tqdm bars are off unless ``config["tqdm"]`` (they would fill every worker's log).
 8. added ``train_sampler.record_batch()`` after ``optimizer.step()``.
 9. ``[3] ray.train.report(metrics={...})`` -> ``report(metrics, checkpoint=...)`` (``from ray_integration.train``:
    rank 0's record reaches the driver, as Ray Train keeps rank 0's); with a location (``--storage-path``),
    rank 0 saves the model, the optimizer and the epoch into a temporary directory and reports it as
    ``Checkpoint.from_directory(d)`` (copied at once, then uploaded and verified in the background; pass
    ``checkpoint_upload_mode=CheckpointUploadMode.SYNC`` to wait for it, Ray Train's default); then
    ``state.commit()`` at the epoch's end. The metrics also carry the epoch.
10. ``train_func_per_worker`` returns the last metrics (``result.value``); ``result.metrics`` is the last
    reported record, as in Ray Train.
11. ``TorchTrainer(train_loop_per_worker=..., train_loop_config=..., scaling_config=ScalingConfig(
    num_workers=n, use_gpu=...)).fit()`` -> ``ElasticTrainer(scaling_config=ScalingConfig(num_workers=(1, n),
    use_gpu=...), run_config=RunConfig(storage_path=..., name=...)).run(train_func_per_worker, train_config)``
    (elastic: 1 to n workers; no ``run_config`` without ``--storage-path``); ``batch_size_per_worker`` keeps the
    original ``global_batch_size // num_workers`` (``ElasticSampler(global_batch_size=32)`` would keep the
    global batch at 32 whatever the world size).
12. added (off by default): ``config["log_every"]`` = n averages the training loss over the ring with
    one allreduce every n steps and reports it with the epoch's progress.

Lines marked ``# test hook`` are not part of the port: they let ``tests/test_ported_scripts.py`` kill a
rank right after a chosen step (``config["kill"] = (round, rank, step)``) or every rank right after an epoch's
report (``config["kill_all_after_epoch"]``), slow steps down, and count
every sample's uses exactly (``config["count_hits"]``: a parameter whose gradient is the batch's one-hot
hits, applied in the same optimizer step as the batch).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Dict

import tempfile

import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

import elastic_ring as er
from ray_integration import ElasticTrainer
from ray_integration.train import get_checkpoint, get_context, report
from state import ElasticSampler, TorchState


def fashion_like(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` 28x28 one-channel images of 10 classes: a fixed smooth random prototype per class (the same
    in every process) plus pixel noise (``seed``), scaled to [0, 1] and normalized with (0.5, 0.5)."""
    protos = torch.rand(10, 1, 7, 7, generator=torch.Generator().manual_seed(1234))
    protos = nn.functional.interpolate(protos, size=(28, 28), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = (protos[y] + 0.35 * torch.randn(n, 1, 28, 28, generator=g)).clamp(0, 1)
    return torch.utils.data.TensorDataset((x - 0.5) / 0.5, y)


class HitCounter(torch.utils.data.Dataset):  # test hook: remembers the indices of the batch it last fetched
    def __init__(self, dataset):
        self.dataset, self.last = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, indices):
        self.last = list(indices)
        return [self.dataset[i] for i in indices]


def get_dataloaders(batch_size, train_samples=2048, test_samples=512):
    # Synthetic fashion-like data (the original downloads FashionMNIST).
    training_data = fashion_like(train_samples, seed=1)
    test_data = fashion_like(test_samples, seed=2)

    # Create data loaders.
    train_dataloader = DataLoader(training_data, batch_size=batch_size)
    test_dataloader = DataLoader(test_data, batch_size=batch_size)

    return train_dataloader, test_dataloader


# Model Definition
class NeuralNetwork(nn.Module):
    def __init__(self):
        super(NeuralNetwork, self).__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 10),
            nn.ReLU(),
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def train_func_per_worker(config: Dict):
    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]
    er.size()  # form this worker's ring now, as Ray Train's process group exists before train_func (optional)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    # Get dataloaders inside worker training function
    train_dataloader, test_dataloader = get_dataloaders(batch_size, config.get("train_samples", 2048),
                                                        config.get("test_samples", 512))
    count_hits = config.get("count_hits", False)  # test hook
    training_data = HitCounter(train_dataloader.dataset) if count_hits else train_dataloader.dataset  # test hook

    # [1] Shard the datasets among workers: ElasticSampler (training), DistributedSampler (test)
    # =======================================================================
    train_sampler = ElasticSampler(training_data, batch_size=batch_size, shuffle=False)
    train_dataloader = DataLoader(training_data, batch_sampler=train_sampler)
    context = get_context()
    test_dataloader = DataLoader(test_dataloader.dataset, batch_size=batch_size, sampler=DistributedSampler(
        test_dataloader.dataset, num_replicas=context.get_world_size(), rank=context.get_world_rank(), shuffle=False))

    model = NeuralNetwork()

    # [2] (no DDP wrapper: the DistributedOptimizer averages the gradients during backward)
    # ============================================================
    groups = [{"params": list(model.parameters())}]
    if count_hits:  # test hook: one counter per sample, moved only by optimizer steps (lr 1: +1 per use)
        model.hits = nn.Parameter(torch.zeros(len(training_data)))
        groups.append({"params": [model.hits], "lr": 1.0, "momentum": 0.0})

    loss_fn = nn.CrossEntropyLoss()
    optimizer = er.DistributedOptimizer(torch.optim.SGD(groups, lr=lr, momentum=0.9), model.named_parameters())
    state = TorchState(model=model, optimizer=optimizer, sampler=train_sampler, epoch=0)

    # Resume from the newest reported checkpoint (an earlier run's too, after the whole cluster was lost)
    resumed_epoch = None
    checkpoint = get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            saved = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        resumed_epoch = saved["epoch"]
        state.epoch = resumed_epoch + 1

    kill = tuple(config["kill"]) if config.get("kill") else None  # test hook
    log_every = config.get("log_every", 0)

    # Model training loop
    @er.elastic.run
    def train_loop(state):
        metrics = {}
        for state.epoch in range(state.epoch, epochs):
            train_sampler.set_epoch(state.epoch)
            model.train()
            for X, y in tqdm(train_dataloader, desc=f"Train Epoch {state.epoch}", disable=not config.get("tqdm")):
                pred = model(X)
                loss = loss_fn(pred, y)

                optimizer.zero_grad()
                if count_hits:  # test hook: the hits' gradient is -(this batch's one-hot) x world, averaged
                    onehot = torch.zeros(len(training_data))
                    onehot[training_data.last] = float(er.size())
                    (loss - (model.hits * onehot).sum()).backward()
                else:
                    loss.backward()
                optimizer.step()
                if kill == (er.round_id(), er.rank(), train_sampler.step):  # test hook
                    os.kill(os.getpid(), signal.SIGKILL)  # after the apply, before the loss allreduce
                train_sampler.record_batch()
                if log_every and train_sampler.step % log_every == 0:
                    train_loss = er.allreduce(loss.detach(), name="train_loss").item()
                    er.report(train_loss=train_loss, epoch=state.epoch, position=train_sampler.processed,
                              batches=len(train_dataloader))
                time.sleep(config.get("step_delay_s", 0.0))  # test hook

            model.eval()
            test_loss, num_correct, num_total = 0, 0, 0
            with torch.no_grad():
                for X, y in tqdm(test_dataloader, desc=f"Test Epoch {state.epoch}", disable=not config.get("tqdm")):
                    pred = model(X)
                    loss = loss_fn(pred, y)

                    test_loss += loss.item()
                    num_total += y.shape[0]
                    num_correct += (pred.argmax(1) == y).sum().item()

            test_loss /= len(test_dataloader)
            accuracy = num_correct / num_total

            # [3] Report metrics and checkpoint (rank 0's)
            # ===============================
            metrics = {"test_loss": test_loss, "accuracy": accuracy, "epoch": state.epoch}
            with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
                checkpoint = None
                if config.get("checkpoint") and context.get_world_rank() == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": state.epoch},
                               os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
                    checkpoint = Checkpoint.from_directory(temp_checkpoint_dir)
                report(metrics, checkpoint=checkpoint)
            if config.get("kill_all_after_epoch") == state.epoch:  # test hook: every rank dies here at once
                os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
        return metrics

    metrics = train_loop(state)
    if count_hits:  # test hook: what the test checks, from every rank
        params = er.allgather_object([p.detach().clone() for p in model.parameters()])
        metrics["identical"] = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
        metrics["seen"] = model.hits.detach().round().tolist()
        metrics["world"] = er.size()
        metrics["steps"] = train_sampler.step
        metrics["epochs"] = state.epoch + 1
        metrics["resumed_epoch"] = resumed_epoch
        sampler = test_dataloader.sampler
        metrics["test_images"] = int(er.allreduce(torch.tensor(float(len(sampler))), op=er.Sum))
        metrics["test_split"] = er.allgather_object((sampler.num_replicas, sampler.rank, er.size(), er.rank()))
        # the accuracy over the whole test set (the original reports rank 0's shard only)
        scores = torch.tensor([float(metrics["accuracy"] * len(sampler)), float(len(sampler))])
        totals = er.allreduce(scores, op=er.Sum)
        metrics["ring_accuracy"] = float(totals[0] / totals[1])
        metrics["shard_accuracy"] = er.allgather_object(metrics["accuracy"])
    return metrics


def train_fashion_mnist(num_workers=2, use_gpu=False, epochs=10, lr=1e-3, storage_path=None, name="fashion_mnist"):
    global_batch_size = 32

    train_config = {
        "lr": lr,
        "epochs": epochs,
        "batch_size_per_worker": global_batch_size // num_workers,
        "checkpoint": storage_path is not None,
    }

    # Configure computation resources: 1 to num_workers workers (elastic)
    scaling_config = ScalingConfig(num_workers=(1, num_workers), use_gpu=use_gpu)
    # Checkpoints go to storage_path/name; a rerun with the same ones resumes
    run_config = RunConfig(storage_path=storage_path, name=name) if storage_path else None

    # Initialize an elastic trainer
    trainer = ElasticTrainer(scaling_config=scaling_config, run_config=run_config)

    # [4] Start Distributed Training
    # Run `train_func_per_worker` on all workers
    # =============================================
    result = trainer.run(train_func_per_worker, train_config)
    print(f"Training result: {result.metrics}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--storage-path", default=None, help="absolute path or URL for checkpoints (resume)")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=max(4, args.workers), include_dashboard=False)
    outcome = train_fashion_mnist(num_workers=args.workers, use_gpu=False, epochs=args.epochs, lr=args.lr,
                                  storage_path=args.storage_path)
    sys.exit(0 if outcome.completed else 75)
