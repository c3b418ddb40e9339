"""The step as the unit: a driver notice acts at the next step boundary, without a commit of the user's
(real gloo rings, no Ray). The notice rides in the step's check, so every rank acts after the same step."""

import torch

import elastic_ring as er
from state import ElasticSampler, TorchState, TrainingStopped, membership
from state.membership import request_membership_change


def _linked(batch=2, n=60, **sampler_options):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    sampler = ElasticSampler(n, batch_size=batch, seed=1, **sampler_options)
    state = TorchState(model=model, optimizer=opt, sampler=sampler)
    return model, opt, state


def _notice_at(flag_rank, flag_step, kind):
    model, opt, state = _linked()
    state.sync()
    assert state.step_linked
    raised = None
    log_collectives = 0
    try:
        for batch in state.sampler:
            if er.rank() == flag_rank and state.sampler.step == flag_step:
                if kind == "stop":
                    membership.request_stop()
                else:
                    request_membership_change()   # what the worker runtime does when the driver says so
            x = torch.randn(len(batch), 3)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            er.allreduce(torch.ones(1), name="loss for the log")  # the loop's own collective after the step
            log_collectives += 1
            state.sampler.record_batch()
    except er.MembershipChanged:
        raised = "changed"
    except TrainingStopped:
        raised = "stopped"
    return raised, state.sampler.step, opt.applied_steps, log_collectives, state.commits


def test_a_join_notice_acts_at_the_next_step_on_every_rank(ring):
    results = ring.run(_notice_at, 1, 4, "change")
    # the notice was posted before step 5's check: every rank applied step 5 and acted before step 6's forward
    assert {r[:4] for r in results} == {("changed", 5, 5, 5)}, results
    assert {r[4] for r in results} == {0}, results  # no snapshot: the re-form hands over the live state


def test_a_stop_notice_stops_every_rank_at_the_next_step(ring):
    results = ring.run(_notice_at, 2, 2, "stop")
    assert {r[:3] for r in results} == {("stopped", 3, 3)}, results
    assert {r[4] for r in results} == {1}, results  # a stop commits (and writes that commit durably)


def _alone():
    model, opt, state = _linked()
    state.sync()
    for batch in state.sampler:
        if state.sampler.step == 3:
            request_membership_change()
        opt.zero_grad()
        model(torch.randn(len(batch), 3)).sum().backward()
        try:
            opt.step()
            state.sampler.record_batch()
            model(torch.randn(1, 3))  # the next training forward runs the boundary
        except er.MembershipChanged:
            return state.sampler.step
    return None


def test_a_ring_of_one_acts_on_its_own_notice(ring):
    assert ring.run(_alone, world_size=1) == [4]


def _no_sampler():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    state = TorchState(model=model, optimizer=opt, seen=0)   # streaming data: no ElasticSampler
    state.sync()
    assert not state.step_linked  # failures fall back to the old rule, but boundaries work
    for step in range(10):
        if er.rank() == 0 and step == 2:
            request_membership_change()
        opt.zero_grad()
        try:
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
        except er.MembershipChanged:
            return opt.applied_steps
    return None


def test_a_join_acts_at_the_next_step_without_a_sampler(ring):
    assert ring.run(_no_sampler, world_size=2) == [3, 3]
