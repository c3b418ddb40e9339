"""Ray Train's fashion-MNIST port driven as a script with its own local Ray, for the whole-cluster kill test.

    python tests/scripts/ray_train_resume_job.py STORAGE_PATH NAME PROGRESS_FILE RAY_TEMP_DIR EPOCHS

Runs ``examples/ray_train_fashion_mnist.py``'s own ``train_func_per_worker`` as its ``train_fashion_mnist``
does (``ElasticTrainer(scaling_config=ScalingConfig(num_workers=(1, 2)), run_config=RunConfig(storage_path=...,
name=...))``, a checkpoint reported by rank 0 every epoch, ``get_checkpoint()`` to resume), with the example's
test hooks on (``count_hits``, ``log_every=1``, ``step_delay_s``), which its command line does not expose.
Each of rank 0's step reports is appended to PROGRESS_FILE as ``epoch position``. A completed run prints
``RESULT {json}`` (the Result's value, metrics, checkpoint and what ``load_checkpoint`` reads from it, and the
checkpoint lease's log records with their time since ``run()`` was called) and exits 0.
"""

import json
import logging
import os
import pathlib
import sys
import time

import ray
import torch
from ray.train import RunConfig, ScalingConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import ray_train_fashion_mnist  # noqa: E402
from ray_integration import ElasticTrainer, load_checkpoint  # noqa: E402

TRAIN_SAMPLES, BATCH_PER_WORKER = 768, 16


class LeaseRecords(logging.Handler):
    """Keeps the checkpoint lease's log records (the driver takes the lease in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main() -> None:
    storage_path, name, progress_file, ray_temp_dir, epochs = sys.argv[1:6]
    epochs = int(epochs)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    lease_log = LeaseRecords()
    logger = logging.getLogger("state.checkpoints.lease_file")
    logger.setLevel(logging.INFO)
    logger.addHandler(lease_log)

    progress = open(progress_file, "a", buffering=1)

    def on_report(record: dict) -> None:
        if "position" in record:  # a step report (log_every=1); the epoch reports carry "accuracy"
            progress.write(f"{record['epoch']} {record['position']}\n")
            progress.flush()

    config = {"lr": 1e-3, "epochs": epochs, "batch_size_per_worker": BATCH_PER_WORKER, "checkpoint": True,
              "train_samples": TRAIN_SAMPLES, "test_samples": 128, "count_hits": True, "log_every": 1,
              "step_delay_s": 0.1}
    trainer = ElasticTrainer(scaling_config=ScalingConfig(num_workers=(1, 2)),
                             run_config=RunConfig(storage_path=storage_path, name=name), progress=False)
    called = time.time()
    result = trainer.run(ray_train_fashion_mnist.train_func_per_worker, config, on_report=on_report)
    progress.close()
    saved = torch.load(os.path.join(load_checkpoint(result.checkpoint), "checkpoint.pt"))
    value = result.value
    print("RESULT " + json.dumps({
        "completed": result.completed,
        "resumed_epoch": value["resumed_epoch"], "epochs": value["epochs"], "steps": value["steps"],
        "seen": value["seen"], "identical": value["identical"], "world": value["world"],
        "metrics": {k: result.metrics[k] for k in ("epoch", "accuracy", "test_loss")},
        "epoch_reports": [{"epoch": m["epoch"], "accuracy": m["accuracy"]}
                          for m in result.metrics_history if "accuracy" in m],
        "step_epochs": sorted({m["epoch"] for m in result.metrics_history if "position" in m}),
        "path": result.path, "checkpoint_path": result.checkpoint.path,
        "loaded": {"epoch": saved["epoch"], "hits": saved["model"]["hits"].round().tolist()},
        "lease_log": [{"after_run_s": r.created - called, "level": r.levelname, "message": r.getMessage()}
                      for r in lease_log.records],
        "events": [e.kind for e in result.events],
    }), flush=True)


if __name__ == "__main__":
    main()
