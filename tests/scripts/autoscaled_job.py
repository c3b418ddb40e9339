"""Connect to an autoscaling Ray cluster and train with min_workers=1, max_workers=3 (autoscaler test).

    RAY_AUTH_MODE=token python tests/scripts/autoscaled_job.py ADDRESS
"""

import json
import pathlib
import sys
import time

import ray

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ray_integration import ElasticTrainer  # noqa: E402
from tests import ray_jobs  # noqa: E402

ray.init(address=sys.argv[1], log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
# Wait for the cluster's standing node (min_workers: 1) so that the first ring forms on it alone
# and the nodes launched for the job's demand join while it trains (the test asserts growth).
deadline = time.monotonic() + 120
while ray.cluster_resources().get("slot", 0) < 1:
    if time.monotonic() > deadline:
        sys.exit("the autoscaler did not start the standing worker node within 120 s")
    time.sleep(0.5)
result = ElasticTrainer(min_workers=1, max_workers=3, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                        start_timeout_s=120, progress=False).run(
    ray_jobs.train, config={"epochs": 18, "step_delay_s": 0.05, "batch": 1})
print("RESULT " + json.dumps({"world": result.value["world"], "identical": result.value["identical"],
                              "seen": result.value["seen"],
                              "worlds": sorted({e.world_size for e in result.events if e.kind == "ring_formed"}),
                              "events": [e.kind for e in result.events]}), flush=True)
