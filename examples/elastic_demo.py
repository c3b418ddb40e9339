"""Watch a job lose a worker and gain a node while it keeps learning, then look at the picture.

    pip install matplotlib scikit-learn   # (in the test extra already)
    python examples/elastic_demo.py [--epochs 40] [--out elastic_demo.png] [--timeline demo_timeline.json]

It starts a local three-node Ray cluster (a head without CPUs and two worker
nodes with one slot each) and trains the digits MLP of ``digits.py`` with
``ElasticTrainer(min_workers=1, max_workers=3)``. Driven by the training's own
reports (``on_report``), it then:

1. SIGKILLs one worker process at step ``--kill-at-step``: the survivor rolls
   back to its last commit and carries on alone; a replacement starts on the
   freed slot and joins at a commit (world 2 -> 1 -> 2);
2. adds a third node once the replacement has joined: a third worker starts
   there and joins at a commit (world 3).

It writes a PNG of loss and world size over time with the membership events
marked, and (``--timeline``) a Chrome trace of every rank's fusion, allreduce,
commit, sync and membership events for https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import sys
import os
import pathlib
import signal
import socket
import time

import ray
from ray.cluster_utils import Cluster

from digits import TARGET_ACCURACY, train
from ray_integration import ElasticTrainer

EXAMPLES = pathlib.Path(__file__).resolve().parent

#: Membership events drawn on the plot, with their colours.
MARKED = {"worker_lost": "tab:red", "recovered": "tab:orange", "worker_joined": "tab:green"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chaos:
    """Reacts to rank 0's reports (called on the driver's thread, between two of its ticks): SIGKILL a
    worker at a step, then add a node once the ring is whole again."""

    def __init__(self, cluster: Cluster, kill_at_step: int) -> None:
        self.cluster, self.kill_at_step = cluster, kill_at_step
        self.phase = "before kill"
        self.actions: list[tuple[float, str]] = []   # (wall time, what the demo did)

    def on_report(self, record: dict) -> None:
        if self.phase == "before kill" and record.get("step", 0) >= self.kill_at_step:
            self.phase = "killed"
            self.kill_round = record["round"]
            self._kill_a_worker()
        elif self.phase == "killed" and record["round"] > self.kill_round and record["world_size"] == 2:
            self.phase = "node added"
            self._add_a_node()  # on the driver's thread: Ray starts nodes from the main thread only

    def _kill_a_worker(self) -> None:
        from ray.util.state import list_actors

        alive = list_actors(filters=[("class_name", "=", "RingWorker"), ("state", "=", "ALIVE")])
        victim = max(alive, key=lambda a: a.pid)
        os.kill(victim.pid, signal.SIGKILL)  # all nodes of this local cluster run on this machine
        self.actions.append((time.time(), f"SIGKILL worker pid {victim.pid}"))
        print(f"demo: SIGKILLed worker pid {victim.pid} on node {victim.node_id[:8]}", flush=True)

    def _add_a_node(self) -> None:
        self.actions.append((time.time(), "node added"))
        self.cluster.add_node(num_cpus=1, resources={"slot": 1})
        print("demo: added a node with one slot", flush=True)


def plot(result, actions: list[tuple[float, str]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.metrics_history[0]["time"]
    times = [m["time"] - t0 for m in result.metrics_history]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[3, 1])
    top.plot(times, [m["loss"] for m in result.metrics_history], color="tab:blue", lw=1.2)
    top.set_ylabel("training loss (ring mean)")
    top.set_yscale("log")
    top.set_title("elastic_ring: training through a lost worker and an added node")
    rings = [(e.time - t0, e.world_size) for e in result.events if e.kind == "ring_formed"]
    rings.append((times[-1], rings[-1][1]))
    bottom.step([max(t, 0.0) for t, _ in rings], [w for _, w in rings], where="post", color="black")
    bottom.set_ylabel("world size")
    bottom.set_xlabel("seconds since the first report")
    bottom.set_yticks(range(1, max(w for _, w in rings) + 1))
    seen = set()
    for event in result.events:
        if event.kind in MARKED and event.time >= t0:
            label = event.kind if event.kind not in seen else None
            seen.add(event.kind)
            for axis in (top, bottom):
                axis.axvline(event.time - t0, color=MARKED[event.kind], ls="--", lw=1, label=label if axis is top else None)
    for when, what in actions:
        top.annotate(what, (when - t0, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                     fontsize=8, color="dimgray")
    top.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--kill-at-step", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (a bigger model than digits.py's, "
                        "so that a step takes long enough to watch workers come and go)")
    parser.add_argument("--out", default="elastic_demo.png")
    parser.add_argument("--timeline", default=None, help="also write a Chrome trace here")
    args = parser.parse_args()

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "dashboard_port": free_port()})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"slot": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(EXAMPLES) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
        chaos = Chaos(cluster, args.kill_at_step)
        trainer = ElasticTrainer(min_workers=1, max_workers=3, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                                 heartbeat_timeout_s=5, timeline_path=args.timeline)
        result = trainer.run(train, config={"lr": 0.05, "epochs": args.epochs, "hidden": args.hidden, "depth": args.depth}, on_report=chaos.on_report)
    finally:
        ray.shutdown()
        cluster.shutdown()

    worlds = [e.world_size for e in result.events if e.kind == "ring_formed"]
    print("world sizes: " + " -> ".join(str(w) for w in worlds))
    for event in result.events:
        print(f"event: {event.kind} round={event.round_id} world={event.world_size} {event.detail}")
    if not result.completed:  # stopped (SIGTERM) before fn returned: a job runner should run it again
        sys.exit(75)
    accuracy = result.value["test_accuracy"]
    print(f"test accuracy {accuracy:.4f} ({'target reached' if accuracy >= TARGET_ACCURACY else 'below the target'})")
    plot(result, chaos.actions, pathlib.Path(args.out))
    print(f"plot written to {args.out}" + (f"; timeline written to {args.timeline}" if args.timeline else ""))


if __name__ == "__main__":
    main()
