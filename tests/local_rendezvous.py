"""A local rendezvous for tests of the elastic loop without Ray: survivors meet in the TCP store.

Generation g of the job expects ``worlds[g - 1]`` members. The k-th to arrive
becomes rank k-1 (every survivor restored the same commit, so any of them can
be rank 0). It is the test stand-in for the Ray driver.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

import elastic_ring as er
from tests.process_ring import TEST_SECRET


class StoreRendezvous:
    def __init__(self, host: str, port: int, job_id: str, worlds: list[int], timeout_s: float = 30.0) -> None:
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._address = er.StoreAddress(host, port)
        self._job, self._worlds = job_id, worlds
        self.generation = 0
        self.reasons: list[str] = []

    def next_ring(self, reason: str) -> er.RingSpec:
        self.generation += 1
        self.reasons.append(reason)
        g = self.generation
        world = self._worlds[g - 1]
        rank = self._store.add(f"{self._job}/rdzv{g}/arrivals", 1) - 1
        if rank >= world:
            raise RuntimeError(f"rendezvous generation {g} expected {world} members, {rank + 1} arrived")
        self._store.set(f"{self._job}/rdzv{g}/rank{rank}", "here")
        self._store.wait([f"{self._job}/rdzv{g}/rank{r}" for r in range(world)])
        return er.RingSpec(round_id=g, rank=rank, world_size=world, node_ids=("local",) * world,
                           store=self._address, job_id=self._job, auth_key=TEST_SECRET)
