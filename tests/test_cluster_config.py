"""examples/cluster: the autoscaler configs pass Ray's own validation (no cloud account needed) and
have the properties the recipe relies on; the job script trains and resumes; the preemption
watcher turns a (local, emulated) metadata-service notice into a real Ray drain."""

from __future__ import annotations

import ast
import copy
import http.server
import importlib.util
import json
import pathlib
import subprocess
import sys
import threading
import time

import pytest
import ray
import yaml
from torch.utils import _pytree as pytree

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"
CONFIGS = {"aws": CLUSTER / "aws-spot-gpu.yaml", "gcp": CLUSTER / "gcp-preemptible-gpu.yaml"}
PROJECT_MOUNT = "/home/ubuntu/elastic_ring"


def load_module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


watcher = load_module(CLUSTER / "preemption_watcher.py", "er_preemption_watcher")


def raw_config(provider: str) -> dict:
    return yaml.safe_load(CONFIGS[provider].read_text())


def workers(config: dict) -> dict:
    return {name: t for name, t in config["available_node_types"].items() if name != config["head_node_type"]}


# ------------------------------------------------------------------ Ray's own validation
@pytest.mark.parametrize("provider", sorted(CONFIGS))
def test_ray_accepts_the_config(provider):
    """What `ray up` does before it talks to the cloud: merge the provider's defaults, then validate
    against ray/autoscaler/ray-schema.json and Ray's cross-field rules."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(raw_config(provider)))
    validate_config(config)
    assert config["provider"]["type"] == provider
    assert config["available_node_types"][config["head_node_type"]]["max_workers"] == 0
    # the merged head setup: the common setup commands, then the head's own
    assert config["head_setup_commands"][: len(config["setup_commands"])] == config["setup_commands"]


@pytest.mark.parametrize("provider", sorted(CONFIGS))
def test_ray_rejects_a_broken_copy(provider):
    """The validation above can fail: the same config with a misspelt node-type field is refused."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = raw_config(provider)
    name = next(iter(workers(broken)))
    broken["available_node_types"][name]["max_worker"] = broken["available_node_types"][name].pop("max_workers")
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))


# ------------------------------------------------------------------ what the recipe relies on
@pytest.mark.parametrize("provider", sorted(CONFIGS))
def test_head_on_demand_without_workers_and_gpu_workers_declared(provider):
    config = raw_config(provider)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}, "no training worker may land on the head (the driver lives there)"
    assert "InstanceMarketOptions" not in head["node_config"] and "scheduling" not in head["node_config"]
    gpu_types = workers(config)
    assert gpu_types
    for name, node_type in gpu_types.items():
        assert node_type["resources"]["GPU"] >= 1 and node_type["resources"]["CPU"] >= 1, name
        assert node_type["min_workers"] == 0 and 1 <= node_type["max_workers"] <= config["max_workers"], name


def test_aws_workers_are_spot_and_their_node_config_fits_ec2s_api():
    """Every AWS node_config goes to EC2 RunInstances as is: check it against botocore's model of that
    API (names, types, and enum values such as InstanceType and MarketType)."""
    import botocore.session
    from botocore.validate import ParamValidator

    run_instances = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances")
    config = raw_config("aws")
    for name, node_type in config["available_node_types"].items():
        params = {**node_type["node_config"], "MinCount": 1, "MaxCount": 1}
        report = ParamValidator().validate(params, run_instances.input_shape)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"
        assert bad_enum_values(params, run_instances.input_shape) == [], name
    for name, node_type in workers(config).items():
        market = node_type["node_config"]["InstanceMarketOptions"]
        assert market["MarketType"] == "spot", name
        assert market["SpotOptions"]["InstanceInterruptionBehavior"] == "terminate", name
        assert "IamInstanceProfile" in node_type["node_config"], f"{name}: rank 0 writes checkpoints from a worker"


def bad_enum_values(params: dict, shape) -> list[str]:
    """Leaves of ``params`` whose botocore shape is an enum that does not list them."""
    bad = []
    for path, leaf in pytree.tree_flatten_with_path(params)[0]:
        leaf_shape = shape
        for key in path:
            leaf_shape = leaf_shape.member if isinstance(key, pytree.SequenceKey) else leaf_shape.members[key.key]
        if getattr(leaf_shape, "enum", None) and leaf not in leaf_shape.enum:
            bad.append(f"{pytree.keystr(path)}={leaf!r}")
    return bad


def test_bad_enum_values_finds_a_misspelt_market_type():
    import botocore.session

    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    params = {"InstanceType": "g5.xlarge", "InstanceMarketOptions": {"MarketType": "spott"}, "MinCount": 1}
    assert bad_enum_values(params, shape) == ["['InstanceMarketOptions']['MarketType']='spott'"]
    assert bad_enum_values({"InstanceType": "g5.xlarge"}, shape) == []


def test_gcp_workers_are_spot_vms_with_a_gpu():
    for name, node_type in workers(raw_config("gcp")).items():
        node_config = node_type["node_config"]
        assert node_config["scheduling"]["provisioningModel"] == "SPOT", name
        assert node_config["scheduling"]["onHostMaintenance"] == "TERMINATE", f"{name}: GPUs cannot live-migrate"
        accelerators = node_config["guestAccelerators"]
        assert sum(a["acceleratorCount"] for a in accelerators) == node_type["resources"]["GPU"], name
        assert node_config["serviceAccounts"][0]["scopes"] == ["https://www.googleapis.com/auth/cloud-platform"]


@pytest.mark.parametrize("provider", sorted(CONFIGS))
def test_setup_installs_this_project_and_nodes_start_secured(provider):
    config = raw_config(provider)
    assert config["file_mounts"][PROJECT_MOUNT] == ".", "the checkout `ray up` runs from goes to every node"
    assert config["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"
    setup = config["setup_commands"]
    assert any('pip install -q -e "$HOME/elastic_ring[gpu]"' in c for c in setup), setup
    pins = [c for c in setup if "ray[default]==" in c]
    assert len(pins) == 1 and '"torch==' in pins[0] and ("s3fs" if provider == "aws" else "gcsfs") in pins[0]
    head_start = " ".join(config["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_JOB_STOP_WAIT_TIME_S=180" in head_start  # > stop_timeout_s (60 s) plus the final write
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379" in worker_start
    watcher_path = f"$HOME/elastic_ring/examples/cluster/preemption_watcher.py --provider {provider}"
    assert watcher_path in worker_start
    assert (ROOT / "examples/cluster/preemption_watcher.py").is_file()


def test_both_configs_pin_the_same_versions_and_the_readme_explains_every_placeholder():
    pins = {p: [c for c in raw_config(p)["setup_commands"] if "ray[default]==" in c][0] for p in CONFIGS}
    assert pins["aws"].replace("s3fs", "FS") == pins["gcp"].replace("gcsfs", "FS"), pins
    readme = (CLUSTER / "README.md").read_text()
    for text in ("ami-REPLACE_ME", "REPLACE_ME-elastic-ring-checkpoints", "REPLACE_ME-project-id"):
        assert text in readme, text
    placeholders = {leaf for p in CONFIGS for leaf in pytree.tree_leaves(raw_config(p))
                    if isinstance(leaf, str) and "REPLACE_ME" in leaf}
    assert placeholders == {"ami-REPLACE_ME", "REPLACE_ME-project-id",
                            "arn:aws:iam::123456789012:instance-profile/REPLACE_ME-elastic-ring-checkpoints",
                            "elastic-ring-workers@REPLACE_ME-project-id.iam.gserviceaccount.com"}, placeholders


# ------------------------------------------------------------------ the job script
def test_train_script_refuses_to_run_without_a_checkpoint_location(monkeypatch, capsys):
    train = load_module(CLUSTER / "train.py", "er_cluster_train")
    monkeypatch.delenv("CHECKPOINT_URI", raising=False)
    with pytest.raises(SystemExit) as info:
        train.parse_args([])
    assert info.value.code == 2 and "give --checkpoint-uri s3://BUCKET/PATH" in capsys.readouterr().err
    monkeypatch.setenv("CHECKPOINT_URI", "s3://bucket/run")
    assert train.parse_args([]).checkpoint_uri == "s3://bucket/run"


def run_train_script(checkpoint_dir: pathlib.Path, epochs: int) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, "examples/cluster/train.py", "--address", "local", "--cpu", "--min-workers", "2",
         "--max-workers", "2", "--checkpoint-uri", str(checkpoint_dir), "--checkpoint-every-commits", "2",
         "--epochs", str(epochs), "--samples", "2048", "--classes", "4", "--width", "64", "--batch-size", "64",
         "--lr", "0.01", "--commit-every", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.stdout.splitlines() if ": " in line}
    return ast.literal_eval(lines["result"]), lines["newest checkpoint"]


@pytest.mark.slow  # ~18 s; CI runs the same script in the SIGTERM test (exit 75)
def test_train_script_trains_on_cpu_and_writes_checkpoints(tmp_path):
    result, newest = run_train_script(tmp_path / "ckpt", epochs=1)
    assert result["epochs"] == 1 and result["world_size"] == 2 and result["resumed_from"] is None, result
    assert result["steps"] == 2048 // (64 * 2) and result["train_accuracy"] > 0.7, result  # largest class: 29 %
    assert newest.startswith("file://") and "ckpt-" in newest
    assert (pathlib.Path(newest[len("file://"):]) / "MANIFEST.json").is_file()


def test_train_script_exit_codes_say_whether_training_completed():
    train = load_module(CLUSTER / "train.py", "er_cluster_train")
    from ray_integration import Result

    assert train.exit_code(Result(value={}, completed=True)) == 0
    stopped = Result(value=None, completed=False, stopped=True, stop_reason="SIGTERM")
    assert train.exit_code(stopped) == train.EXIT_STOPPED == 75  # EX_TEMPFAIL: unfinished, retry
    forced = Result(value=None, completed=False, stopped=True, forced=True, stop_reason="SIGTERM")
    assert train.exit_code(forced) == 75
    failed_write = Result(value=None, completed=False, stopped=True, checkpoint_error="disk full")
    assert train.exit_code(failed_write) == 1


@pytest.mark.slow  # ~19 s; the exit-code table above and tests/test_preemption.py's SIGTERM run cover it in CI
def test_train_script_stopped_by_sigterm_exits_75_so_that_the_job_is_retried(tmp_path):
    import os
    import signal
    import tempfile

    from tests.test_preemption import pids_with

    ray_tmp = tempfile.mkdtemp(prefix="/tmp/ert")  # this run's own Ray (short: socket paths fit in 107 bytes)
    checkpoints = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "examples/cluster/train.py", "--address", "local", "--cpu", "--min-workers", "2",
         "--max-workers", "2", "--checkpoint-uri", str(checkpoints), "--checkpoint-every-commits", "2",
         "--epochs", "200", "--samples", "2048", "--classes", "4", "--width", "64", "--batch-size", "64",
         "--commit-every", "4"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    try:
        deadline = time.monotonic() + 90
        while not list(checkpoints.glob("ckpt-*/MANIFEST.json")):  # training runs: a checkpoint was written
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for pid in pids_with(ray_tmp):  # whatever this run's Ray left behind, by PID, never `ray stop`
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 75, (proc.returncode, out[-2000:], err[-3000:])
    assert "SIGTERM received: training stopped at a commit; the last commit is saved as" in err, err[-3000:]
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.splitlines() if ": " in line}
    assert lines["result"] == "None" and lines["status"].startswith("stopped (SIGTERM) before training completed")
    newest = lines["newest checkpoint"]
    assert newest.startswith("file://") and (pathlib.Path(newest[len("file://"):]) / "MANIFEST.json").is_file()
    assert f"the rerun resumes from {newest}" in lines["status"], lines["status"]


@pytest.mark.slow
def test_train_script_run_again_resumes_from_the_newest_checkpoint(tmp_path):
    first, newest = run_train_script(tmp_path / "ckpt", epochs=2)
    assert first["steps"] == 2 * 2048 // (64 * 2) and first["train_accuracy"] > 0.8, first
    second, _ = run_train_script(tmp_path / "ckpt", epochs=3)
    assert second["resumed_from"] == newest and second["epochs"] == 3, second
    assert second["steps"] == 3 * 2048 // (64 * 2), second


# ------------------------------------------------------------------ the preemption watcher
@pytest.mark.parametrize("status, body, expected", [
    (404, "", None),
    (200, '{"action": "terminate", "time": "2026-01-01T00:02:00Z"}', 120.0),
    (200, '{"action": "stop", "time": "2026-01-01T00:00:30+00:00"}', 30.0),
    (200, '{"action": "hibernate", "time": "2025-12-31T23:59:00Z"}', 0.0),   # already past: drain now
])
def test_aws_notice_table(status, body, expected):
    now = 1767225600.0  # 2026-01-01T00:00:00Z
    assert watcher.aws_seconds_left(status, body, now) == expected


@pytest.mark.parametrize("status, body, message", [
    (500, "oops", "HTTP 500"),
    (200, "not json", "not a notice"),
    (200, '{"action": "reboot", "time": "2026-01-01T00:02:00Z"}', "action='reboot'"),
    (200, '{"action": "terminate", "time": "2026-01-01T00:02:00"}', "not a notice"),  # no time zone
    (200, '{"action": "terminate"}', "not a notice"),
])
def test_aws_answers_that_are_not_notices(status, body, message):
    with pytest.raises(watcher.MetadataError, match=message):
        watcher.aws_seconds_left(status, body, 0.0)


@pytest.mark.parametrize("status, body, expected", [(200, "FALSE", None), (200, "TRUE\n", 30.0),
                                                    (200, "maybe", watcher.MetadataError),
                                                    (503, "FALSE", watcher.MetadataError)])
def test_gcp_notice_table(status, body, expected):
    if expected is watcher.MetadataError:
        with pytest.raises(watcher.MetadataError, match="instance/preempted"):
            watcher.gcp_seconds_left(status, body)
    else:
        assert watcher.gcp_seconds_left(status, body) == expected


def test_watch_retries_errors_then_drains_once():
    answers = [None, OSError("connection refused"), watcher.MetadataError("HTTP 500"), None, 95.0]
    drained, slept = [], []

    def poll():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert watcher.watch(poll, drained.append, interval_s=5, give_up_after_s=60, sleep=slept.append) == 95.0
    assert drained == [95.0] and slept == [5, 5, 5, 5] and answers == []


def test_watch_gives_up_when_the_service_stays_unreadable():
    clock = iter(range(0, 1000, 10))

    def poll():
        raise OSError("no route to host")

    with pytest.raises(OSError, match="no route"):
        watcher.watch(poll, lambda s: pytest.fail("must not drain"), interval_s=10, give_up_after_s=30,
                      sleep=lambda s: None, clock=lambda: next(clock))


def test_drain_command_is_one_rays_cli_accepts():
    from ray.scripts.scripts import drain_node

    command = watcher.drain_command("10.0.0.1:6379", "ab" * 28, 119.7, "aws preemption notice")
    assert command[:4] == [sys.executable, "-m", "ray.scripts.scripts", "drain-node"]
    ctx = drain_node.make_context("drain-node", command[4:])
    assert ctx.params == {"address": "10.0.0.1:6379", "node_id": "ab" * 28, "reason": "DRAIN_NODE_REASON_PREEMPTION",
                          "reason_message": "aws preemption notice", "deadline_remaining_seconds": 119}


class FakeIMDS(http.server.BaseHTTPRequestHandler):
    """AWS's instance metadata service (IMDSv2) on 127.0.0.1: a token, then 404 until the notice."""

    notice_after = 2       # instance-action requests answered 404 before the notice
    requests: list[str] = []

    def do_PUT(self):
        self.requests.append(f"PUT {self.path}")
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._answer(200 if ok else 400, "token-1" if ok else "bad request")

    def do_GET(self):
        self.requests.append(f"GET {self.path}")
        if self.headers.get("X-aws-ec2-metadata-token") != "token-1":
            return self._answer(401, "")
        if self.path != "/latest/meta-data/spot/instance-action":
            return self._answer(404, "")
        gets = sum(r.startswith("GET") for r in self.requests)
        if gets <= self.notice_after:
            return self._answer(404, "")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        self._answer(200, json.dumps({"action": "terminate", "time": when}))

    def _answer(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_imds():
    FakeIMDS.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeIMDS)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_aws_poller_against_a_local_imdsv2(fake_imds):
    poll = watcher.aws_poller(fake_imds)
    assert poll() is None and poll() is None
    assert 110 < poll() <= 120
    assert FakeIMDS.requests[0] == "PUT /latest/api/token"
    assert FakeIMDS.requests.count("PUT /latest/api/token") == 1  # the token is kept


class Busy:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.mark.slow  # ~12 s; drains in a real Ray cluster stay covered by tests/test_trainer_cluster.py and tests/test_spot_drains.py
def test_watcher_drains_its_node_in_a_real_ray_cluster(fake_imds):
    """The script end to end: notice from the (local) metadata service, `ray drain-node` for the
    node, and Ray's GCS lists the node as draining with the notice's deadline (which elastic_ring's
    driver polls, tests/test_trainer_cluster.py::test_draining_node_leaves_at_a_commit_without_rollback)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # leave the shared local instance; the next test that needs it starts it again
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=1, resources={"spot": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        # a worker that is busy there (an idle node that is drained shuts down at once)
        busy = ray.remote(num_cpus=1, resources={"spot": 1})(Busy).remote()
        assert ray.get(busy.node.remote(), timeout=60) == node.node_id
        out = subprocess.run([sys.executable, str(CLUSTER / "preemption_watcher.py"), "--provider", "aws",
                              "--address", cluster.address, "--node-id", node.node_id, "--metadata-url", fake_imds,
                              "--interval-s", "0.2"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "preemption notice" in out.stderr and "drained" in out.stderr, out.stderr[-2000:]
        draining = ray._private.state.state.get_draining_nodes()
        assert list(draining) == [node.node_id], draining
        seconds_left = draining[node.node_id] / 1000 - time.time()
        assert 100 < seconds_left <= 120, seconds_left
    finally:
        ray.shutdown()
        cluster.shutdown()
