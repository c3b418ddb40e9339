"""An invariant job whose driver process the test SIGSTOPs and SIGCONTs (a GC pause, a slow head node).

    python tests/scripts/stall_job.py RAY_TEMP_DIR CONFIG_JSON

Runs ``tests.ray_jobs.train`` with its own local Ray and prints ``RESULT {json}`` (the value and the events).
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from ray_integration import ElasticTrainer  # noqa: E402
from tests import ray_jobs  # noqa: E402

ray_temp_dir, config = sys.argv[1], json.loads(sys.argv[2])
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_temp_dir,
         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
try:
    result = ElasticTrainer(min_workers=2, max_workers=2, heartbeat_timeout_s=3, progress=False).run(
        ray_jobs.train, config=config)
    print("RESULT " + json.dumps({"value": result.value,
                                  "events": [{"kind": e.kind, **e.detail} for e in result.events]}, default=str),
          flush=True)
finally:
    ray.shutdown()
