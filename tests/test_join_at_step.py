"""A loop that logs its loss with an allreduce every step and commits only at epoch ends (real Ray):
a SIGKILL between the step and the loss allreduce redoes no step, and the replacement joins at the next
step boundary, not at the next commit (which is an epoch away).

The join is bounded in steps, counted where the notice lands: rank 0 says in every step's report whether
it holds the driver's re-form notice. The notice rides in the agreement of the step in flight (or, when
it lands after that step's last bucket was sent, of the next one), and the ring re-forms right after that
step: at most 2 of rank 0's steps in the old ring can report it. This bound does not depend on how long
Ray takes to deliver the notice, so a loaded machine cannot break it (nor make a commit-time join pass).
"""

import elastic_ring as er
from ray_integration import ElasticTrainer
from state import membership
from tests import ray_jobs

KILL = (1, 1, 6)  # (round, rank, step): rank 1 of the first ring, right after its 6th applied step


def train_reporting_notices(config: dict):
    """``ray_jobs.train_loss_logged``, whose reports also say whether this rank holds a re-form notice."""
    report = er.report

    def report_with_notice(**metrics):
        report(notice=membership.membership_change_requested(), **metrics)

    er.report = report_with_notice
    try:
        return ray_jobs.train_loss_logged(config)
    finally:
        er.report = report


def test_a_kill_after_the_step_redoes_nothing_and_the_replacement_joins_at_the_next_step(ray_session):
    epochs, samples, batch = 2, 480, 2
    result = ElasticTrainer(min_workers=2, max_workers=3, progress=False).run(
        train_reporting_notices,
        config={"epochs": epochs, "samples": samples, "batch": batch, "kill": KILL, "step_delay_s": 0.05})
    assert result.value["identical"], "ranks of the final ring hold identical parameters"
    assert result.value["seen"] == [float(epochs)] * samples, "every sample exactly once per epoch"
    kinds = [e.kind for e in result.events]
    assert kinds[:4] == ["ring_formed", "worker_lost", "ring_formed", "recovered"], kinds
    steps = [m for m in result.metrics_history if "position" in m]  # rank 0's reports, one per applied step
    # 0 steps redone: the victim was killed after applying step 6, so had every survivor applied it too,
    # and the ring after the failure trains step 7 first (a report follows the loss allreduce, so step 6
    # itself was never reported: the survivors' allreduce of its loss is what failed)
    after_kill = [m["step"] for m in steps if m["round"] == KILL[0] + 1]
    assert after_kill and after_kill[0] == KILL[2] + 1, [(m["round"], m["step"]) for m in steps[:12]]

    joined = [e for e in result.events if e.kind == "worker_joined"]
    assert joined, kinds
    join_round = joined[0].round_id
    old_ring = [m for m in steps if m["round"] == join_round - 1]
    first = [m for m in steps if m["round"] == join_round]
    assert old_ring and first, "the rings before and with the joiner trained"
    # the join happened mid-epoch (no commit there: commits are only at epoch ends)
    assert 0 < first[0]["position"] < samples, first[0]
    # the old ring went on while the joiner started (no pause for it), then re-formed within 2 steps of the
    # notice landing on rank 0, and the new ring trained the very next step
    noticed = [m["step"] for m in old_ring if m["notice"]]
    assert len(noticed) <= 2 and noticed == [m["step"] for m in old_ring[len(old_ring) - len(noticed):]], noticed
    assert first[0]["step"] == old_ring[-1]["step"] + 1, (old_ring[-3:], first[:2])
    assert not any(m["notice"] for m in first), "the re-form consumed the notice"
    assert joined[0].detail["waited_s"] is not None, joined[0].detail
