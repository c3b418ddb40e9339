"""The chaos suite's invariant job as a script with its own local Ray, for compound faults that need real
signals to the driver process.

    python tests/scripts/compound_job.py SCENARIO CHECKPOINT_DIR CHAOS_DIR RAY_TEMP_DIR

Scenarios:
  sigterm_sigkill   at step 12, SIGKILL rank 1's process and SIGTERM this driver at the same moment
  sigterm_at_join   SIGKILL rank 2 at step 6; when its replacement is ready to join (the ring is asked to
                    re-form at its next commit), SIGTERM this driver: the stop races the join's commit
  writer_error      checkpoints every 2 commits; at step 15 the state becomes unsavable (the next writes
                    fail), and at step 24 this driver gets SIGTERM: its final checkpoint fails too
  finish            train to the first epoch end (the stop file is written first) and print the result

The time of the SIGTERM goes to CHAOS_DIR/signaled. The ``finish`` run prints ``RESULT {json}``. A stopped
run prints ``STOPPED {json}`` and exits 0 after a clean stop (its final checkpoint written), 1 after a forced
stop or when its final checkpoint could not be written (the tests' contract, not a recommendation: examples/cluster/train.py exits
75 for a clean stop, so that a job runner retries it).
"""

import json
import os
import pathlib
import signal
import sys
import time

import logging

import ray

logging.basicConfig(level=logging.INFO if "ER_DEBUG" in __import__("os").environ else logging.WARNING)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ray_integration import ElasticTrainer  # noqa: E402
from tests.chaos import invariant_job  # noqa: E402

scenario, checkpoint_dir, chaos_dir, ray_temp_dir = sys.argv[1:5]
chaos = pathlib.Path(chaos_dir)
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir,
         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


def signal_self() -> None:
    (chaos / "signaled").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGTERM)


def on_report(record: dict) -> None:
    step = record.get("step", 0)
    if scenario == "sigterm_sigkill" and step >= 12 and not (chaos / "signaled").exists():
        os.kill(int((chaos / "pid-rank1").read_text()), signal.SIGKILL)
        signal_self()
    if scenario == "writer_error" and step >= 15:
        (chaos / "unsavable").touch()
        if step >= 24 and not (chaos / "signaled").exists():
            signal_self()


def on_event(event) -> None:
    if scenario == "sigterm_at_join" and event.kind == "membership_change_requested" and \
            not (chaos / "signaled").exists():
        signal_self()


if scenario == "sigterm_at_join":
    (chaos / "faults.json").write_text(json.dumps([{"id": 1, "kind": "sigkill", "rank": 2}]))
if scenario == "finish":
    (chaos / "stop").touch()
writer = scenario == "writer_error"
job = {"chaos_dir": chaos_dir, "commit_every": 3, "step_delay_s": 0.05}
if writer:
    job["flaky_flag"] = str(chaos / "unsavable")
result = ElasticTrainer(min_workers=2, max_workers=3, checkpoint_uri=checkpoint_dir,
                        checkpoint_every_n_commits=2 if writer else 1000, trusted_checkpoints=writer,
                        heartbeat_timeout_s=5, progress=False).run(
    invariant_job.train, config=job, on_report=on_report, on_event=on_event)
if result.stopped:
    print("STOPPED " + json.dumps({"forced": result.forced, "stop_reason": result.stop_reason,
                                   "checkpoint": result.checkpoint_uri, "checkpoint_error": result.checkpoint_error,
                                   "events": [e.kind for e in result.events]}), flush=True)
    sys.exit(1 if result.forced or result.checkpoint_error is not None else 0)
print("RESULT " + json.dumps({"exact": result.value["exact"], "identical": result.value["identical"],
                              "seen": result.value["seen"], "epochs": result.value["epochs"],
                              "step": result.value["step"],
                              "events": [e.kind for e in result.events]}), flush=True)
