"""Stream a job's metrics and membership events to TensorBoard while it trains.

    pip install tensorboard          # in the examples and test extras already
    python examples/tensorboard_metrics.py [--logdir runs] [--workers 2] [--min-workers 1] [--epochs 3]
    tensorboard --logdir runs        # then open http://localhost:6006

``ElasticTrainer.run(fn, config, on_report=..., on_event=...)`` calls
``on_report(record)`` on the driver with each of rank 0's ``er.report``
records as it arrives, and ``on_event(event)`` with each membership event
(ring formed, worker lost, worker joined, recovered, ...). This example turns
them into TensorBoard data with ``torch.utils.tensorboard.SummaryWriter``:

* every number rank 0 reports (here ``loss``) becomes the scalar
  ``metrics/<name>`` at the job's global step (``ElasticSampler`` counts it, so
  it carries on across failures and resizes, and a rollback shows as a step
  written again);
* the world size of each report becomes ``membership/world_size``;
* each membership event becomes a line of the text panel ``events`` and a point
  of ``membership/<kind>`` (how many of that kind so far), so a lost worker or a
  join lines up with the loss curve.

The training function is the quickstart's. Run it on a cluster the same way,
with ``ray.init(address="auto")``: only the driver writes, so the log
directory is a path on the driver's machine (or any URL TensorBoard reads,
such as ``s3://bucket/runs``).
"""

from __future__ import annotations

import argparse
import numbers
import time
from typing import Any

import ray
from torch.utils.tensorboard import SummaryWriter

from quickstart import train
from ray_integration import ElasticTrainer, Event

#: Fields of a report record that are bookkeeping, not metrics.
BOOKKEEPING = frozenset({"time", "driver_time", "rank", "round", "world_size", "step", "epoch", "samples"})


class TensorBoardSink:
    """``on_report`` / ``on_event`` callbacks that write to one TensorBoard run directory."""

    def __init__(self, logdir: str, flush_secs: int = 5) -> None:
        self.writer = SummaryWriter(log_dir=logdir, flush_secs=flush_secs)
        self.step = 0                        # the newest global step seen; events are drawn there
        self.counts: dict[str, int] = {}
        self.scalars_written = 0

    def on_report(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        self.step = int(step) if isinstance(step, int) else self.step + 1
        walltime = record.get("time")
        for name, value in record.items():
            if name in BOOKKEEPING:
                continue
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self.writer.add_scalar(f"metrics/{name}", float(value), self.step, walltime=walltime)
                self.scalars_written += 1
            else:  # er.report also takes short strings and booleans
                self.writer.add_text(f"metrics/{name}", str(value), self.step, walltime=walltime)
        if isinstance(record.get("world_size"), int):
            self.writer.add_scalar("membership/world_size", record["world_size"], self.step, walltime=walltime)
        if isinstance(record.get("epoch"), int):
            self.writer.add_scalar("progress/epoch", record["epoch"], self.step, walltime=walltime)

    def on_event(self, event: Event) -> None:
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        self.writer.add_scalar(f"membership/{event.kind}", self.counts[event.kind], self.step, walltime=event.time)
        detail = " ".join(f"{k}={v}" for k, v in event.detail.items())
        self.writer.add_text("events", f"`{event.kind}` round {event.round_id}, world {event.world_size}: {detail}",
                             self.step, walltime=event.time)

    def close(self) -> None:
        self.writer.close()  # flushes what is pending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", default=None, help="TensorBoard run directory (default: runs/<date-time>)")
    parser.add_argument("--workers", type=int, default=2, help="max_workers")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    logdir = args.logdir or time.strftime("runs/elastic_ring-%Y%m%d-%H%M%S")

    # a new local Ray instance, even if a cluster runs on this machine (on a cluster: ray.init(address="auto"))
    ray.init(address="local", num_cpus=max(4, args.workers), include_dashboard=False)
    sink = TensorBoardSink(logdir)
    try:
        result = ElasticTrainer(min_workers=args.min_workers, max_workers=args.workers, progress=False).run(
            train, config={"lr": 0.05, "epochs": args.epochs}, on_report=sink.on_report, on_event=sink.on_event)
    finally:
        sink.close()
    print(f"result: {result.value}")
    print(f"wrote {sink.scalars_written} metric values and {sum(sink.counts.values())} events to {logdir}")
    print(f"view them with: tensorboard --logdir {logdir}")


if __name__ == "__main__":
    main()
