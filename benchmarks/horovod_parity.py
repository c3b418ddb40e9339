"""Horovod parity: run Horovod's own PyTorch test suite against ``ray_integration.horovod``.

    python -m benchmarks.horovod_parity --tests PATH/TO/horovod/test/parallel/test_torch.py [--ranks 2 3]
                                        [--only SUBSTRING] [--timeout-s 120]

Horovod's file is read from your checkout (nothing of it is copied here). Each
of its ``TorchTests`` methods runs on ``--ranks`` fresh local processes that
form a gloo ring, with ``horovod.torch`` bound to ``ray_integration.horovod``
and Horovod's test helpers (``test/utils/common.py``) on the path; the
environment holds Horovod's launch variables (``HOROVOD_RANK``, ``HOROVOD_SIZE``,
the gloo controller: what the launcher sets, :mod:`ray_integration.wire.launch_env`),
as ``horovodrun --gloo`` would. A test passes when it passes on every rank, is
unsupported when Horovod marks it ``@pytest.mark.skip`` (unittest would run it),
any rank skipped it or met ``NotImplementedError`` / ``AttributeError`` on
``hvd`` (a call we refuse or lack), and fails otherwise.
Fresh processes per test keep a failure (a collective one rank never called)
from spilling into the next test. It prints one line per test and the totals.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import sys
import time
import traceback
import types
import unittest

import torch.distributed as dist

from benchmarks._launch import _main as launch_rank, new_secret


def _run_test(path: str, name: str) -> tuple[str, str]:
    """On one rank: run Horovod's test ``name``; returns (outcome, detail)."""
    try:
        return _run_test_here(path, name)
    except Exception:  # noqa: BLE001 - the harness itself could not run the test (an import, ...)
        return "failed", "harness: " + traceback.format_exc().strip().splitlines()[-1][:160]


def _run_test_here(path: str, name: str) -> tuple[str, str]:
    import unittest.mock

    import elastic_ring as er
    import ray_integration.horovod as hvd

    try:  # what the launcher and ElasticTrainer set on every worker (Horovod's launch environment)
        from ray_integration.wire.launch_env import horovod_environment
    except ImportError:  # a version from before it
        os.environ.update(HOROVOD_RANK=str(er.rank()), HOROVOD_SIZE=str(er.size()), HOROVOD_CROSS_RANK="0",
                          HOROVOD_LOCAL_RANK=str(er.local_rank()), HOROVOD_LOCAL_SIZE=str(er.local_size()),
                          HOROVOD_CROSS_SIZE="1")
    else:
        from elastic_ring.ring import runtime

        os.environ.update(horovod_environment(runtime.current().spec))
    package = types.ModuleType("horovod")
    package.__path__ = []  # a package, so that `import horovod.torch` resolves
    package.torch = hvd
    sys.modules.update({"horovod": package, "horovod.torch": hvd, "mock": unittest.mock})  # common.py imports mock
    for sub in ("horovod.runner", "horovod.runner.util"):  # common.py imports horovod.runner.util.threads.in_thread
        sys.modules[sub] = types.ModuleType(sub)
        sys.modules[sub].__path__ = []
    threads = sys.modules["horovod.runner.util.threads"] = types.ModuleType("horovod.runner.util.threads")
    threads.in_thread = _in_thread
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(path)), "utils"))
    spec = importlib.util.spec_from_file_location("horovod_test_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for mark in getattr(getattr(module.TorchTests, name), "pytestmark", []):  # Horovod's own @pytest.mark.skip
        if getattr(mark, "name", None) == "skip":
            return "unsupported", f"skipped by Horovod: {mark.kwargs.get('reason', '')[:100]}"
    result = unittest.TestResult()
    module.TorchTests(name).run(result)
    if result.skipped:
        return "unsupported", f"skipped: {result.skipped[0][1][:120]}"
    problems = result.errors + result.failures
    if not problems:
        return "passed", ""
    text = problems[0][1]
    last = text.strip().splitlines()[-1]
    if "NotImplementedError" in last or ("AttributeError" in last and "ray_integration.horovod" in last):
        return "unsupported", last[:160]
    return "failed", last[:160]


def _in_thread(target, args=(), name=None, daemon=True, silent=False):
    """What Horovod's test helpers import from horovod.runner.util.threads: start ``target`` on a thread."""
    import threading

    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def _one(path: str, name: str, ranks: int, timeout_s: float) -> tuple[str, str]:
    """Run test ``name`` on ``ranks`` fresh processes; a test that outlives ``timeout_s`` failed (it hung)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    secret = new_secret()
    procs = [ctx.Process(target=launch_rank, args=(_run_test, r, ranks, store.port, secret, (path, name), queue, "gloo"))
             for r in range(ranks)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < ranks and time.monotonic() < deadline:
            try:
                rank, outcome = queue.get(timeout=0.5)
                outcomes[rank] = outcome
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(0.5 if len(outcomes) == ranks else 0)
            if p.is_alive():
                p.kill()
                p.join(5)
    if len(outcomes) < ranks:
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in outcomes]
        if dead:
            return "failed", f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
        return "failed", f"hung: no result within {timeout_s:g} s"
    kinds = [outcomes[r][0] for r in range(ranks)]
    for kind in ("failed", "unsupported"):
        if kind in kinds:
            return kind, next(outcomes[r][1] for r in range(ranks) if outcomes[r][0] == kind)
    return "passed", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", required=True, help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--only", default=None, help="run the tests whose name contains this")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    if not os.path.isfile(args.tests):
        parser.error(f"--tests {args.tests!r} is not a file")
    path = os.path.abspath(args.tests)
    helpers = os.path.join(os.path.dirname(os.path.dirname(path)), "utils", "common.py")
    if not os.path.isfile(helpers):  # before any rank starts: every test would fail on its import
        parser.error(f"Horovod's test helpers {helpers} are missing: --tests must point into a checkout of "
                     "horovod/horovod (test/parallel/test_torch.py with test/utils/common.py beside it)")
    source = open(path, encoding="utf-8").read()
    names = sorted({line.split("def ")[1].split("(")[0] for line in source.splitlines()
                    if line.startswith("    def test_")})
    if args.only:
        names = [n for n in names if args.only in n]
    for ranks in args.ranks:
        totals = {"passed": 0, "failed": 0, "unsupported": 0}
        try:
            for name in names:
                kind, detail = _one(path, name, ranks, args.timeout_s)
                totals[kind] += 1
                print(f"{ranks} ranks  {kind:<11} {name}  {detail}", flush=True)
        finally:  # also when interrupted or a run fails: the totals measured so far
            done = sum(totals.values())
            print(f"== {ranks} ranks: {totals['passed']} passed, {totals['failed']} failed, {totals['unsupported']} "
                  f"unsupported of {done}{'' if done == len(names) else f' run (of {len(names)})'} tests in "
                  f"{os.path.basename(path)}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
