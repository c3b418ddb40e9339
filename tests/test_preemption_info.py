"""``er.get_preemption_info()`` / ``ray_integration.train.get_preemption_info()`` (issue 32): a collective over a real
gloo ring, as Ray Train's: every rank gets the newest notice any rank holds, made into Ray Train's own
``ray.train.PreemptionInfo`` in an ElasticTrainer worker; None while no rank's node drains."""

from __future__ import annotations

import elastic_ring as er


def _agree(posted, ray_type=False):
    from elastic_ring.collectives import preemption

    preemption.install(None)
    notice = posted[er.rank()]
    if notice is not None:
        preemption.post(notice)
    info = er.get_preemption_info()
    preemption.install(None)
    if info is None:
        return None
    return type(info).__module__ + "." + type(info).__name__, info.deadline_ms, info.preempted_node_ids, \
        info.preempted_ranks


N1 = {"seq": 1, "deadline_ms": 1700000015000, "nodes": {"n1": [2]}}
N2 = {"seq": 2, "deadline_ms": 1700000009000, "nodes": {"n1": [0, 2], "n2": [1]}}
GONE = {"seq": 3, "deadline_ms": None, "nodes": {}}


def test_every_rank_gets_the_newest_notice_any_rank_holds(ring):
    assert ring.run(_agree, [None, None, None], False) == [None] * 3
    one = ring.run(_agree, [None, None, N1], False)
    assert one == [("elastic_ring.collectives.preemption.Preemption", 1700000015000, ["n1"], [2])] * 3, one
    newest = ring.run(_agree, [N1, N2, None], False)
    assert newest == [("elastic_ring.collectives.preemption.Preemption", 1700000009000, ["n1", "n2"], [0, 1, 2])] * 3
    assert ring.run(_agree, [N2, GONE, N1], False) == [None] * 3   # the leavers are gone: no preemption any more


def test_in_a_worker_it_is_ray_trains_own_preemption_info():
    import ray.train

    from elastic_ring.collectives import preemption
    from ray_integration.worker.preemption_info import preemption_info

    preemption.install(preemption_info)   # what every ElasticTrainer worker installs
    try:
        preemption.post(N2)
        info = er.get_preemption_info()
        assert type(info) is ray.train.PreemptionInfo
        assert info.preempted_node_to_ranks == {"n1": [0, 2], "n2": [1]} and info.preempted_ranks == [0, 1, 2]
    finally:
        preemption.install(None)


def test_without_ray_train_imported_it_is_elastic_rings_type_with_the_same_fields(monkeypatch):
    import sys

    from elastic_ring.collectives.preemption import Preemption
    from ray_integration.worker.preemption_info import preemption_info

    monkeypatch.delitem(sys.modules, "ray.train", raising=False)   # a script that does not use ray.train
    info = preemption_info(1700000009000, {"n2": [1], "n1": [0, 2]})
    assert type(info) is Preemption and info.preempted_node_ids == ["n1", "n2"] and info.preempted_ranks == [0, 1, 2]


def test_outside_a_ring_it_answers_this_process_notice():
    from elastic_ring.collectives import preemption
    from ray_integration.train import get_preemption_info

    preemption.install(None)
    assert get_preemption_info() is None
    preemption.post(N1)
    preemption.post({**N1, "seq": 0, "nodes": {}})  # an older notice than it holds: ignored
    info = get_preemption_info()
    assert info.preempted_ranks == [2] and info.deadline_ms == 1700000015000
    preemption.install(None)
    assert get_preemption_info() is None
