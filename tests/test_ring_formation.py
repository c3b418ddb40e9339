"""The pure ring-formation rules, as tables (no Ray)."""

import pytest

from ray_integration.driver.formation import Member, form_ring


def members(*specs):
    """specs: (worker_id, node_id, joined_seq, has_state)"""
    return [Member(*s) for s in specs]


@pytest.mark.parametrize(
    "specs, expected_order",
    [
        # one node: stateful oldest first
        ([("a", "n1", 1, True), ("b", "n1", 0, True)], ["b", "a"]),
        # contiguous per node, oldest node first
        ([("a", "n2", 2, True), ("b", "n1", 0, True), ("c", "n2", 3, True), ("d", "n1", 1, True)], ["b", "d", "a", "c"]),
        # a joiner is never rank 0, even if its node is older
        ([("j", "n1", 0, False), ("s", "n2", 5, True)], ["s", "j"]),
        # joiners come after stateful members on the same node
        ([("j", "n1", 0, False), ("s", "n1", 5, True), ("t", "n2", 6, True)], ["s", "j", "t"]),
        # the first ring of a job: nobody has state, oldest first, grouped by node
        ([("a", "n2", 2, False), ("b", "n1", 1, False), ("c", "n2", 0, False)], ["c", "a", "b"]),
        # a lone survivor on a new node anchors the ring
        ([("x", "old", 0, False), ("y", "old", 1, False), ("z", "new", 9, True)], ["z", "x", "y"]),
    ],
)
def test_form_ring(specs, expected_order):
    ring = form_ring(members(*specs), round_id=7)
    assert list(ring.worker_ids) == expected_order
    assert ring.round_id == 7 and ring.world_size == len(specs)
    node_of = {s[0]: s[1] for s in specs}
    assert list(ring.node_ids) == [node_of[w] for w in expected_order]
    # contiguity: each node appears in one run
    runs = [n for i, n in enumerate(ring.node_ids) if i == 0 or ring.node_ids[i - 1] != n]
    assert len(runs) == len(set(runs))
    if any(s[3] for s in specs):
        assert dict((s[0], s[3]) for s in specs)[ring.worker_ids[0]], "rank 0 must hold committed state"


def test_rank_of_and_errors():
    ring = form_ring(members(("a", "n", 0, True), ("b", "n", 1, True)), round_id=1)
    assert ring.rank_of("b") == 1
    with pytest.raises(ValueError, match="no members"):
        form_ring([], 1)
    with pytest.raises(ValueError, match="duplicate"):
        form_ring(members(("a", "n", 0, True), ("a", "m", 1, True)), 1)
