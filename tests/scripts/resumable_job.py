"""A training script with durable checkpoints and its own local Ray, for the preemption and stop tests.

    python tests/scripts/resumable_job.py CHECKPOINT_DIR PROGRESS_FILE RAY_TEMP_DIR EPOCHS [main|thread]

``main`` (the default) calls ``run()`` on the main thread, where ElasticTrainer handles SIGTERM itself;
``thread`` calls it on another thread and wires SIGTERM to ``trainer.stop`` in the main thread (what
docs/api.md shows). A completed run prints ``RESULT {json}`` and exits 0; a stopped one prints
``STOPPED {json}`` and exits 75 (this script's choice: unfinished, retry it).
"""

import json
import pathlib
import signal
import sys
import threading

import ray

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ray_integration import ElasticTrainer  # noqa: E402
from tests import ray_jobs  # noqa: E402

EXIT_STOPPED = 75

checkpoint_dir, progress_file, ray_temp_dir, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "main"
ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir,
         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
# lease_ttl_s=5: a SIGKILLed run's successor takes the location over after 5 s of silence (15 s by default)
trainer = ElasticTrainer(min_workers=2, max_workers=2, checkpoint_uri=checkpoint_dir, checkpoint_every_n_commits=2,
                         lease_ttl_s=5, progress=False)
config = {"epochs": epochs, "step_delay_s": 0.1, "progress_file": progress_file}
if mode == "thread":
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["result"] = trainer.run(ray_jobs.train, config=config)
        except BaseException as exc:  # handed to the main thread, which raises it
            outcome["error"] = exc

    # after ray.init(), which installs its own SIGTERM handler on the main thread
    signal.signal(signal.SIGTERM, lambda signum, frame: trainer.stop("SIGTERM"))
    thread = threading.Thread(target=work, name="training")
    thread.start()
    while thread.is_alive():
        thread.join(0.2)  # short joins: the main thread runs the signal handler between them
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
else:
    result = trainer.run(ray_jobs.train, config=config)
if result.stopped:
    steps = [r.get("step") for r in result.metrics_history]
    print("STOPPED " + json.dumps({"completed": result.completed, "forced": result.forced,
                                   "stop_reason": result.stop_reason, "checkpoint": result.checkpoint_uri,
                                   "checkpoint_error": result.checkpoint_error, "last_step": max(steps, default=None),
                                   "metrics": len(result.metrics_history), "events": [e.kind for e in result.events]}),
          flush=True)
    sys.exit(EXIT_STOPPED)
resumed = result.value["resumed_from"]
print("RESULT " + json.dumps({"step": result.value["step"], "seen": result.value["seen"],
                              "identical": result.value["identical"],
                              "resumed_uri": resumed["uri"] if resumed else None,
                              "events": [e.kind for e in result.events]}), flush=True)
