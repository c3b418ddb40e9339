"""Connect to an autoscaling Ray cluster and train with min_workers=1, max_workers=3 (autoscaler test).

    RAY_AUTH_MODE=token python tests/scripts/autoscaled_job.py ADDRESS [FOREIGN_BUNDLES]

With FOREIGN_BUNDLES > 0, another party of the cluster first asks the autoscaler for that many
``{"CPU": 1, "slot": 1}`` bundles with ``request_resources`` (as a notebook, Ray Data or a second job
would); after the run this script reports what the autoscaler is then asked for, and how many slot
nodes stay up once the job's own nodes went idle.
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
from tests.test_autoscaler import cluster_resource_request  # noqa: E402

FOREIGN_BUNDLE = {"CPU": 1, "slot": 1}

foreign = int(sys.argv[2]) if len(sys.argv) > 2 else 0
ray.init(address=sys.argv[1], log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
# Wait for the cluster's standing node (min_workers: 1) so that the first ring forms on it alone
# and the nodes launched for the job's demand join while it trains (the test asserts growth).
deadline = time.monotonic() + 120
while ray.cluster_resources().get("slot", 0) < 1:
    if time.monotonic() > deadline:
        sys.exit("the autoscaler did not start the standing worker node within 120 s")
    time.sleep(0.5)
if foreign:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[FOREIGN_BUNDLE] * foreign)
seen_during: list = []
result = ElasticTrainer(min_workers=1, max_workers=3, resources_per_worker={"slot": 1}, cpus_per_worker=1,
                        start_timeout_s=120, progress=False).run(
    ray_jobs.train, config={"epochs": 18, "step_delay_s": 0.05, "batch": 1},
    on_report=lambda record: seen_during or seen_during.append(cluster_resource_request()))
report = {"world": result.value["world"], "identical": result.value["identical"], "seen": result.value["seen"],
          "worlds": sorted({e.world_size for e in result.events if e.kind == "ring_formed"}),
          "events": [e.kind for e in result.events]}
if foreign:
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    report["autoscaler_v2"] = is_autoscaler_v2()
    report["request_during"] = seen_during[0] if seen_during else None
    report["request_after"] = cluster_resource_request()
    # the job's actors are gone: its extra node goes idle and is removed (idle_timeout_minutes 0.1);
    # the nodes the other party asked for must stay. Wait for the removal, then watch for 5 s more.
    slots, deadline = [int(ray.cluster_resources().get("slot", 0))], time.monotonic() + 60
    while slots[-1] >= 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        slots.append(int(ray.cluster_resources().get("slot", 0)))
    watch_until = time.monotonic() + 5
    while time.monotonic() < watch_until:
        time.sleep(0.5)
        slots.append(int(ray.cluster_resources().get("slot", 0)))
    slots = [n for i, n in enumerate(slots) if i == 0 or n != slots[i - 1]]  # the changes only
    report["slots_after"] = slots
print("RESULT " + json.dumps(report), flush=True)
