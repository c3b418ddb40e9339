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
from typing import Any, NamedTuple, Sequence

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


class Placement(NamedTuple):
    """Where one rank sits among the ring's nodes: Horovod's local and cross ranks, and the node's place.

    A worker needs only its own (seven values), never the whole node table: the Ray driver computes every rank's
    in one pass (:func:`placements`) and sends each its own.
    """

    node_id: str          # this rank's node
    local_rank: int       # its index among the ranks on its node, in rank order
    local_size: int       # how many ranks its node has
    cross_rank: int       # its node's index among the nodes that have a rank with its local rank
    cross_size: int       # how many such nodes there are
    node_rank: int        # its node's index among the ring's nodes, in order of their first rank
    homogeneous: bool     # every node has the same number of ranks (Horovod's ``is_homogeneous``)


#: RingSpec's placement fields, in order (all given, or none; ``node_ids`` gives all of them)
PLACEMENT_FIELDS = Placement._fields


def _fits(place: Any, world: int) -> bool:
    """``place`` is a Placement a ring of ``world`` ranks can hold (what ``_check_placement`` checks, in one
    expression: :meth:`RingSpec.for_each_rank` runs it once per rank)."""
    return isinstance(place, Placement) and isinstance(place.node_id, str) and bool(place.node_id) and \
        all(type(v) is int for v in place[1:6]) and type(place.homogeneous) is bool and \
        0 <= place.local_rank < place.local_size <= world and 0 <= place.cross_rank < place.cross_size <= world \
        and 0 <= place.node_rank < world


def placements(node_ids: Sequence[str]) -> list[Placement]:
    """Every rank's :class:`Placement` for the node of each rank (indexed by rank), in one O(n) pass."""
    on_node: dict[str, int] = {}
    local = []
    for node in node_ids:
        local.append(on_node.get(node, 0))
        on_node[node] = local[-1] + 1
    node_rank = {node: i for i, node in enumerate(on_node)}  # dicts keep first-insertion order
    with_local: dict[int, int] = {}
    cross = []
    for lr in local:
        cross.append(with_local.get(lr, 0))
        with_local[lr] = cross[-1] + 1
    homogeneous = len(set(on_node.values())) <= 1
    return [Placement(node, lr, on_node[node], cr, with_local[lr], node_rank[node], homogeneous)
            for node, lr, cr in zip(node_ids, local, cross)]


@dataclass(frozen=True)
class RingSpec:
    """One rank's view of one round of the ring.

    Attributes:
        round_id: id of this round; strictly increasing over a job's rounds.
        rank: this process's rank in the round, ``0 <= rank < world_size``.
        world_size: number of ranks in the round.
        node_ids: the node of each rank, indexed by rank (optional). When given, the placement fields below are
            derived from it (any given with it are replaced). The Ray driver leaves it out and sends each rank
            only its own placement, so that an answer's size does not grow with the ring.
        store: the rendezvous TCP store (required).
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
        node_id, local_rank, local_size, cross_rank, cross_size, node_rank, homogeneous: this rank's
            :class:`Placement`; all given or none, derived from ``node_ids`` when it is given. A spec with neither
            forms a ring, but :attr:`placement` (``er.local_rank()``, Horovod's local and cross calls) raises.
    """

    round_id: int
    rank: int
    world_size: int
    node_ids: tuple[str, ...] | None = None
    store: StoreAddress = None  # type: ignore[assignment]  # required: a default only to keep node_ids optional
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
    node_id: str | None = None
    local_rank: int | None = None
    local_size: int | None = None
    cross_rank: int | None = None
    cross_size: int | None = None
    node_rank: int | None = None
    homogeneous: bool | None = None

    def __post_init__(self) -> None:
        check_int("RingSpec.", "round_id", self.round_id, minimum=0)
        check_int("RingSpec.", "world_size", self.world_size, minimum=1)
        check_int("RingSpec.", "rank", self.rank, minimum=0, maximum=self.world_size - 1)
        self._check_placement()
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

    def _check_placement(self) -> None:
        if self.node_ids is not None:
            if not isinstance(self.node_ids, tuple) or len(self.node_ids) != self.world_size or \
                    not all(isinstance(n, str) and n for n in self.node_ids):
                raise ValueError(
                    f"RingSpec.node_ids={self.node_ids!r} must be None or a tuple with one non-empty node id string "
                    f"per rank (world_size={self.world_size})"
                )
            for name, value in zip(PLACEMENT_FIELDS, placements(self.node_ids)[self.rank]):
                object.__setattr__(self, name, value)
            return
        given = [name for name in PLACEMENT_FIELDS if getattr(self, name) is not None]
        if not given:
            return
        missing = [name for name in PLACEMENT_FIELDS if name not in given]
        if missing:
            raise ValueError(f"RingSpec placement {given} without {missing}: give every one of "
                             f"{list(PLACEMENT_FIELDS)}, or node_ids (one node id per rank) to derive them")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"RingSpec.node_id={self.node_id!r} must be a non-empty node id string")
        world = self.world_size
        check_int("RingSpec.", "local_size", self.local_size, minimum=1, maximum=world, hint="ranks on this node")
        check_int("RingSpec.", "local_rank", self.local_rank, minimum=0, maximum=self.local_size - 1,
                  hint="below local_size")
        check_int("RingSpec.", "cross_size", self.cross_size, minimum=1, maximum=world,
                  hint="nodes with a rank of this local rank")
        check_int("RingSpec.", "cross_rank", self.cross_rank, minimum=0, maximum=self.cross_size - 1,
                  hint="below cross_size")
        check_int("RingSpec.", "node_rank", self.node_rank, minimum=0, maximum=world - 1,
                  hint="this node's index among the ring's nodes")
        if not isinstance(self.homogeneous, bool):
            raise ValueError(f"RingSpec.homogeneous={self.homogeneous!r} must be True or False")

    def for_each_rank(self, places: Sequence[Placement], bind_hosts: Sequence[str | None]) -> list["RingSpec"]:
        """Every rank's spec of this ring, from this one (validated, of any rank, without ``node_ids``): each with
        its own ``rank``, placement (``places[rank]``, as :func:`placements` computes them) and ``bind_host``. What
        the ranks share was validated once, in this spec; each rank's own values are checked here. Building the
        answers of a ring of 1,024 costs one check, not 1,024 (a full check is 20 µs)."""
        world = self.world_size
        if self.node_ids is not None:
            raise ValueError("RingSpec.for_each_rank: this spec has node_ids (every rank derives its placement "
                             "from them); build each rank's spec with RingSpec(..., rank=r) instead")
        if len(places) != world or len(bind_hosts) != world:
            raise ValueError(f"RingSpec.for_each_rank: {len(places)} placements and {len(bind_hosts)} bind hosts "
                             f"for a ring of world_size={world}: give one of each per rank")
        shared = {f.name: getattr(self, f.name) for f in fields(self)}
        cls = type(self)
        specs = []
        for rank, (place, host) in enumerate(zip(places, bind_hosts)):
            if not _fits(place, world):
                raise ValueError(f"RingSpec.for_each_rank: rank {rank}'s placement {place!r} is not a Placement of "
                                 f"a ring of world_size={world} (use er.placements(node_ids))")
            if host is not None and (not isinstance(host, str) or not host):
                raise ValueError(f"RingSpec.for_each_rank: rank {rank}'s bind_host={host!r} must be None or an "
                                 "address of its machine")
            spec = object.__new__(cls)
            spec.__dict__.update(shared, rank=rank, bind_host=host, **place._asdict())
            specs.append(spec)
        return specs

    @property
    def placement(self) -> Placement:
        """This rank's :class:`Placement`; ValueError if the spec has none (neither node_ids nor its fields)."""
        if self.node_id is None:
            raise ValueError(f"[{self.identity}] this ring's RingSpec has no placement: give it node_ids (one node "
                             f"id per rank) or {list(PLACEMENT_FIELDS)} to use local ranks and sizes")
        return Placement(*(getattr(self, name) for name in PLACEMENT_FIELDS))

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
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name != "auth_key" and getattr(self, f.name) is not None}
        if self.node_ids is not None:
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
        for name in ("node_ids", "parent_ranks"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        return cls(**values, auth_key=auth_key)

    @property
    def store_prefix(self) -> str:
        """Key prefix of this round in the rendezvous store."""
        return f"{self.job_id}/round{self.round_id}/"

    @property
    def identity(self) -> str:
        """``rank 2/4 round 7``: the identity every log line carries."""
        return f"rank {self.rank}/{self.world_size} round {self.round_id}"
