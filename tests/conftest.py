"""Session fixtures: one pool of three worker processes shared by all collective tests."""

from __future__ import annotations

import pytest

from tests.process_ring import ProcessRing


@pytest.fixture(scope="session")
def ring():
    pool = ProcessRing(3)
    yield pool
    pool.close()
