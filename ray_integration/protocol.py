"""What the driver and the workers say to each other through the rendezvous TCP store.

The store lives in the driver's process. All key names are made here, so the
two sides cannot drift apart:

* ``waiting``: a worker asks for its next ring: ``"<generation>:<reason>"``,
  reason ``start``, ``failure`` or ``membership``;
* ``ring``: the driver's answer for that generation: a pickled ``RingSpec``,
  or ``STOP`` when the job is over for this worker;
* ``heartbeat``: the worker's wall-clock time, refreshed by a thread;
* ``synced``: set once the worker completed a sync (it holds the ring's
  committed state from then on, so it may be the next ring's root);
* ``metrics``: rank 0's ``er.report`` records, numbered from 1;
* ``resumed``: the checkpoint info, when rank 0 resumed the job from a checkpoint;
* ``timeline``: batches of a worker's timeline events, numbered from 1
  (only with ``ElasticTrainer(timeline_path=...)``).
"""

from __future__ import annotations

STOP = b"STOP"


class Keys:
    def __init__(self, job_id: str) -> None:
        self.job = job_id

    def waiting(self, worker_id: str) -> str:
        return f"{self.job}/w/{worker_id}/waiting"

    def ring(self, worker_id: str, generation: int) -> str:
        return f"{self.job}/w/{worker_id}/ring/{generation}"

    def synced(self, worker_id: str) -> str:
        return f"{self.job}/w/{worker_id}/synced"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.job}/w/{worker_id}/heartbeat"

    @property
    def metrics_count(self) -> str:
        return f"{self.job}/metrics/count"

    def metric(self, index: int) -> str:
        return f"{self.job}/metrics/{index}"

    @property
    def timeline_count(self) -> str:
        return f"{self.job}/timeline/count"

    def timeline(self, index: int) -> str:
        return f"{self.job}/timeline/{index}"

    @property
    def resumed(self) -> str:
        return f"{self.job}/resumed"


def parse_waiting(value: bytes) -> tuple[int, str]:
    generation, reason = value.decode().split(":", 1)
    return int(generation), reason
