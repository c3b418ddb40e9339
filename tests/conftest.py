"""Session fixtures: one pool of three worker processes shared by all collective tests."""

from __future__ import annotations

import pytest

from tests.process_ring import ProcessRing


@pytest.fixture(scope="session")
def ring():
    pool = ProcessRing(3)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs Ray (a local start takes about 8 s)."""
    import os
    import pathlib

    import ray

    root = str(pathlib.Path(__file__).resolve().parents[1])
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield ray
    ray.shutdown()
