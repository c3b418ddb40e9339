"""A real Ray autoscaler (fake multi-node provider) launches nodes because of the job's demand;
the ring grows to max_workers while training and ends with identical parameters on all ranks.

The cluster keeps one worker node up (min_workers: 1); the two other nodes are launched by the
autoscaler for the job's demand, its pending worker actors (the job calls no request_resources), and
their workers join the ring while it trains (or form the first ring with it, if they are up before it
forms). ``request_resources`` is one cluster-wide request that every call replaces, so the job leaves
it alone: another party's request stays in place while the job runs and after it ends.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from ray_integration import ElasticTrainer
from tests import ray_jobs
from tests.test_preemption import pids_with

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cluster_resource_request() -> list[dict]:
    """What the autoscaler is asked for through ``request_resources`` now (the cluster-wide request), as
    bundles: autoscaler v1 reads it from one internal KV key, v2 from the GCS's cluster resource constraint."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray._private.worker import global_worker
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(global_worker.gcs_client)
        return [dict(by_count.request.resources_bundle) for constraint in state.cluster_resource_constraints
                for by_count in constraint.resource_requests for _ in range(by_count.count)]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def test_a_job_leaves_another_partys_request_resources_in_place(ray_session):
    """Our job neither replaces (at its start) nor cancels (at its end) what someone else asked for."""
    from ray.autoscaler.sdk import request_resources

    foreign = [{"CPU": 1, "other_party": 1}] * 2
    request_resources(bundles=foreign)
    try:
        during: list = []
        result = ElasticTrainer(min_workers=1, max_workers=2, progress=False).run(
            ray_jobs.train, config={"epochs": 1},
            on_report=lambda record: during or during.append(cluster_resource_request()))
        assert result.completed
        assert during == [foreign], during
        assert cluster_resource_request() == foreign
    finally:
        request_resources(bundles=[])  # this test's own local instance: nobody else asked for anything


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(gcs_address: str) -> dict:
    return {
        "cluster_name": "fake_multinode", "max_workers": 3,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.slot": {"resources": {"CPU": 1, "slot": 1, "object_store_memory": 200_000_000},
                                "node_config": {}, "min_workers": 1, "max_workers": 3},
        },
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
        "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


@pytest.mark.slow  # ~70 s with a real autoscaler; CI covers the per-job demand in-process (the test above)
def test_job_grows_with_the_autoscaler_and_leaves_another_partys_demand(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="/tmp/era")
    port, dashboard = free_port(), free_port()
    config = tmp_path / "autoscaler.json"
    config.write_text(json.dumps(autoscaling_config(f"127.0.0.1:{port}")))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    try:
        subprocess.run(["ray", "start", "--head", f"--port={port}", "--num-cpus=0", f"--autoscaling-config={config}",
                        f"--temp-dir={temp_dir}", f"--dashboard-port={dashboard}"],
                       env=env, check=True, capture_output=True, timeout=120)
        started = time.monotonic()
        # another party asks for 2 slot bundles with request_resources; the job asks for 3 workers
        out = subprocess.run([sys.executable, "tests/scripts/autoscaled_job.py", f"127.0.0.1:{port}", "2"], cwd=ROOT,
                             env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=300)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-4000:]
        result = json.loads(line[0][len("RESULT "):])
        print({k: v for k, v in result.items() if k not in ("seen", "events")})  # shown with pytest -s
        # One node stands and the other party's request keeps a second; the third exists only because of
        # the job's pending worker actors, so a ring of 3 proves the scale-up. They join while it trains,
        # or are in the first ring when they come up before it forms (a slow worker start, as on a loaded
        # CI machine).
        assert max(result["worlds"]) == 3, result["worlds"]
        if result["worlds"][0] < 3:
            assert "worker_joined" in result["events"]
        assert result["identical"] and result["seen"] == [18.0] * ray_jobs.N_SAMPLES
        # the other party's request: untouched while the job ran and after it ended ...
        foreign = [{"CPU": 1, "slot": 1}] * 2
        assert result["request_during"] == foreign and result["request_after"] == foreign, result
        # ... and still honoured: the job's extra node was removed when idle, the requested two stay
        # (had the job cancelled the request, the cluster would shrink to its one standing node)
        assert result["slots_after"][0] == 3 and result["slots_after"][-1] == 2, result["slots_after"]
        assert min(result["slots_after"]) == 2, result["slots_after"]
        assert time.monotonic() - started < 300
    finally:
        for pid in pids_with(temp_dir):  # this cluster's own processes, by PID; never `ray stop`
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
