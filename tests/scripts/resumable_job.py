"""A training script with durable checkpoints and its own local Ray, for the preemption tests.

    python tests/scripts/resumable_job.py CHECKPOINT_DIR PROGRESS_FILE RAY_TEMP_DIR EPOCHS
"""

import json
import pathlib
import sys

import ray

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ray_integration import ElasticTrainer  # noqa: E402
from tests import ray_jobs  # noqa: E402

checkpoint_dir, progress_file, ray_temp_dir, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir,
         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
result = ElasticTrainer(min_workers=2, max_workers=2, checkpoint_uri=checkpoint_dir, checkpoint_every_n_commits=2,
                        progress=False).run(ray_jobs.train, config={"epochs": epochs, "step_delay_s": 0.1,
                                                                     "progress_file": progress_file})
resumed = result.value["resumed_from"]
print("RESULT " + json.dumps({"step": result.value["step"], "seen": result.value["seen"],
                              "identical": result.value["identical"],
                              "resumed_uri": resumed["uri"] if resumed else None,
                              "events": [e.kind for e in result.events]}), flush=True)
