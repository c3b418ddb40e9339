"""A worker that cannot start, or cannot load ``fn``, ends the run within seconds with its exception
and what to change, instead of waiting out ``start_timeout_s`` (real Ray, real worker processes).

Each case is deterministic: every worker the driver would start fails the same way, so the first
failure is the answer. The resources case (nothing can be placed, and the message says which
resource is missing) is ``test_impossible_resources_fail_after_start_timeout_with_advice`` in
``tests/test_trainer_ray.py``; here each message is also checked not to blame resources.
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid

import pytest

from ray_integration import ElasticTrainer, RunFailed, WorkerError
from tests import ray_jobs

#: How long a start failure may take to surface: a worker process's start and its imports (a few
#: seconds, more on a loaded 2-core machine), far less than start_timeout_s.
SURFACES_WITHIN_S = 15.0
RESOURCES_MESSAGE = "waiting for resources"


def module_only_the_driver_has(tmp_path, body: str):
    """Import a new module from ``tmp_path`` here; the workers' sys.path lacks ``tmp_path``."""
    name = f"er_driver_only_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    try:
        return name, importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def run_and_time(trainer: ElasticTrainer, fn, config: dict | None = None) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises((RunFailed, WorkerError)) as info:
        trainer.run(fn, config)
    return info.value, time.monotonic() - started


def test_fn_in_a_module_the_workers_cannot_import(ray_session, tmp_path):
    name, module = module_only_the_driver_has(tmp_path, "def train(config):\n    return 'trained'\n")
    error, elapsed = run_and_time(ElasticTrainer(min_workers=2, max_workers=2, progress=False), module.train)
    text = str(error)
    assert isinstance(error, RunFailed), text
    assert elapsed < SURFACES_WITHIN_S, f"took {elapsed:.1f} s (start_timeout_s=120): {text}"
    assert f"ModuleNotFoundError: No module named '{name}'" in text, text
    assert "could not start or load fn" in text and "runtime_env={'working_dir': '.'}" in text and \
        "py_modules" in text, text
    assert RESOURCES_MESSAGE not in text, text


def import_at_call(config: dict):
    """A training function the workers can load, that imports a module only the driver has."""
    importlib.import_module(config["module"])
    return "trained"


def test_fn_importing_a_module_the_workers_lack_fails_with_the_remote_traceback(ray_session, tmp_path):
    name, _ = module_only_the_driver_has(tmp_path, "VALUE = 1\n")
    error, elapsed = run_and_time(ElasticTrainer(min_workers=2, max_workers=2, progress=False), import_at_call,
                                  {"module": name})
    assert isinstance(error, WorkerError), str(error)
    assert elapsed < SURFACES_WITHIN_S, f"took {elapsed:.1f} s: {error}"
    assert f"ModuleNotFoundError: No module named '{name}'" in error.remote_traceback, error.remote_traceback
    assert "test_start_failures.py" in error.remote_traceback and error.node_id


def never_runs(config: dict):
    raise AssertionError("the worker actors cannot start, so fn never runs")




def test_worker_actor_whose_imports_fail_on_the_worker(ray_session):
    # the actor's class cannot be loaded there: importing elastic_ring raises on this variable
    trainer = ElasticTrainer(min_workers=1, max_workers=2, progress=False, start_timeout_s=20,
                             runtime_env={"env_vars": {"ELASTIC_RING_FUSION_THRESHOLD_BYTES": "lots"}})
    error, elapsed = run_and_time(trainer, never_runs)
    text = str(error)
    assert RESOURCES_MESSAGE not in text, text
    assert elapsed < SURFACES_WITHIN_S, f"took {elapsed:.1f} s (start_timeout_s=20): {text}"
    assert isinstance(error, RunFailed) and "could not start" in text, text
    assert "ELASTIC_RING_FUSION_THRESHOLD_BYTES='lots' is not a number" in text, text


def test_worker_runtime_env_that_cannot_be_set_up(ray_session):
    # Ray's runtime-env agent fails at once: there is no conda (or no such conda environment)
    trainer = ElasticTrainer(min_workers=1, max_workers=2, progress=False, start_timeout_s=20,
                             runtime_env={"conda": "er-no-such-conda-env"})
    error, elapsed = run_and_time(trainer, never_runs)
    text = str(error)
    assert RESOURCES_MESSAGE not in text, text
    assert elapsed < SURFACES_WITHIN_S, f"took {elapsed:.1f} s (start_timeout_s=20): {text}"
    assert isinstance(error, RunFailed) and "Ray could not set up its runtime_env" in text, text
    assert "conda" in text.lower().split("could not set up its runtime_env", 1)[1], text


def test_fn_that_returns_without_joining_the_ring_fails_at_once_saying_so(ray_session):
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"fn returned on worker .* before it joined the job's ring .*@er.elastic.run"):
        ElasticTrainer(min_workers=1, max_workers=1, progress=False, start_timeout_s=60).run(
            ray_jobs.returns_without_the_ring)
    assert time.monotonic() - started < 30  # not start_timeout_s with a "waiting for resources" diagnosis
