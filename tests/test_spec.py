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
