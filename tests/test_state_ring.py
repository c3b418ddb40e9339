"""State over real processes: sync to every rank, membership agreement, and the elastic loop
surviving a SIGKILLed rank (rollback, re-form through a local rendezvous, exactly-once data)."""

import os
import signal
import uuid

import torch

import elastic_ring as er
from state import ElasticSampler, TorchState
from state.membership import request_membership_change
from tests.local_rendezvous import StoreRendezvous


def _sync_to_everyone():
    r = er.rank()
    torch.manual_seed(100 + r)  # every rank starts different
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    sampler = ElasticSampler(50, batch_size=5, seed=2)
    if r != 2:  # rank 2 plays a fresh joiner: no optimizer state, sampler at the start
        model(torch.randn(2, 5)).sum().backward()
        opt.step()
        for _ in range(r + 1):
            sampler.record_batch()
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=r, history=[r] * (r + 1))
    state.sync(root_rank=1)
    gathered = er.allgather_object((
        [p.detach() for p in model.parameters()],
        [v["exp_avg"] for v in opt.state_dict()["state"].values()],
        opt.param_groups[0]["lr"], sampler.state_dict(), state.epoch, state.history,
    ))
    ref = gathered[1]
    ok = all(
        all(torch.equal(a, b) for a, b in zip(g[0], ref[0])) and len(g[1]) == len(ref[1]) == 2
        and all(torch.equal(a, b) for a, b in zip(g[1], ref[1])) and g[2:] == ref[2:]
        for g in gathered
    )
    state.epoch = 42
    state.restore()  # sync also committed: restore goes back to the synced value
    return ok, state.epoch, ref[3]["processed"]


def test_sync_gives_every_rank_roots_state_including_a_fresh_joiner(ring):
    results = ring.run(_sync_to_everyone)
    assert results == [(True, 1, 30)] * 3  # root recorded 2 steps of 3 ranks x 5 samples


def _membership_agreement(flag_rank, flag_step):
    state = TorchState(step=0)
    raised_at = None
    for step in range(1, 8):
        state.step = step
        if er.rank() == flag_rank and step == flag_step:
            request_membership_change()  # e.g. from the worker runtime's thread
        try:
            state.commit()
        except er.MembershipChanged:
            raised_at = step
            break
    return raised_at


def test_membership_change_raises_on_every_rank_at_the_same_commit(ring):
    assert ring.run(_membership_agreement, 1, 4) == [4, 4, 4]
    assert ring.run(_membership_agreement, 1, 99) == [None, None, None]  # the flag was consumed


def _membership_change_reaches_a_joined_rank(stop: bool):
    from state import TrainingStopped
    from state.membership import request_stop

    state = TorchState(step=0)
    if er.rank() == 2:  # out of data: waits in join() while the others commit
        try:
            er.join()
        except (er.MembershipChanged, TrainingStopped) as exc:
            return type(exc).__name__
        return "join returned"
    for step in range(1, 4):
        state.step = step
        if er.rank() == 1 and step == 2:
            request_stop() if stop else request_membership_change()
        try:
            state.commit()
        except (er.MembershipChanged, TrainingStopped) as exc:
            return type(exc).__name__
    return None


def test_a_membership_change_at_a_commit_reaches_a_rank_waiting_in_join(ring):
    """The ranks with data raise MembershipChanged (TrainingStopped) at a commit; the rank waiting in er.join(),
    which answered that commit's agreement, raises the same out of join() instead of waiting for a torn ring."""
    assert ring.run(_membership_change_reaches_a_joined_rank, False) == ["MembershipChanged"] * 3
    assert ring.run(_membership_change_reaches_a_joined_rank, True) == ["TrainingStopped"] * 3


N_SAMPLES, EPOCHS, BATCH, COMMIT_EVERY = 60, 2, 2, 3


def _elastic_training(host, port, job, victim, kill_at_step):
    """Train 2 epochs with a rank SIGKILLed mid-epoch; the survivors continue from their live state and finish."""
    rendezvous = StoreRendezvous(host, port, job, worlds=[2])
    er.elastic.set_rendezvous(rendezvous)
    original_rank = er.rank()
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(N_SAMPLES, 4, generator=g), torch.randn(N_SAMPLES, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    sampler = ElasticSampler(N_SAMPLES, batch_size=BATCH, seed=3)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0, seen=torch.zeros(N_SAMPLES))
    resets = []
    state.register_reset_callbacks([lambda: resets.append(er.size())])

    @er.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            for batch in state.sampler:
                if original_rank == victim and state.step == kill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # deterministic fault, keyed on (rank, step)
                idx = torch.tensor(batch, dtype=torch.long)
                opt.zero_grad()
                ((model(xs[idx]) - ys[idx]) ** 2).sum().backward()
                opt.step()
                hits = torch.zeros(N_SAMPLES)
                hits[idx] += 1
                state.seen = state.seen + er.allreduce(hits, op=er.Sum)
                state.sampler.record_batch()
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.step

    steps = loop(state)
    params = er.allgather_object([p.detach() for p in model.parameters()])
    identical = all(torch.equal(a, b) for other in params for a, b in zip(params[0], other))
    return dict(steps=steps, seen=state.seen.tolist(), identical=identical, world=er.size(),
                resets=resets, reasons=rendezvous.reasons, pid=os.getpid())


def test_elastic_loop_survives_a_sigkilled_rank(ring):
    job = f"elastic-{uuid.uuid4().hex[:8]}"
    pending = ring.start(_elastic_training, "127.0.0.1", ring.address.port, job, 2, 7)
    pids = pending.pids
    results = pending.results(timeout_s=120, raise_errors=False)
    victim, survivors = results[2], results[:2]
    assert getattr(victim, "type_name", None) == "ProcessDied"
    for r in survivors:
        assert isinstance(r, dict), r
        assert r["identical"] and r["world"] == 2
        assert r["reasons"] == ["failure"] and r["resets"] == [2]
        # exactly once in committed work: every sample seen once per epoch, no more, no less
        assert r["seen"] == [float(EPOCHS)] * N_SAMPLES
        # 7 steps of world 3 (42 samples; the failure hit step 8's reduction, so the survivors keep their live
        # state at step 7 instead of rolling back to the step-6 commit), the epoch's 18 left over 2 ranks, then 15
        assert r["steps"] == 7 + 18 // (2 * BATCH) + N_SAMPLES // (2 * BATCH)
    assert {r["pid"] for r in survivors} == set(pids[:2])  # the survivors kept their processes
