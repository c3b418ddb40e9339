"""The ring spec: everything one rank needs to form the communicator of one round.

A *round* is one incarnation of the ring. Every membership change makes a new
round with a new, larger ``round_id``; its keys in the rendezvous store are
prefixed with the job and round, so rounds never collide and a process can
leave one round and join the next without restarting.

The spec is a plain, picklable, self-validating value. Who computes it (the Ray
driver, a test harness, a user's launcher) is not this module's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .auth import check_secret
from .constants import COLLECTIVE_TIMEOUT_S, CONNECT_TIMEOUT_S
from .validation import check_int, check_number

BACKENDS = ("gloo", "nccl")
#: How an NCCL ring re-forms: a full init every round, or shrink/grow of the previous communicator where possible.
NCCL_REFORMS = ("init", "shrink_grow")


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous TCP store listens (it lives in a long-lived process)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"StoreAddress.host={self.host!r} must be a non-empty host name or IP")
        check_int("StoreAddress.", "port", self.port, minimum=1, maximum=65535, hint="a TCP port")


@dataclass(frozen=True)
class RingSpec:
    """One rank's view of one round of the ring.

    Attributes:
        round_id: id of this round; strictly increasing over a job's rounds.
        rank: this process's rank in the round, ``0 <= rank < world_size``.
        world_size: number of ranks in the round.
        node_ids: the node of each rank, indexed by rank; gives local rank/size.
        store: the rendezvous TCP store.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, NCCL).
        job_id: namespace of the job's keys in the store.
        collective_timeout_s: a collective that takes longer raises CommError.
        connect_timeout_s: forming the communicator that takes longer raises CommError.
        bind_host: address gloo binds and advertises (None: resolve the host name).
        cuda_device: CUDA device index for NCCL (None: torch's current device).
        auth_key: the job's secret (at least 16 bytes, the same on every rank). Every store
            value and object-collective payload is authenticated with it (see
            :mod:`elastic_ring.core.auth`). It is never sent anywhere: :meth:`to_wire` leaves it
            out, and :meth:`from_wire` takes it from the receiver. Required by :func:`init`.
        nccl_reform: ``"init"`` (every round is a full NCCL init) or ``"shrink_grow"`` (a round that
            only drops ranks of ``parent_round``, or only adds ranks after them, is derived from that
            round's communicator by ``ncclCommShrink`` / ``ncclCommGrow``; see :mod:`elastic_ring.backends.nccl.reform`).
            Ignored by gloo.
        parent_round: the previous round whose members this round keeps (None: no parent).
        parent_ranks: for each rank of this round, its rank in ``parent_round``, or -1 for a newcomer.
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
    auth_key: bytes | None = field(default=None, repr=False, compare=False)
    nccl_reform: str = "init"
    parent_round: int | None = None
    parent_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_int("RingSpec.", "round_id", self.round_id, minimum=0)
        check_int("RingSpec.", "world_size", self.world_size, minimum=1)
        check_int("RingSpec.", "rank", self.rank, minimum=0, maximum=self.world_size - 1)
        if not isinstance(self.node_ids, tuple) or len(self.node_ids) != self.world_size or \
                not all(isinstance(n, str) and n for n in self.node_ids):
            raise ValueError(
                f"RingSpec.node_ids={self.node_ids!r} must be a tuple with one non-empty node id string per rank "
                f"(world_size={self.world_size})"
            )
        if not isinstance(self.store, StoreAddress):
            raise ValueError(f"RingSpec.store={self.store!r} must be a StoreAddress(host, port)")
        if self.backend not in BACKENDS:
            raise ValueError(f"RingSpec.backend={self.backend!r} is unknown; use one of {BACKENDS}")
        if not isinstance(self.job_id, str) or not self.job_id or "/" in self.job_id:
            raise ValueError(f"RingSpec.job_id={self.job_id!r} must be a non-empty string without '/'")
        for name in ("collective_timeout_s", "connect_timeout_s"):
            check_number("RingSpec.", name, getattr(self, name), unit="seconds")
        if self.bind_host is not None and (not isinstance(self.bind_host, str) or not self.bind_host):
            raise ValueError(f"RingSpec.bind_host={self.bind_host!r} must be None or an address of this machine")
        if self.cuda_device is not None:
            check_int("RingSpec.", "cuda_device", self.cuda_device, minimum=0, hint="None means torch's current device")
        if self.auth_key is not None:
            object.__setattr__(self, "auth_key", check_secret(self.auth_key, "RingSpec.auth_key"))
        self._check_parent()

    def _check_parent(self) -> None:
        if self.nccl_reform not in NCCL_REFORMS:
            raise ValueError(f"RingSpec.nccl_reform={self.nccl_reform!r} is unknown; use one of {NCCL_REFORMS}")
        if (self.parent_round is None) != (self.parent_ranks is None):
            raise ValueError(f"RingSpec.parent_round={self.parent_round!r} and parent_ranks={self.parent_ranks!r} "
                             "go together: give both (the previous round and each rank's rank in it) or neither")
        if self.parent_round is None:
            return
        check_int("RingSpec.", "parent_round", self.parent_round, minimum=0, maximum=self.round_id - 1,
                  hint="an earlier round than round_id")
        ranks = self.parent_ranks
        if not isinstance(ranks, tuple) or len(ranks) != self.world_size or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= -1 for r in ranks):
            raise ValueError(f"RingSpec.parent_ranks={ranks!r} must be a tuple of world_size={self.world_size} ints, "
                             "each a rank of parent_round or -1 for a newcomer")
        old = [r for r in ranks if r >= 0]
        if len(set(old)) != len(old):
            raise ValueError(f"RingSpec.parent_ranks={ranks!r} names a rank of parent_round twice")

    # ------------------------------------------------------------ plain encoding (no pickle)
    def to_wire(self) -> dict[str, Any]:
        """The spec as plain JSON data, without ``auth_key``."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "auth_key"}
        out["node_ids"] = list(self.node_ids)
        if self.parent_ranks is not None:
            out["parent_ranks"] = list(self.parent_ranks)
        out["store"] = {"host": self.store.host, "port": self.store.port}
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any], auth_key: bytes | None) -> "RingSpec":
        """Inverse of :meth:`to_wire`; the receiver supplies its own ``auth_key``. Validates everything."""
        if not isinstance(data, dict):
            raise ValueError(f"a ring spec must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"auth_key"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ring spec fields {unknown}")
        values = dict(data)
        store = values.get("store")
        if not isinstance(store, dict):
            raise ValueError(f"ring spec store={store!r} must be an object with host and port")
        values["store"] = StoreAddress(store.get("host"), store.get("port"))
        values["node_ids"] = tuple(values.get("node_ids") or ())
        if isinstance(values.get("parent_ranks"), list):
            values["parent_ranks"] = tuple(values["parent_ranks"])
        return cls(**values, auth_key=auth_key)

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
