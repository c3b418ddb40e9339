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
import threading
import time
from dataclasses import dataclass

from tests.chaos.invariant_job import FaultFile

WORKER_FAULTS = ("sigkill", "sigstop", "kill_in_commit", "kill_in_sync", "kill_in_reform", "kill_in_join",
                 "kill_in_formation")
#: Faults that need a second death (a helper rank SIGKILLed after the victim is armed) to reach their point.
COMPOUND = ("kill_in_sync", "kill_in_reform", "kill_in_join", "kill_in_formation")
NODE_EVENTS = ("node_removed", "node_drained", "node_added", "drain_all")
#: The driver's loop stalls (its on_report callback blocks for two heartbeat timeouts); the checkpoint
#: location's file system is full for a few seconds, then space returns.
OTHER_EVENTS = ("driver_stall", "storage_blip")
#: Spot reclaims (issue 32): a wave (a loss, then a notice on every node while the ring re-forms; fresh nodes come)
#: and a notice on every node with no spare capacity (the state is written just in time; the nodes go at their
#: deadline; capacity returns later and the job resumes from that write).
RECLAIM_EVENTS = ("reclaim_wave", "notice_no_spare")
#: The vocabulary before the reclaim events (the fast storms keep their seeded schedules).
CLASSIC_KINDS = WORKER_FAULTS + NODE_EVENTS + OTHER_EVENTS
ALL_KINDS = CLASSIC_KINDS + RECLAIM_EVENTS
#: The notice of ``notice_no_spare``: its nodes drain with this deadline and are removed at it.
NOTICE_S = 12
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


def schedule(seed: int, n: int, capacity: int = MAX_WORKERS, kinds: tuple[str, ...] = ALL_KINDS) -> list[StormEvent]:
    """``n`` events of ``kinds`` in a seeded order; every kind appears once before any repeats (n >= len(kinds)
    has all); removals and drains of one node only above the minimum capacity, additions only below the maximum."""
    rng = random.Random(seed)
    bag: list[str] = []
    events = []
    for _ in range(n):
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        allowed = [k for k in bag if (k not in ("node_removed", "node_drained") or capacity > MIN_CAPACITY)
                   and (k != "node_added" or capacity < MAX_WORKERS)]
        kind = allowed[0]
        bag.remove(kind)
        capacity += {"node_removed": -1, "node_drained": -1, "node_added": 1}.get(kind, 0)  # drain_all: replaced
        rank = 0 if kind == "kill_in_sync" else rng.randrange(MIN_CAPACITY)  # (reclaim_wave: the rank lost first)
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


def read_step_logs(directory: str, with_time: bool = False) -> list[tuple]:
    """Every process's ``(round, step)`` lines (``with_time``: ``(round, step, wall time)``)."""
    lines = []
    for name in os.listdir(directory):
        if name.startswith("steps-") and name.endswith(".log"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 2:
                        row = (int(parts[0]), int(parts[1]))
                        lines.append(row + (float(parts[2]),) if with_time and len(parts) > 2 else row)
    return lines


def expected_losses(events: list[StormEvent]) -> int:
    """Members lost: one per worker fault (two for the compound ones), per removed node and per reclaim wave (its
    loss); none for a drain (of one node, or of every holder at once, with or without spare capacity: the leavers
    leave before their nodes go), a driver stall or a storage blip."""
    return sum(2 if e.kind in COMPOUND else 1 if e.kind in WORKER_FAULTS or e.kind in ("node_removed", "reclaim_wave")
               else 0 for e in events)


def notice_outcomes(notices: list[tuple[float, float]], lines: list[tuple[int, int, float]]) -> list[dict]:
    """For each notice without spare capacity, ``(noticed, removed)`` wall times: the seconds the ring trained
    during the notice, and the steps the ring that resumed after it trained again."""
    out = []
    for noticed, removed in notices:
        during = [t for _, _, t in lines if noticed <= t < removed]
        before = [s for _, s, t in lines if t < removed]
        after = [(r, s) for r, s, t in lines if t >= removed]
        first_round = min((r for r, _ in after), default=None)
        first_step = min((s for r, s in after if r == first_round), default=None)
        out.append({"trained_s": round(max(during) - noticed, 1) if during else 0.0,
                    "redone": None if first_step is None or not before else max(before) - (first_step - 1)})
    return out


class StormController:
    """Runs a schedule. ``blip(seconds)`` fills the checkpoint location's file system for that long (None:
    the storm has no checkpoint location it can fill); the trainer must call :meth:`on_report` with each
    report (that is where a driver stall is made)."""

    STALL_S = 7.0  # more than two heartbeat timeouts (3 s) of the storm's trainer
    BLIP_S = 3.0

    def __init__(self, cluster, nodes: list, chaos_dir: str, drain, blip=None) -> None:
        self.cluster, self.nodes, self.dir, self.drain, self.blip = cluster, list(nodes), chaos_dir, drain, blip
        self.faults = FaultFile(chaos_dir)
        self.armed: list[dict] = []
        self.next_id = 1
        self.last_round = 0
        self.log: list[str] = []
        self.drained = 0               # nodes drained (each gives one node_draining event)
        self.to_remove: list = []      # drained nodes whose workers have left: removed once the ring is steady
        self.notices: list[tuple[float, float]] = []  # notice_no_spare: (noticed, removed) wall times
        self.stall_requested = threading.Event()
        self.stalled = threading.Event()
        self.ring_nodes: list[str] = []  # the nodes (12-hex prefixes) of the newest ring, from its ring_formed event

    def on_event(self, event) -> None:
        """The trainer's on_event: the newest ring's nodes (a drained node goes only once no member is on it)."""
        if event.kind == "ring_formed":
            self.ring_nodes = list(event.detail.get("nodes") or [])

    def _drained_nodes_in_use(self) -> bool:
        return any(node.node_id[:12] in self.ring_nodes for node in self.to_remove)

    def on_report(self, record: dict) -> None:
        """The trainer's on_report (runs on the driver's loop): blocks it once when a stall is requested."""
        if self.stall_requested.is_set() and not self.stalled.is_set():
            time.sleep(self.STALL_S)
            self.stalled.set()

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
                if world == min(len(self.nodes), MAX_WORKERS) and rnd > self.last_round and \
                        not self._drained_nodes_in_use():  # (leavers may train on until the deadline)
                    first_step = step if first_step is None else first_step
                    if step >= first_step + gap_steps:
                        while self.to_remove:  # the drained nodes' workers have left: the nodes go
                            self.cluster.remove_node(self.to_remove.pop(), allow_graceful=False)
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
            if event.kind in COMPOUND:
                # the victim's fault first, then the SIGKILL of a helper rank that causes the re-form (a death
                # in a formation is armed in the victim's process first, so that the very next formation has it)
                victim, = self._arm((event.kind, event.rank))
                if event.kind == "kill_in_formation":
                    self._wait_fired([victim], is_alive)
                helper, = self._arm(("sigkill", event.helper_rank))
                self._wait_fired([helper, victim], is_alive)
            elif event.kind in WORKER_FAULTS:
                self._wait_fired(self._arm((event.kind, event.rank)), is_alive)
            elif event.kind == "node_removed":
                self.cluster.remove_node(self.nodes.pop(), allow_graceful=False)
            elif event.kind == "node_drained":
                self.drain(self.cluster, self.nodes.pop(), deadline_s=120)
                self.drained += 1
            elif event.kind == "drain_all":  # a notice on every node that holds the state; fresh nodes are up
                old, self.nodes = self.nodes, [self.cluster.add_node(num_cpus=1, resources={"slot": 1})
                                               for _ in self.nodes]
                for node in old:
                    self.drain(self.cluster, node, deadline_s=120)
                self.drained += len(old)
                self.to_remove += old
            elif event.kind == "reclaim_wave":  # a loss, then a notice on every node while the ring re-forms
                self._wait_fired(self._arm(("sigkill", event.rank)), is_alive)
                old, self.nodes = self.nodes, [self.cluster.add_node(num_cpus=1, resources={"slot": 1})
                                               for _ in self.nodes]
                for node in old:
                    self.drain(self.cluster, node, deadline_s=120)
                self.drained += len(old)
                self.to_remove += old
            elif event.kind == "notice_no_spare":  # every node, nowhere to go: written just in time
                noticed = time.time()
                for node in self.nodes:
                    self.drain(self.cluster, node, deadline_s=NOTICE_S)
                self.drained += len(self.nodes)
                time.sleep(max(0.0, noticed + NOTICE_S - time.time()))
                for node in self.nodes:   # the nodes go at their deadline
                    self.cluster.remove_node(node, allow_graceful=False)
                self.notices.append((noticed, time.time()))
                self.nodes = [self.cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in self.nodes]
            elif event.kind == "driver_stall":
                self.stall_requested.set()
                if not self.stalled.wait(STEADY_TIMEOUT_S):
                    raise TimeoutError(f"the driver stall did not happen; storm log: {self.log}")
                self.stall_requested.clear()
                self.stalled.clear()
            elif event.kind == "storage_blip":
                if self.blip is None:
                    raise TimeoutError("a storage blip needs a checkpoint location the storm can fill")
                self.blip(self.BLIP_S)
            else:
                self.nodes.append(self.cluster.add_node(num_cpus=1, resources={"slot": 1}))
            p = self.progress()
            # the next event waits for a ring newer than this one's; a stall or a blip re-forms nothing
            self.last_round = rnd - 1 if event.kind in OTHER_EVENTS else (p[2] if p else rnd)
        self.wait_steady(1, is_alive)
        open(os.path.join(self.dir, "stop"), "w").close()
