"""Turn a cloud's preemption notice into a Ray drain, so that elastic_ring's workers leave at a commit.

Ray's VM cluster launcher does not read spot notices itself. This watcher runs on every spot or
preemptible worker node (the cluster configs beside it start it after ``ray start``):

    nohup python preemption_watcher.py --provider aws > /tmp/preemption_watcher.log 2>&1 &

It polls the instance metadata service every ``--interval-s`` seconds: on AWS the spot
``instance-action`` (IMDSv2; the notice comes two minutes before the instance is stopped or
terminated), on GCP ``instance/preempted`` (about 30 seconds before). On a notice it runs
``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` for its own
node once, and exits. Ray then places nothing new there, and elastic_ring's driver, which polls
Ray's draining nodes every 0.2 s, has the workers on that node leave the ring at their next
``state.commit()``: no rollback, no lost step, and a durable checkpoint first if the ring left
behind would be smaller than ``min_workers``.

Errors of the metadata service are retried; if it cannot be read for ``--give-up-after-s`` in a
row (wrong ``--provider``, not on a cloud VM) the watcher exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Callable

AWS_METADATA = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"
#: GCP gives a preempted VM about 30 s (ACPI soft off, then stopped).
GCP_NOTICE_S = 30.0
#: AWS asks to poll the spot instance-action every 5 s.
POLL_INTERVAL_S = 5.0
HTTP_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 30.0


class MetadataError(RuntimeError):
    """The metadata service answered something that is not a notice nor "no notice"."""


def aws_seconds_left(status: int, body: str, now_unix: float) -> float | None:
    """AWS spot ``instance-action``: None while there is no notice (404), else the seconds left."""
    if status == 404:
        return None
    if status != 200:
        raise MetadataError(f"spot/instance-action answered HTTP {status}: {body[:200]!r}")
    try:
        notice = json.loads(body)
        action, when = notice["action"], notice["time"]
        stamp = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MetadataError(f"spot/instance-action is not a notice ({exc}): {body[:200]!r}") from None
    if action not in ("terminate", "stop", "hibernate") or stamp.tzinfo is None:
        raise MetadataError(f"spot/instance-action has action={action!r} time={when!r}: not a notice")
    return max(0.0, stamp.timestamp() - now_unix)


def gcp_seconds_left(status: int, body: str) -> float | None:
    """GCP ``instance/preempted``: None while it says FALSE, else the seconds a preempted VM has."""
    answer = body.strip().upper()
    if status == 200 and answer == "FALSE":
        return None
    if status == 200 and answer == "TRUE":
        return GCP_NOTICE_S
    raise MetadataError(f"instance/preempted answered HTTP {status}: {body[:200]!r}")


#: The metadata service is link-local: never through an HTTP proxy set in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def aws_poller(base_url: str) -> Callable[[], float | None]:
    token: list[str] = []

    def poll() -> float | None:
        if not token:  # IMDSv2: a session token first (it lasts 6 hours; fetched again when refused)
            status, body = http("PUT", f"{base_url}/latest/api/token",
                                {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
            if status != 200:
                raise MetadataError(f"IMDSv2 token request answered HTTP {status}: {body[:200]!r}")
            token.append(body.strip())
        status, body = http("GET", f"{base_url}/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": token[0]})
        if status == 401:
            token.clear()
        return aws_seconds_left(status, body, time.time())

    return poll


def gcp_poller(base_url: str) -> Callable[[], float | None]:
    def poll() -> float | None:
        return gcp_seconds_left(*http("GET", f"{base_url}/computeMetadata/v1/instance/preempted",
                                      {"Metadata-Flavor": "Google"}))

    return poll


def watch(poll: Callable[[], float | None], drain: Callable[[float], None], interval_s: float,
          give_up_after_s: float, sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> float:
    """Poll until a notice, drain once, return the seconds that were left. MetadataError or OSError from
    ``poll`` are retried until they have lasted ``give_up_after_s``, then the last one is raised."""
    failing_since: float | None = None
    while True:
        try:
            seconds_left = poll()
            failing_since = None
        except (MetadataError, OSError) as exc:
            now = clock()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= give_up_after_s:
                raise
            log(f"metadata not readable ({type(exc).__name__}: {exc}); retrying")
            seconds_left = None
        if seconds_left is not None:
            drain(seconds_left)
            return seconds_left
        sleep(interval_s)


def drain_command(address: str, node_id: str, seconds_left: float, message: str) -> list[str]:
    """``ray drain-node`` for this node, run by this interpreter (the node's Ray, whatever PATH says)."""
    return [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address, "--node-id", node_id,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", message,
            "--deadline-remaining-seconds", str(int(seconds_left))]


def own_node_id(address: str, wait_s: float) -> str:
    """This node's Ray node id (connects once; ``ray start`` may still be coming up: retried for ``wait_s``)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            break
        except ConnectionError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Ray node to join at address={address!r} within {wait_s} s: {exc}") from None
            time.sleep(2.0)
    try:
        return ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


def log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} preemption_watcher: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="drain this Ray node when its cloud announces a preemption")
    parser.add_argument("--provider", choices=("aws", "gcp"), required=True)
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: the one this node joined)")
    parser.add_argument("--node-id", default=None, help="this node's Ray node id (default: asked from Ray)")
    parser.add_argument("--metadata-url", default=None, help="the metadata service (default: the provider's)")
    parser.add_argument("--interval-s", type=float, default=POLL_INTERVAL_S)
    parser.add_argument("--give-up-after-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.interval_s <= 0 or args.give_up_after_s <= 0:
        parser.error(f"--interval-s={args.interval_s} and --give-up-after-s={args.give_up_after_s} must be > 0")
    node_id = args.node_id or own_node_id(args.address, wait_s=120.0)
    base = args.metadata_url or (AWS_METADATA if args.provider == "aws" else GCP_METADATA)
    poll = aws_poller(base) if args.provider == "aws" else gcp_poller(base)
    log(f"watching {base} for a {args.provider} preemption notice of Ray node {node_id[:12]}")

    def drain(seconds_left: float) -> None:
        command = drain_command(args.address, node_id, seconds_left,
                                f"{args.provider} preemption notice: the instance goes in {seconds_left:.0f} s")
        log(f"preemption notice, {seconds_left:.0f} s left: {' '.join(command[3:])}")
        subprocess.run(command, check=True, timeout=DRAIN_TIMEOUT_S)
        log("drained: Ray places nothing new here, and elastic_ring's workers leave at their next commit")

    try:
        watch(poll, drain, args.interval_s, args.give_up_after_s)
    except (MetadataError, OSError) as exc:
        log(f"giving up: the metadata service at {base} was not readable for {args.give_up_after_s} s "
            f"({type(exc).__name__}: {exc}); is --provider={args.provider} right?")
        return 2
    except subprocess.CalledProcessError as exc:
        log(f"ray drain-node failed with status {exc.returncode} (its output is above)")
        return 1
    except subprocess.TimeoutExpired:
        log(f"ray drain-node did not finish within {DRAIN_TIMEOUT_S} s; is the Ray cluster at {args.address} up?")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
