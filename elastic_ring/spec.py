"""The ring spec: everything one rank needs to form the communicator of one round.

A *round* is one incarnation of the ring. Every membership change makes a new
round with a new, larger ``round_id``; its keys in the rendezvous store are
prefixed with the job and round, so rounds never collide and a process can
leave one round and join the next without restarting.

The spec is a plain, picklable, self-validating value. Who computes it (the Ray
driver, a test harness, a user's launcher) is not this module's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import COLLECTIVE_TIMEOUT_S, CONNECT_TIMEOUT_S

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous TCP store listens (it lives in a long-lived process)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"StoreAddress.host={self.host!r} must be a non-empty host name or IP")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"StoreAddress.port={self.port!r} must be a TCP port in 1..65535")


@dataclass(frozen=True)
class RingSpec:
    """One rank's view of one round of the ring.

    Attributes:
        round_id: id of this round; strictly increasing over a job's rounds.
        rank: this process's rank in the round, ``0 <= rank < world_size``.
        world_size: number of ranks in the round.
        node_ids: the node of each rank, indexed by rank; gives local rank/size.
        store: the rendezvous TCP store.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, via cupy).
        job_id: namespace of the job's keys in the store.
        collective_timeout_s: a collective that takes longer raises CommError.
        connect_timeout_s: forming the communicator that takes longer raises CommError.
        bind_host: address gloo binds and advertises (None: resolve the host name).
        cuda_device: CUDA device index for NCCL (None: torch's current device).
    """

    round_id: int
    rank: int
    world_size: int
    node_ids: tuple[str, ...]
    store: StoreAddress
    backend: str = "gloo"
    job_id: str = "elastic_ring"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    bind_host: str | None = None
    cuda_device: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, int) or self.round_id < 0:
            raise ValueError(f"RingSpec.round_id={self.round_id!r} must be an int >= 0")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"RingSpec.world_size={self.world_size!r} must be an int >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"RingSpec.rank={self.rank!r} must be an int in 0..world_size-1 ({self.world_size - 1})")
        if not isinstance(self.node_ids, tuple) or len(self.node_ids) != self.world_size:
            raise ValueError(
                f"RingSpec.node_ids={self.node_ids!r} must be a tuple with one node id per rank "
                f"(world_size={self.world_size})"
            )
        if not isinstance(self.store, StoreAddress):
            raise ValueError(f"RingSpec.store={self.store!r} must be a StoreAddress(host, port)")
        if self.backend not in BACKENDS:
            raise ValueError(f"RingSpec.backend={self.backend!r} is unknown; use one of {BACKENDS}")
        if not self.job_id or "/" in self.job_id:
            raise ValueError(f"RingSpec.job_id={self.job_id!r} must be non-empty and contain no '/'")
        for name in ("collective_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"RingSpec.{name}={value!r} must be a number of seconds > 0")
        if self.cuda_device is not None and (not isinstance(self.cuda_device, int) or self.cuda_device < 0):
            raise ValueError(f"RingSpec.cuda_device={self.cuda_device!r} must be None or a device index >= 0")

    @property
    def node_id(self) -> str:
        return self.node_ids[self.rank]

    @property
    def local_rank(self) -> int:
        """Rank among the ranks on this node, in rank order."""
        return self.node_ids[: self.rank].count(self.node_id)

    @property
    def local_size(self) -> int:
        """Number of ranks on this node."""
        return self.node_ids.count(self.node_id)

    @property
    def store_prefix(self) -> str:
        """Key prefix of this round in the rendezvous store."""
        return f"{self.job_id}/round{self.round_id}/"

    @property
    def identity(self) -> str:
        """``rank 2/4 round 7``: the identity every log line carries."""
        return f"rank {self.rank}/{self.world_size} round {self.round_id}"
