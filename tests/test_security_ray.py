"""A stranger on the network attacks a running job's rendezvous store (real Ray, real sockets).

The rogue client finds every store port the driver's process opened, lists the keys, overwrites each
with a pickle whose unpickling would create a marker file, pre-writes the keys of the next rounds (the
counter-like series of the gloo rendezvous) and pushes forged pickles into the driver's message queue,
again and again while a worker is SIGKILLed and the ring re-forms. The marker never appears, and the
job either finishes with exact results or fails with a clear error, in bounded time.
"""

import datetime
import os
import pickle
import re
import threading
import time

import torch.distributed as dist

from ray_integration import ElasticTrainer, RunFailed, WorkerError
from tests import ray_jobs


class Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def listening_ports_of(pid: int) -> set[int]:
    """TCP ports that process ``pid`` listens on (from /proc: what any local user can see)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].split(":")[1], 16))
    return ports


def store_clients(ports: set[int]) -> list[dist.TCPStore]:
    """Every port that speaks the TCPStore protocol."""
    found = []
    for port in sorted(ports):
        for host in ("127.0.0.1", os.uname().nodename):
            try:
                found.append(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=1)))
                break
            except (RuntimeError, OSError):
                continue
    return found


class Rogue:
    def __init__(self, marker: str) -> None:
        self.payload = pickle.dumps(Planted(marker))
        self.stop = threading.Event()
        self.rounds = 0
        self.keys_overwritten = 0
        self.jobs: set[str] = set()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        clients: list[dist.TCPStore] = []
        while not self.stop.is_set():
            if not clients:
                clients = [c for c in store_clients(listening_ports_of(os.getpid())) if self._is_job_store(c)]
            for client in clients:
                try:
                    self.attack(client)
                except (RuntimeError, OSError):
                    continue  # the store went away with its job
            self.rounds += 1
            time.sleep(0.1)

    def _is_job_store(self, client) -> bool:
        try:
            return any(k.startswith("job-") for k in client.list_keys())
        except (RuntimeError, OSError):
            return False

    def attack(self, client) -> None:
        keys = client.list_keys()
        for key in keys:
            client.set(key, self.payload)
            self.keys_overwritten += 1
            match = re.match(r"(job-[0-9a-f]+)/round(\d+)/", key)
            if match:
                job, round_id = match.group(1), int(match.group(2))
                self.jobs.add(job)
                for ahead in range(1, 4):  # the next rounds' rendezvous keys, before their owners write them
                    for rank in range(4):
                        client.set(f"{job}/round{round_id + ahead}/gloo//0/{rank}", self.payload)
                    client.set(f"{job}/round{round_id + ahead}/nccl/unique_id", self.payload)
        for job in self.jobs:
            client.queue_push(f"{job}/driver", self.payload)
            client.queue_push(f"{job}/driver", b'{"from":"x","n":99,"k":"hb"}')


def test_rogue_client_cannot_run_code_and_cannot_hang_the_job(ray_session, tmp_path):
    marker = tmp_path / "pwned"
    rogue = Rogue(str(marker))
    rogue.thread.start()
    started = time.monotonic()
    outcome = None
    try:
        result = ElasticTrainer(min_workers=2, max_workers=3, heartbeat_timeout_s=5, max_failures=20,
                                progress=False).run(
            ray_jobs.train, config={"epochs": 4, "faults": [(1, 2, 5, "kill")], "step_delay_s": 0.05})
        outcome = result
    except (RunFailed, WorkerError) as exc:
        outcome = exc
    finally:
        rogue.stop.set()
        rogue.thread.join(10)
    elapsed = time.monotonic() - started
    assert rogue.rounds > 3 and rogue.keys_overwritten > 0 and rogue.jobs, (rogue.rounds, rogue.keys_overwritten)
    assert not marker.exists(), "forged bytes were unpickled"
    assert elapsed < 150, elapsed
    if isinstance(outcome, Exception):
        assert "authentication" in str(outcome), outcome
    else:
        assert outcome.value["identical"] and outcome.value["seen"] == [4.0] * ray_jobs.N_SAMPLES
        assert "worker_lost" in [e.kind for e in outcome.events]
