"""A loop that logs its loss with an allreduce every step and commits only at epoch ends (real Ray):
a SIGKILL between the step and the loss allreduce redoes no step, and the replacement joins at the next
step boundary, not at the next commit (which is an epoch away)."""

from ray_integration import ElasticTrainer
from tests import ray_jobs


def redone_steps(metrics, failed_round):
    before = [m["step"] for m in metrics if m.get("round", 0) <= failed_round and "position" in m]
    after = [m["step"] for m in metrics if m.get("round", 0) > failed_round and "position" in m]
    return max(before) - (min(after) - 1)


def test_a_kill_after_the_step_redoes_nothing_and_the_replacement_joins_at_the_next_step(ray_session):
    epochs, samples, batch = 2, 480, 2
    result = ElasticTrainer(min_workers=2, max_workers=3, progress=False).run(
        ray_jobs.train_loss_logged,
        config={"epochs": epochs, "samples": samples, "batch": batch, "kill": (1, 1, 6), "step_delay_s": 0.05})
    assert result.value["identical"], "ranks of the final ring hold identical parameters"
    assert result.value["seen"] == [float(epochs)] * samples, "every sample exactly once per epoch"
    kinds = [e.kind for e in result.events]
    assert kinds[:4] == ["ring_formed", "worker_lost", "ring_formed", "recovered"], kinds
    assert redone_steps(result.metrics, 1) <= 1, result.metrics[:12]
    joined = [e for e in result.events if e.kind == "worker_joined"]
    assert joined, kinds
    join_round = joined[0].round_id
    first = [m for m in result.metrics if m.get("round") == join_round]
    assert first, "the ring with the joiner trained"
    per_epoch = samples
    # the join happened mid-epoch (no commit there: commits are only at epoch ends)
    assert 0 < first[0]["position"] < per_epoch, first[0]
    assert joined[0].detail["waited_s"] is not None and joined[0].detail["waited_s"] < 5.0, joined[0].detail
