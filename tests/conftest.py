"""Session fixtures: one pool of three worker processes shared by all collective tests."""

from __future__ import annotations

import pytest

from tests.process_ring import ProcessRing


@pytest.fixture(scope="session")
def ring():
    pool = ProcessRing(3)
    yield pool
    pool.close()


def ray_runtime_env() -> dict:
    import os
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    return {"env_vars": {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}}


@pytest.fixture
def ray_session():
    """The shared local Ray instance (started once; a local start takes about 8 s). Multi-node
    tests disconnect from it to use their own cluster; the next test that needs it starts it again."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env=ray_runtime_env())
    yield ray
