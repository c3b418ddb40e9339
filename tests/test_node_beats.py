"""Heartbeats aggregated per node (ray_integration.worker.node_beats, ``ElasticTrainer(heartbeats="node")``): real
files in a shared directory, real processes for the leader's lock (flock), and the driver's side of ``node_hb``
(``WorkerPool.apply``: only workers on the sender's node; a counter that did not advance refreshes nobody)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import queue
import signal
import time

import pytest

from elastic_ring.core.auth import new_secret, seal_json
from elastic_ring.core.spec import StoreAddress
from elastic_ring.ring.store import StoreServer, connect
from ray_integration.config import TrainerConfig
from ray_integration.driver.mailroom import Acknowledger
from ray_integration.driver.pool import WorkerPool
from ray_integration.driver.records import WorkerRecord
from ray_integration.wire.channel import Channel
from ray_integration.wire.protocol import DRIVER, Keys, WorkerKind
from ray_integration.wire.settings import WorkerSettings
from ray_integration.worker.node_beats import STALE_INTERVALS, NodeBeats, node_directory

JOB, NODE = "job-beats", "ab" * 28
INTERVAL_S = 0.2


def _beating(root: str, secret: bytes, wid: str, out: "mp.Queue") -> None:
    """One worker process: a beat every INTERVAL_S; what it sends goes to ``out`` as (kind, sender, seqs, time)."""
    beats = NodeBeats(JOB, NODE, wid, secret, INTERVAL_S, root=root)
    seq = 0
    while True:
        seq += 1
        tick = beats.tick({"seq": seq, "synced": False, "waiting": 0, "reason": None})
        now = time.monotonic()
        if tick.direct:
            out.put(("hb", wid, {wid: seq}, now))
        if tick.forward:
            out.put(("node_hb", wid, {w: b["seq"] for w, b in tick.forward.items()}, now))
            beats.forwarded()
        time.sleep(INTERVAL_S)


class _Node:
    """Three worker processes of one node sharing ``root``."""

    def __init__(self, root: str, wids=("w0", "w1", "w2")) -> None:
        ctx = mp.get_context("fork")  # (the children only touch files)
        self.out = ctx.Queue()
        self.secret = new_secret()
        self.procs = {wid: ctx.Process(target=_beating, args=(root, self.secret, wid, self.out), daemon=True)
                      for wid in wids}
        for p in self.procs.values():
            p.start()
        self.seen: list[tuple[str, str, dict, float]] = []

    def read(self, seconds: float) -> list[tuple[str, str, dict, float]]:
        got, end = [], time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                got.append(self.out.get(timeout=left))
            except queue.Empty:
                break
        self.seen += got
        return got

    def leader(self) -> str:
        """The worker forwarding now (after its node-mates stopped beating directly)."""
        for _ in range(50):
            forwards = [m for m in self.read(3 * INTERVAL_S) if m[0] == "node_hb"]
            senders = {m[1] for m in forwards}
            if len(senders) == 1:
                return senders.pop()
        raise AssertionError(f"no single forwarder: {self.seen[-10:]}")

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(5)


@pytest.fixture
def node(tmp_path):
    made: list[_Node] = []
    yield lambda: made.append(_Node(str(tmp_path))) or made[-1]
    for n in made:
        n.close()


def test_one_worker_forwards_the_whole_node(node, tmp_path):
    n = node()
    leader = n.leader()
    steady = n.read(8 * INTERVAL_S)
    assert {m[1] for m in steady if m[0] == "node_hb"} == {leader}
    assert not [m for m in steady if m[0] == "hb"], "a node-mate beat directly while the leader forwards"
    forwards = [m[2] for m in steady if m[0] == "node_hb"]
    for wid in ("w0", "w1", "w2"):  # every worker's counter advances through the forwards
        seqs = [f[wid] for f in forwards if wid in f]
        assert len(seqs) >= 4 and seqs == sorted(seqs) and len(set(seqs)) == len(seqs), (wid, seqs)
        # (a beat written just after the leader read the files waits one interval: two in one forward, at most)
        assert all(b - a <= 2 for a, b in zip(seqs, seqs[1:])), (wid, seqs)
    directory = node_directory(JOB, NODE, str(tmp_path))
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert sorted(f for f in os.listdir(directory) if f.endswith(".beat")) == ["w0.beat", "w1.beat", "w2.beat"]


def test_a_stopped_leader_silences_its_node_mates_for_about_one_interval(node):
    n = node()
    leader = n.leader()
    last_forward = max(m[3] for m in n.seen if m[0] == "node_hb")
    os.kill(n.procs[leader].pid, signal.SIGSTOP)
    got = n.read(6 * INTERVAL_S)
    others = [w for w in n.procs if w != leader]
    for wid in others:
        direct = [m[3] for m in got if m[0] == "hb" and m[1] == wid]
        assert direct, f"{wid} did not beat directly while its leader was stopped: {got}"
        # silent at most: the stamp's age limit, plus one of its own intervals, plus scheduling slack
        assert direct[0] - last_forward < (STALE_INTERVALS + 1) * INTERVAL_S + 0.3, direct[0] - last_forward
        gaps = [b - a for a, b in zip(direct, direct[1:])]
        assert all(g < 2 * INTERVAL_S + 0.3 for g in gaps), gaps  # and then every interval
    os.kill(n.procs[leader].pid, signal.SIGCONT)  # it forwards again: the others stop beating directly
    n.read(4 * INTERVAL_S)
    again = n.read(6 * INTERVAL_S)
    assert {m[1] for m in again if m[0] == "node_hb"} == {leader}
    assert not [m for m in again if m[0] == "hb"]


def test_a_killed_leader_is_replaced_and_its_stale_beat_never_advances(node):
    n = node()
    leader = n.leader()
    last_seq = max(m[2][leader] for m in n.seen if m[0] == "node_hb" and leader in m[2])
    n.procs[leader].kill()  # SIGKILL: the kernel releases its lock
    n.procs[leader].join(5)
    got = n.read(12 * INTERVAL_S)
    forwards = [m for m in got if m[0] == "node_hb"]
    new_leaders = {m[1] for m in forwards}
    assert len(new_leaders) == 1 and leader not in new_leaders, new_leaders
    survivors = [w for w in n.procs if w != leader]
    late = forwards[len(forwards) // 2:]
    assert set().union(*(m[2] for m in late)) == set(survivors), late  # the dead one's file is no longer forwarded
    dead = [m[2][leader] for m in forwards if leader in m[2]]
    # its last file (written at most one beat after its last forward seen here) is forwarded at most once, by the
    # new leader, and never advances after that
    assert len(dead) <= 1 and all(seq <= last_seq + 1 for seq in dead), (dead, last_seq)


def test_a_forged_or_damaged_beat_file_is_ignored(tmp_path):
    secret = new_secret()
    a = NodeBeats(JOB, NODE, "a", secret, INTERVAL_S, root=str(tmp_path))
    b = NodeBeats(JOB, NODE, "b", secret, INTERVAL_S, root=str(tmp_path))
    try:
        assert a.tick({"seq": 1}).forward == {"a": {"seq": 1}}  # the first one leads
        assert b.tick({"seq": 1}).direct and not b.leader  # no stamp yet: it beats directly
        d = a.directory
        with open(os.path.join(d, "x.beat"), "w") as f:
            f.write("garbage")
        with open(os.path.join(d, "y.beat"), "w") as f:  # sealed with another secret
            f.write(seal_json(new_secret(), f"{JOB}/beat/y", {"seq": 99}))
        with open(os.path.join(d, "b.beat")) as f:  # b's genuine beat, under another worker's name
            genuine = f.read()
        with open(os.path.join(d, "z.beat"), "w") as f:
            f.write(genuine)
        b.tick({"seq": 2})
        assert a.tick({"seq": 2}).forward == {"a": {"seq": 2}, "b": {"seq": 2}}
        assert a.rejected == 3
    finally:
        a.close()
        b.close()
    assert sorted(f for f in os.listdir(a.directory) if f.endswith(".beat")) == ["x.beat", "y.beat", "z.beat"]


def test_a_dead_workers_stale_file_does_not_advance_its_counter(tmp_path):
    secret = new_secret()
    leader = NodeBeats(JOB, NODE, "a", secret, INTERVAL_S, root=str(tmp_path))
    gone = NodeBeats(JOB, NODE, "b", secret, INTERVAL_S, root=str(tmp_path))
    try:
        assert leader.tick({"seq": 1}).forward == {"a": {"seq": 1}}
        leader.forwarded()
        assert not gone.tick({"seq": 7}).direct  # the stamp is fresh: forwarded, not sent
        seen = [leader.tick({"seq": s}).forward for s in range(2, 6)]  # "b" then died: its file stays
        assert seen[0] == {"a": {"seq": 2}, "b": {"seq": 7}}
        assert all(f == {"a": {"seq": s}} for f, s in zip(seen[1:], range(3, 6))), seen
    finally:
        leader.close()
        gone.close()


def test_a_dead_workers_file_is_deleted_and_keeps_no_directory(tmp_path):
    secret = new_secret()
    leader = NodeBeats(JOB, NODE, "a", secret, INTERVAL_S, root=str(tmp_path))
    gone = NodeBeats(JOB, NODE, "b", secret, INTERVAL_S, root=str(tmp_path))
    leader.tick({"seq": 1})
    gone.tick({"seq": 1})  # then its process is killed: no close()
    dead = os.path.join(gone.directory, "b.beat")
    os.utime(dead, (time.time() - 5 * INTERVAL_S,) * 2)  # not rewritten for 5 intervals
    assert leader.tick({"seq": 2}).forward == {"a": {"seq": 2}} and not os.path.exists(dead)
    also_gone = NodeBeats(JOB, NODE, "c", secret, INTERVAL_S, root=str(tmp_path))
    also_gone.tick({"seq": 1})
    os.utime(os.path.join(leader.directory, "c.beat"), (time.time() - 5 * INTERVAL_S,) * 2)
    leader.close()  # the last live one: c's old file does not keep the directory (nor the job's)
    assert not os.path.exists(os.path.dirname(leader.directory)), os.listdir(leader.directory)


def test_a_finished_jobs_directory_left_behind_is_swept(tmp_path):
    secret = new_secret()
    old = NodeBeats("job-old", NODE, "a", secret, INTERVAL_S, root=str(tmp_path))
    old.tick({"seq": 1})  # then its process was stopped until killed: nobody cleaned up
    recent = NodeBeats("job-recent", NODE, "b", secret, INTERVAL_S, root=str(tmp_path))
    recent.tick({"seq": 1})
    long_ago = time.time() - 2 * 3600
    os.utime(old.directory, (long_ago, long_ago))
    NodeBeats(JOB, NODE, "c", secret, INTERVAL_S, root=str(tmp_path))
    assert not os.path.exists(os.path.dirname(old.directory))
    assert os.listdir(recent.directory)  # a job written to within the hour stays


def test_the_stamps_age_decides_who_beats_directly(tmp_path):
    secret = new_secret()
    leader = NodeBeats(JOB, NODE, "a", secret, INTERVAL_S, root=str(tmp_path))
    mate = NodeBeats(JOB, NODE, "b", secret, INTERVAL_S, root=str(tmp_path))
    try:
        leader.tick({"seq": 1})
        assert mate.leader_stale(time.monotonic())  # no stamp yet
        leader.forwarded()
        now = time.monotonic()
        assert not mate.leader_stale(now) and not mate.leader_stale(now + STALE_INTERVALS * INTERVAL_S - 0.01)
        assert mate.leader_stale(now + STALE_INTERVALS * INTERVAL_S + 0.01)
        assert mate.leader_stale(now - 2 * INTERVAL_S)  # a stamp from the future: clocks not shared, beat directly
        with open(os.path.join(leader.directory, "stamp"), "w") as f:  # a forged stamp keeps nobody quiet
            f.write(seal_json(new_secret(), f"{JOB}/stamp/{NODE}", {"at": time.monotonic()}))
        assert mate.leader_stale(time.monotonic())
    finally:
        leader.close()
        mate.close()


def test_separate_instances_in_one_process_exclude_each_other(tmp_path):
    secret = new_secret()
    many = [NodeBeats(JOB, NODE, f"w{i}", secret, INTERVAL_S, root=str(tmp_path)) for i in range(4)]
    try:
        for b in many:
            b.tick({"seq": 1})
        assert sum(b.leader for b in many) == 1
    finally:
        for b in many:
            b.close()
    assert not os.path.exists(many[0].directory)  # the last one out cleaned up


def test_node_directory_refuses_names_that_leave_it():
    with pytest.raises(ValueError, match="node id"):
        node_directory(JOB, "../x")


# ---------------------------------------------------------------- the driver's side
@pytest.fixture
def pool():
    server = StoreServer("127.0.0.1")
    secret = new_secret()
    config = TrainerConfig(min_workers=1, max_workers=4, progress=False)
    p = WorkerPool(config, Channel(server.store, secret, DRIVER), "127.0.0.1", server.address.port, Keys(JOB), secret,
                   None, {}, WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0))
    for wid, node_id in (("a", "n1"), ("b", "n1"), ("c", "n2")):
        p.records[wid] = WorkerRecord(wid, None, None, None, created_at=time.monotonic(),
                                      info={"worker_id": wid, "node_id": node_id}, beat_at=time.monotonic())
    yield p
    server.close()


def _node_hb(sender: str, n: int, beats: dict) -> dict:
    return {"from": sender, "n": n, "k": WorkerKind.NODE_HEARTBEAT.value, "beats": beats}


def test_a_node_heartbeat_refreshes_only_workers_on_the_senders_node(pool):
    time.sleep(0.05)
    before = {w: r.beat_at for w, r in pool.records.items()}
    pool.apply(_node_hb("a", 1, {"a": {"seq": 1}, "b": {"seq": 1}, "c": {"seq": 1}, "ghost": {"seq": 1}}))
    assert pool.records["a"].beat_at > before["a"] and pool.records["b"].beat_at > before["b"]
    assert pool.records["c"].beat_at == before["c"] and pool.records["c"].beat_seq == 0  # another node's
    assert pool.foreign_beats == 2


def test_a_forwarded_counter_that_did_not_advance_refreshes_nobody(pool):
    pool.apply(_node_hb("a", 1, {"a": {"seq": 1}, "b": {"seq": 5}}))
    b_at = pool.records["b"].beat_at
    time.sleep(0.05)
    pool.apply(_node_hb("a", 2, {"a": {"seq": 2}, "b": {"seq": 5}}))  # b died: its stale file, forwarded again
    pool.apply({"from": "b", "n": 1, "k": "hb", "seq": 4})  # an older direct beat of b's, late
    assert pool.records["b"].beat_at == b_at and pool.records["b"].beat_seq == 5
    assert pool.records["a"].beat_at > b_at


def test_a_forwarder_declared_dead_still_keeps_its_live_node_mates_heard(pool):
    """Its node-mates sent no hb of their own while its stamp was fresh: a forwarder the driver declared dead (a
    freeze longer than heartbeat_timeout_s, before Ray's kill lands) must not silence them; it refreshes nobody
    dead, itself included."""
    pool.records["a"].dead = True
    time.sleep(0.05)
    before = {w: r.beat_at for w, r in pool.records.items()}
    pool.apply(_node_hb("a", 1, {"a": {"seq": 1}, "b": {"seq": 1}}))
    assert pool.records["b"].beat_at > before["b"] and pool.records["b"].beat_seq == 1
    assert pool.records["a"].beat_at == before["a"] and pool.records["a"].beat_seq == 0
    pool.apply({"from": "a", "n": 2, "k": "hb", "seq": 2})  # a dead worker's own heartbeat still counts for nothing
    assert pool.records["a"].beat_seq == 0


def test_a_node_heartbeat_of_a_waiting_worker_notes_its_request(pool):
    assert pool.apply(_node_hb("a", 1, {"b": {"seq": 1, "waiting": 1, "reason": "start"}})) is True
    assert pool.records["b"].generation == 1 and pool.records["b"].waiting
    assert pool.apply(_node_hb("a", 2, {"b": {"seq": 2, "waiting": 1, "reason": "start"}})) is False  # not new


# ---------------------------------------------------------------- pending: at most one per worker per interval
def test_pending_goes_at_most_once_per_worker_per_interval():
    server = StoreServer("127.0.0.1")
    try:
        secret, keys = new_secret(), Keys(JOB)
        ack = Acknowledger(Channel(server.store, secret, DRIVER), keys, every_s=0.3)
        for i in range(20):  # a burst of queued heartbeats, plain and forwarded
            ack({"from": "a", "n": i, "k": "hb", "seq": i, "waiting": 3})
            ack(_node_hb("b", i, {"a": {"seq": i, "waiting": 3}, "b": {"seq": i, "waiting": 3}, "c": {"seq": i}}))
        counts = {w: server.store.queue_len(keys.worker_inbox(w)) for w in "abc"}
        assert counts == {"a": 1, "b": 1, "c": 0}, counts
        known = Acknowledger(Channel(server.store, secret, DRIVER), keys, every_s=0.3, known={"a", "b"}.__contains__)
        known(_node_hb("b", 1, {"stranger": {"seq": 1, "waiting": 3}}))  # an id no worker of the job has
        assert server.store.queue_len(keys.worker_inbox("stranger")) == 0
        time.sleep(0.35)
        ack({"from": "a", "n": 99, "k": "hb", "seq": 99, "waiting": 3})
        assert server.store.queue_len(keys.worker_inbox("a")) == 2
    finally:
        server.close()


def test_the_heartbeats_option():
    assert TrainerConfig(max_workers=8).heartbeat_mode == "worker"
    assert TrainerConfig(max_workers=64).heartbeat_mode == "node"
    assert TrainerConfig(max_workers=8, heartbeats="node").heartbeat_mode == "node"
    assert TrainerConfig(max_workers=512, heartbeats="worker").heartbeat_mode == "worker"
    with pytest.raises(ValueError, match="heartbeats='nodes' is unknown"):
        TrainerConfig(heartbeats="nodes")
    with pytest.raises(ValueError, match="heartbeats"):
        WorkerSettings(driver_silence_s=60.0, flush_timeout_s=10.0, heartbeats="auto")


def test_a_node_heartbeat_round_trip_through_the_store(pool):
    """Sealed by its sender, read by the driver's channel, applied; a forged one is dropped unread."""
    store = connect(StoreAddress("127.0.0.1", pool.store_port), 10.0)
    sender = Channel(store, pool._secret, "a")
    forger = Channel(store, new_secret(), "a")
    receive = Channel(connect(StoreAddress("127.0.0.1", pool.store_port), 10.0), pool._secret, DRIVER)
    inbox = pool.keys.driver_inbox
    forger.send(inbox, WorkerKind.NODE_HEARTBEAT.value, beats={"b": {"seq": 50}})
    sender.send(inbox, WorkerKind.NODE_HEARTBEAT.value, beats={"a": {"seq": 3}, "b": {"seq": 4}})
    msg = receive.receive(inbox, 5.0)
    assert receive.forged == 1 and msg["beats"] == {"a": {"seq": 3}, "b": {"seq": 4}}
    pool.apply(msg)
    assert (pool.records["a"].beat_seq, pool.records["b"].beat_seq) == (3, 4)


def test_a_strangers_symlinks_are_never_followed_written_through_or_swept(tmp_path):
    """The beats live under this user's private root (``elastic_ring-<uid>``, 0o700, a real directory): a symlink
    planted as an old node directory is not swept through (the files it points at stay), a symlinked job directory
    and a root open to others are refused (NodeBeats raises PermissionError: the worker then beats on its own)."""
    secret = os.urandom(32)
    root = tmp_path / "tmp"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    NodeBeats(JOB, NODE, "a", secret, INTERVAL_S, root=str(root)).close()  # makes this user's root
    user_root = pathlib.Path(node_directory(JOB, NODE, str(root))).parents[1]
    assert user_root.name == f"elastic_ring-{os.getuid()}" and (user_root.stat().st_mode & 0o777) == 0o700
    (user_root / "old-job").mkdir()
    os.symlink(victim, user_root / "old-job" / "n")  # looks like a node directory left behind an hour ago
    long_ago = time.time() - 7200
    os.utime(victim, (long_ago, long_ago))
    NodeBeats(JOB, NODE, "b", secret, INTERVAL_S, root=str(root)).close()  # its sweep runs
    assert sorted(os.listdir(victim)) == ["precious.txt"]
    os.symlink(victim, user_root / "job-link")
    with pytest.raises(PermissionError, match="symlink"):
        NodeBeats("job-link", NODE, "c", secret, INTERVAL_S, root=str(root))
    assert sorted(os.listdir(victim)) == ["precious.txt"]  # nothing written through it
    os.chmod(user_root, 0o777)
    with pytest.raises(PermissionError, match="mode 0o777"):
        NodeBeats(JOB, NODE, "d", secret, INTERVAL_S, root=str(root))
