"""Zero lost steps without per-step commits (real gloo rings, the real elastic loop, no Ray).

The job is the chaos suite's closed form: ``w`` trained with SGD (lr 1) on gradients *summed* over the
ring, sample ``i`` contributing the integer vector ``v(i)``, so ``w == -epochs * sum_i v(i)`` bit for
bit iff every sample is applied exactly once per epoch. Each sample's hit count rides in the same
reduction (a second parameter whose gradient is the batch's hits), so the step's bookkeeping is atomic
with its update. Commits happen only at epoch ends. Each scenario injects one failure at step K and
measures the steps redone: the last step a rank completed before the failure, minus the step the ring
restarted from.

* ``reduction``: a rank dies at the start of step K; the survivors fail inside the gradient reduction,
  keep their live state and redo nothing.
* ``split``: the ring breaks after some ranks completed step K's reduction and applied it while another
  did not (it gives up right after its reduction, before applying): the ring converges on the applied
  state of the ranks that got furthest, nothing is redone, nothing is applied twice.
* ``loss_log``: the loop allreduces its loss for logging after ``optimizer.step()`` and before
  ``record_batch()`` (the usual progress log); a rank dies between the two. The sampler advanced with
  the apply (the state links them), so every survivor is whole: nothing is redone, nothing repeated.
* ``flag``: the loop allreduces a "have a batch" flag before every step; a rank dies before it: the
  step in flight had not started, nothing is redone.
* ``unlinked``: the state holds no DistributedOptimizer (the sampler cannot advance with the apply),
  and the job counts hits with a collective of its own after ``optimizer.step()``; a rank dies between
  the step and that collective: no rank's live state can be trusted, the ring rolls back to the last
  commit (the documented fallback) and the result is still exact.
"""

import os
import signal
import uuid

import torch

import elastic_ring as er
from elastic_ring.ring import runtime
from state import ElasticSampler, TorchState
from tests.chaos.invariant_job import DIM, N_SAMPLES, expected_w, sample_vector
from tests.local_rendezvous import StoreRendezvous

EPOCHS, BATCH, K = 4, 2, 19


def _job(host, port, job, scenario, worlds):
    """``worlds``: the world size of each re-form (the harness formed the first ring)."""
    er.elastic.set_rendezvous(StoreRendezvous(host, port, job, worlds=worlds))
    first_rank = er.rank()
    vectors = torch.stack([sample_vector(i) for i in range(N_SAMPLES)])
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
    holder.count = torch.nn.Parameter(torch.zeros(N_SAMPLES, dtype=torch.float64))  # -hits, reduced with w
    opt = er.DistributedOptimizer(torch.optim.SGD(holder.parameters(), lr=1.0), holder.named_parameters(), op=er.Sum)
    state = TorchState(model=holder, optimizer=None if scenario == "unlinked" else opt,
                       sampler=ElasticSampler(N_SAMPLES, batch_size=BATCH, seed=7),
                       epoch=0, seen=torch.zeros(N_SAMPLES, dtype=torch.float64))
    assert state.step_linked == (scenario != "unlinked")
    log = []  # (ring, step) after each completed step; ring: how many re-forms this process went through
    reforms = [0]
    state.register_reset_callbacks([lambda: reforms.__setitem__(0, reforms[0] + 1)])

    @er.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            for batch in state.sampler:
                at_k = state.sampler.step + 1 == K and reforms[0] == 0
                if at_k and scenario in ("reduction", "flag") and first_rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                if scenario == "flag":
                    er.allreduce(torch.ones(1), op=er.Sum, name="have a batch")
                idx = torch.tensor(batch, dtype=torch.long)
                hits = torch.zeros(N_SAMPLES, dtype=torch.float64)
                hits[idx] += 1
                opt.zero_grad()
                ((holder.w * vectors[idx].sum(0)).sum() + (holder.count * hits).sum()).backward()
                if at_k and scenario == "split" and first_rank == 1:
                    opt.synchronize()                  # the reduction completes everywhere ...
                    runtime.current().abort()       # ... then this rank's ring breaks before it applies
                    exc = er.CommError("injected: the ring broke after the reduction, before the apply")
                    exc.live_state_consistent = True
                    raise exc
                opt.step()
                if at_k and scenario in ("unlinked", "loss_log") and first_rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)  # after the update, before the loop's own collective
                if scenario == "unlinked":
                    state.seen = state.seen + er.allreduce(hits, op=er.Sum)
                if scenario == "loss_log":
                    er.allreduce(holder.w.detach().sum().reshape(1), name="loss for the log")
                state.sampler.record_batch()
                log.append((reforms[0], state.sampler.step))
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.sampler.step

    steps = loop(state)
    seen = state.seen if scenario == "unlinked" else -holder.count.detach()
    every = er.allgather_object(holder.w.detach().clone())
    return dict(steps=steps, log=log, first_rank=first_rank, exact=torch.equal(holder.w.detach(), expected_w(EPOCHS)),
                identical=all(torch.equal(every[0], w) for w in every), seen=seen.tolist(), world=er.size())


def redone(log):
    """Steps this rank completed before the failure that the ring then trained again."""
    before = [s for r, s in log if r == 0]
    after = [s for r, s in log if r > 0]
    return max(before) - (min(after) - 1)


def run(ring, scenario, worlds):
    job = f"live-{scenario}-{uuid.uuid4().hex[:6]}"
    results = ring.start(_job, "127.0.0.1", ring.address.port, job, scenario, worlds).results(
        timeout_s=120, raise_errors=False)
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == worlds[-1], results
    for r in survivors:
        assert r["exact"] and r["identical"], r
        assert r["seen"] == [float(EPOCHS)] * N_SAMPLES
    return survivors


def test_a_death_in_the_gradient_reduction_redoes_no_step(ring):
    survivors = run(ring, "reduction", [2])
    assert [redone(r["log"]) for r in survivors] == [0, 0]


def test_a_ring_broken_between_reduction_and_apply_converges_on_the_applied_state(ring):
    survivors = run(ring, "split", [3])
    by_rank = {r["first_rank"]: redone(r["log"]) for r in survivors}
    # ranks 0 and 2 applied step K and go on from it; rank 1 never completed it and receives it
    assert by_rank[0] == 0 and by_rank[2] == 0 and by_rank[1] == -1, by_rank


def test_a_death_before_a_loss_allreduce_after_the_step_redoes_nothing(ring):
    survivors = run(ring, "loss_log", [2])
    # every survivor applied step K (its sampler advanced with it) and goes on from there
    assert [redone(r["log"]) for r in survivors] == [-1, -1]


def test_a_death_before_a_have_a_batch_flag_redoes_nothing(ring):
    survivors = run(ring, "flag", [2])
    assert [redone(r["log"]) for r in survivors] == [0, 0]


def test_a_death_in_a_user_collective_of_an_unlinked_state_falls_back_to_the_last_commit(ring):
    survivors = run(ring, "unlinked", [2])
    # the last commit was at the end of epoch 2 (step 16 at world 3); K-1 = 18 steps were complete
    assert [redone(r["log"]) for r in survivors] == [K - 1 - 16] * 2
