"""RingSpec: validation messages and the local rank/size derived from node ids (pure, no processes)."""

import pytest

import elastic_ring as er

STORE = er.StoreAddress("127.0.0.1", 29500)


def spec(**kw):
    base = dict(round_id=1, rank=0, world_size=4, node_ids=("a", "a", "b", "b"), store=STORE)
    base.update(kw)
    return er.RingSpec(**base)


@pytest.mark.parametrize(
    "node_ids, rank, local_rank, local_size",
    [
        (("a", "a", "b", "b"), 0, 0, 2),
        (("a", "a", "b", "b"), 1, 1, 2),
        (("a", "a", "b", "b"), 2, 0, 2),
        (("a", "a", "b", "b"), 3, 1, 2),
        (("a", "b", "c", "d"), 3, 0, 1),
        (("a", "a", "a", "b"), 2, 2, 3),
        (("a", "b", "a", "b"), 2, 1, 2),
    ],
)
def test_local_rank_and_size_follow_node_ids(node_ids, rank, local_rank, local_size):
    s = spec(node_ids=node_ids, rank=rank)
    assert (s.local_rank, s.local_size) == (local_rank, local_size)
    assert s.node_id == node_ids[rank]


def test_store_prefix_is_job_and_round_scoped():
    assert spec(round_id=7, job_id="jobA").store_prefix == "jobA/round7/"
    assert spec(round_id=7).identity == "rank 0/4 round 7"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(rank=4), "rank"),
        (dict(rank=-1), "rank"),
        (dict(world_size=0, node_ids=()), "world_size"),
        (dict(node_ids=("a", "b")), "node_ids"),
        (dict(node_ids=["a", "a", "b", "b"]), "node_ids"),
        (dict(backend="mpi"), "backend"),
        (dict(round_id=-1), "round_id"),
        (dict(collective_timeout_s=0), "collective_timeout_s"),
        (dict(connect_timeout_s=-2), "connect_timeout_s"),
        (dict(job_id="a/b"), "job_id"),
        (dict(store=("127.0.0.1", 1)), "store"),
        (dict(cuda_device=-1), "cuda_device"),
    ],
)
def test_invalid_spec_names_the_field_and_value(overrides, field):
    with pytest.raises(ValueError, match=rf"RingSpec\.{field}="):
        spec(**overrides)


@pytest.mark.parametrize("host, port", [("", 1), ("h", 0), ("h", 70000)])
def test_invalid_store_address(host, port):
    with pytest.raises(ValueError, match="StoreAddress"):
        er.StoreAddress(host, port)


def test_collectives_before_init_say_how_to_fix():
    er.shutdown()
    with pytest.raises(er.NotInitializedError, match="elastic_ring.init"):
        er.rank()
    with pytest.raises(er.NotInitializedError):
        er.allreduce(__import__("torch").ones(1))


def test_reduce_op_parse():
    assert er.ReduceOp.parse("sum") is er.Sum
    assert er.ReduceOp.parse(er.Average) is er.Average
    with pytest.raises(ValueError, match="op='median'"):
        er.ReduceOp.parse("median")


# ------------------------------------------------------------ placement: the node table or a rank's own fields
def _today(node_ids, rank):
    """The placement as it was computed before specs carried their own (from the whole node table, O(n) per rank)."""
    node = node_ids[rank]
    local = [node_ids[:r].count(n) for r, n in enumerate(node_ids)]
    peers = [r for r, lr in enumerate(local) if lr == local[rank]]
    counts = [node_ids.count(n) for n in set(node_ids)]
    return er.Placement(node, local[rank], node_ids.count(node), peers.index(rank), len(peers),
                        list(dict.fromkeys(node_ids)).index(node), len(set(counts)) == 1)


LAYOUTS = {
    "uneven nodes": ("a", "a", "a", "b", "c", "c"),
    "interleaved placement": ("a", "b", "a", "c", "b", "a"),
    "one node": ("n",) * 5,
    "one worker per node": ("a", "b", "c", "d"),
    "even nodes": ("a", "a", "b", "b", "c", "c"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_placement_equals_the_one_derived_from_the_node_table(layout):
    node_ids = LAYOUTS[layout]
    table = er.placements(node_ids)
    for rank in range(len(node_ids)):
        assert table[rank] == _today(node_ids, rank), (layout, rank)
        alone = spec(world_size=len(node_ids), rank=rank, node_ids=None, **table[rank]._asdict())
        assert alone.node_ids is None and alone.placement == table[rank]
        assert spec(world_size=len(node_ids), rank=rank, node_ids=node_ids).placement == table[rank]


def test_placement_table_by_hand():
    # ranks 0-2 on a, 3 on b, 4-5 on c: local 0,1,2,0,0,1; cross of local 0 is a,b,c; of local 1 a,c; of 2 a
    table = er.placements(("a", "a", "a", "b", "c", "c"))
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size, p.node_rank) for p in table] == [
        (0, 3, 0, 3, 0), (1, 3, 0, 2, 0), (2, 3, 0, 1, 0), (0, 1, 1, 3, 1), (0, 2, 2, 3, 2), (1, 2, 1, 2, 2)]
    assert not table[0].homogeneous and er.placements(("a", "b", "a", "b"))[3].homogeneous


def test_spec_without_node_ids_is_o1_on_the_wire_and_round_trips():
    place = er.placements(("x" * 56,) * 1024)[1000]
    s = er.RingSpec(round_id=3, rank=1000, world_size=1024, store=STORE, **place._asdict())
    wire = s.to_wire()
    assert "node_ids" not in wire and wire["local_rank"] == 1000 and len(str(wire)) < 600
    assert er.RingSpec.from_wire(wire, None) == s
    positional = er.RingSpec(1, 0, 2, ("a", "b"), STORE)  # node_ids and store keep their positions
    assert (positional.node_id, positional.cross_size) == ("a", 2)
    assert er.RingSpec.from_wire(positional.to_wire(), None) == positional


def test_spec_without_any_placement_forms_but_local_calls_say_how_to_fix():
    s = er.RingSpec(round_id=1, rank=0, world_size=2, store=STORE)
    with pytest.raises(ValueError, match="has no placement: give it node_ids"):
        s.placement


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(node_id="a", local_rank=0), r"placement \['node_id', 'local_rank'\] without \['local_size'"),
        (dict(node_id=""), r"RingSpec\.node_id=''"),
        (dict(local_rank=2, local_size=2), r"RingSpec\.local_rank=2 must be an int >= 0 and <= 1"),
        (dict(local_size=5), r"RingSpec\.local_size=5 must be an int >= 1 and <= 4"),
        (dict(cross_rank=1, cross_size=1), r"RingSpec\.cross_rank=1"),
        (dict(node_rank=4), r"RingSpec\.node_rank=4"),
        (dict(homogeneous=1), r"RingSpec\.homogeneous=1 must be True or False"),
        (dict(store=None), r"RingSpec\.store=None must be a StoreAddress"),
    ],
)
def test_invalid_placement_names_the_field(overrides, message):
    fields = dict(er.placements(("a", "a", "b", "b"))[0]._asdict(), node_ids=None)
    fields.update(overrides)
    if "local_rank" in overrides and "local_size" not in overrides and "node_id" in overrides:
        fields = {k: v for k, v in fields.items() if k in ("node_ids", "node_id", "local_rank")}
    with pytest.raises(ValueError, match=message):
        spec(**fields)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_ranks_spec_built_from_one_equals_the_one_built_and_checked_alone(layout):
    """The driver builds a ring's answers with RingSpec.for_each_rank (one full check, not one per rank: 20 ->
    3 ms at 1,024 ranks); each must be the spec RingSpec(...) builds and validates for that rank."""
    node_ids, places = LAYOUTS[layout], er.placements(LAYOUTS[layout])
    hosts = [f"10.0.0.{r}" if r % 2 else None for r in range(len(node_ids))]
    common = dict(round_id=4, world_size=len(node_ids), store=STORE, job_id="job-a", auth_key=b"k" * 32,
                  parent_round=3, parent_ranks=tuple(range(len(node_ids) - 1)) + (-1,), nccl_reform="shrink_grow")
    first = er.RingSpec(rank=2, bind_host="h", **places[2]._asdict(), **common)
    built = first.for_each_rank(places, hosts)
    for rank, one in enumerate(built):
        alone = er.RingSpec(rank=rank, bind_host=hosts[rank], **places[rank]._asdict(), **common)
        assert one == alone and one.auth_key == alone.auth_key and one.placement == places[rank], (layout, rank)
        assert one.to_wire() == alone.to_wire() and hash(one) == hash(alone)
    assert first.rank == 2 and first.bind_host == "h"  # the spec it was built from is unchanged


@pytest.mark.parametrize("places, hosts, message", [
    (er.placements(("a", "b")), [None], r"2 placements and 1 bind hosts for a ring of world_size=2"),
    (er.placements(("a",)), [None], r"1 placements and 1 bind hosts for a ring of world_size=2"),
    ([er.placements(("a", "b"))[0], (0, 1)], [None, None], r"rank 1's placement \(0, 1\) is not a Placement"),
    (er.placements(("a", "b")), [None, ""], r"rank 1's bind_host='' must be None or an address"),
    ([er.placements(("a", "b"))[0], er.Placement("", 0, 1, 1, 2, 1, True)], [None, None], r"rank 1's placement"),
    ([er.placements(("a", "b"))[0], er.Placement("b", 0, 1, 2, 2, 1, True)], [None, None], r"rank 1's placement"),
    ([er.placements(("a", "b"))[0], er.Placement("b", 0, 1, 1, 2, 2, True)], [None, None], r"rank 1's placement"),
    ([er.placements(("a", "b"))[0], er.Placement("b", 0, 1, 1, 2, 1, 1)], [None, None], r"rank 1's placement"),
    ([er.placements(("a", "b"))[0], er.Placement("b", 0.0, 1, 1, 2, 1, True)], [None, None], r"rank 1's placement"),
])
def test_every_ranks_spec_rejects_what_does_not_fit_the_ring(places, hosts, message):
    first = er.RingSpec(round_id=1, rank=0, world_size=2, store=STORE, **er.placements(("a", "b"))[0]._asdict())
    with pytest.raises(ValueError, match=message):
        first.for_each_rank(places, hosts)
    with pytest.raises(ValueError, match="has node_ids"):
        er.RingSpec(round_id=1, rank=0, world_size=2, store=STORE, node_ids=("a", "b")).for_each_rank(places, hosts)
