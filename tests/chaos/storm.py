"""A seeded storm of failures and membership changes, and the controller that runs it on a
local multi-node ``ray.cluster_utils.Cluster`` while the invariant job trains.

Deciding is separate from doing: :func:`schedule` is a pure function of the seed (tested
with tables); :class:`StormController` executes it. Each event waits for a steady ring
(the world size the cluster can hold, in a round newer than the previous event's), then
acts, then waits until the fault fired. Cluster capacity stays between 3 and 4 one-slot
nodes so that every event is observable (max_workers is 4).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass

from tests.chaos.invariant_job import FaultFile

WORKER_FAULTS = ("sigkill", "sigstop", "kill_in_commit", "kill_in_sync", "kill_in_reform", "kill_in_join")
NODE_EVENTS = ("node_removed", "node_drained", "node_added")
ALL_KINDS = WORKER_FAULTS + NODE_EVENTS
MAX_WORKERS = 4
MIN_CAPACITY = 3
#: Seconds to wait for the ring to be steady before an event, or for a fault to fire.
STEADY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class StormEvent:
    kind: str
    rank: int           # the victim's rank (worker faults)
    helper_rank: int    # kill_in_sync / kill_in_reform: the rank SIGKILLed to cause the re-form
    gap_steps: int      # steps of steady training before the event


def schedule(seed: int, n: int, capacity: int = MAX_WORKERS) -> list[StormEvent]:
    """``n`` events in a seeded order; every kind appears once before any repeats (n >= 9 has all);
    removals and drains only at full capacity, additions only below it."""
    rng = random.Random(seed)
    bag: list[str] = []
    events = []
    for _ in range(n):
        if not bag:
            bag = list(ALL_KINDS)
            rng.shuffle(bag)
        allowed = [k for k in bag if (k not in ("node_removed", "node_drained") or capacity > MIN_CAPACITY)
                   and (k != "node_added" or capacity < MAX_WORKERS)]
        kind = allowed[0]
        bag.remove(kind)
        capacity += {"node_removed": -1, "node_drained": -1, "node_added": 1}.get(kind, 0)
        rank = 0 if kind == "kill_in_sync" else rng.randrange(MIN_CAPACITY)
        helper = rng.choice([r for r in range(1, MIN_CAPACITY) if r != rank])
        events.append(StormEvent(kind, rank, helper, gap_steps=rng.randrange(4, 10)))
    return events


def steps_redone(lines: list[tuple[int, int]]) -> dict[int, int]:
    """For each round after the first: how many steps completed in earlier rounds (by any rank) it trained
    again. ``lines`` are ``(round, step)`` after each completed step, from every process."""
    by_round: dict[int, list[int]] = {}
    for round_id, step in lines:
        by_round.setdefault(round_id, []).append(step)
    redone, done = {}, None
    for round_id in sorted(by_round):
        if done is not None:
            redone[round_id] = done - (min(by_round[round_id]) - 1)
        done = max(by_round[round_id]) if done is None else max(done, max(by_round[round_id]))
    return redone


def read_step_logs(directory: str) -> list[tuple[int, int]]:
    lines = []
    for name in os.listdir(directory):
        if name.startswith("steps-") and name.endswith(".log"):
            with open(os.path.join(directory, name)) as f:
                lines += [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    return lines


def expected_losses(events: list[StormEvent]) -> int:
    """Members lost: one per worker fault (two for the compound ones) and per removed node."""
    return sum({"kill_in_sync": 2, "kill_in_reform": 2, "kill_in_join": 2, "node_removed": 1}.get(
        e.kind, 1 if e.kind in WORKER_FAULTS else 0) for e in events)


class StormController:
    def __init__(self, cluster, nodes: list, chaos_dir: str, drain) -> None:
        self.cluster, self.nodes, self.dir, self.drain = cluster, list(nodes), chaos_dir, drain
        self.faults = FaultFile(chaos_dir)
        self.armed: list[dict] = []
        self.next_id = 1
        self.last_round = 0
        self.log: list[str] = []

    # ------------------------------------------------------------ observing
    def progress(self) -> tuple[int, int, int, int] | None:
        try:
            with open(os.path.join(self.dir, "progress")) as f:
                step, world, rnd, epoch = (int(x) for x in f.read().split())
            return step, world, rnd, epoch
        except (FileNotFoundError, ValueError):
            return None

    def wait_steady(self, gap_steps: int, is_alive) -> tuple[int, int]:
        """Until rank 0 trains in a round newer than the last event's, at full world, for gap_steps steps."""
        deadline = time.monotonic() + STEADY_TIMEOUT_S
        first_step = None
        while time.monotonic() < deadline and is_alive():
            p = self.progress()
            if p is not None:
                step, world, rnd, _ = p
                if world == min(len(self.nodes), MAX_WORKERS) and rnd > self.last_round:
                    first_step = step if first_step is None else first_step
                    if step >= first_step + gap_steps:
                        return step, rnd
                else:
                    first_step = None
            time.sleep(0.02)
        raise TimeoutError(f"the ring was not steady at world {min(len(self.nodes), MAX_WORKERS)} within "
                           f"{STEADY_TIMEOUT_S} s (progress {self.progress()}); storm log: {self.log}")

    # ------------------------------------------------------------ acting
    def _arm(self, *faults: tuple[str, int]) -> list[int]:
        ids = []
        for kind, rank in faults:
            self.armed.append({"id": self.next_id, "kind": kind, "rank": rank})
            ids.append(self.next_id)
            self.next_id += 1
        tmp = self.faults.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.armed, f)
        os.replace(tmp, self.faults.path)
        return ids

    def _wait_fired(self, ids: list[int], is_alive) -> None:
        deadline = time.monotonic() + STEADY_TIMEOUT_S
        while not all(os.path.exists(self.faults.marker(i)) for i in ids):
            if time.monotonic() > deadline or not is_alive():
                raise TimeoutError(f"faults {ids} did not fire within {STEADY_TIMEOUT_S} s; storm log: {self.log}")
            time.sleep(0.02)

    def run(self, events: list[StormEvent], is_alive) -> None:
        for event in events:
            step, rnd = self.wait_steady(event.gap_steps, is_alive)
            self.log.append(f"{event.kind} at step {step} round {rnd} (rank {event.rank})")
            if event.kind in ("kill_in_sync", "kill_in_reform", "kill_in_join"):
                # the victim's fault first, then the SIGKILL of a helper rank that causes the re-form
                victim, = self._arm((event.kind, event.rank))
                helper, = self._arm(("sigkill", event.helper_rank))
                self._wait_fired([helper, victim], is_alive)
            elif event.kind in WORKER_FAULTS:
                self._wait_fired(self._arm((event.kind, event.rank)), is_alive)
            elif event.kind == "node_removed":
                self.cluster.remove_node(self.nodes.pop(), allow_graceful=False)
            elif event.kind == "node_drained":
                self.drain(self.cluster, self.nodes.pop(), deadline_s=120)
            else:
                self.nodes.append(self.cluster.add_node(num_cpus=1, resources={"slot": 1}))
            p = self.progress()
            self.last_round = p[2] if p else rnd
        self.wait_steady(1, is_alive)
        open(os.path.join(self.dir, "stop"), "w").close()
