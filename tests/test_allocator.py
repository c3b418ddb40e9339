"""elastic_ring.core.allocator: glibc keeps freed gradient-sized blocks, so a step's fresh gradients cost no page faults."""

import os
import pathlib
import platform
import subprocess
import sys

import pytest

from ray_integration import ElasticTrainer
from tests import ray_jobs

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHURN = """
import sys
from elastic_ring.core import allocator
from tests.ray_jobs import gradient_churn_faults
tuned = allocator.tune() if sys.argv[1] == "1" else False
print(tuned, gradient_churn_faults())
"""


def _churn(tune: bool) -> tuple[str, int]:
    """In a fresh process (mallopt cannot be undone): tuned?, and the faults of a step's fresh gradients.

    glibc's default mmap threshold moves with the heap's history (a freed mapping raises it), so the faults of
    the untuned process depend on what ran before (0 in one environment, 200,000 in another). The baseline pins
    glibc's initial threshold (128 KiB, ``MALLOC_MMAP_THRESHOLD_``): every gradient-sized block is then a fresh
    mapping, which is what tuning removes; ``tune()`` overrides it in the tuned process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", CHURN, "1" if tune else "0"], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT, env=env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuning_removes_the_page_faults_of_freed_large_blocks():
    default, tuned = _churn(False), _churn(True)
    assert tuned[0] == "True"
    # 5 steps x 10 x 16 MiB: as fresh mappings every page faults again each step (about 200,000 faults); kept in
    # the heap, they are touched once, in the warm-up
    assert default[1] > 50_000 and tuned[1] < 1_000, (default, tuned)


@pytest.mark.slow  # ~12 s with its Ray set-up; the tuning itself stays covered by this module's process tests
def test_workers_tune_by_default_and_the_option_turns_it_off(ray_session):
    on = ElasticTrainer(min_workers=1, max_workers=1, progress=False).run(ray_jobs.allocator_probe).value
    off = ElasticTrainer(min_workers=1, max_workers=1, progress=False, tune_allocator=False).run(
        ray_jobs.allocator_probe).value
    if GLIBC:  # the fault count itself is the subprocess test's: a Ray worker allocates on other threads' arenas
        assert on["applied"] is True, on
    assert off["applied"] is None, off


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="tune_allocator='yes' must be True or False"):
        ElasticTrainer(tune_allocator="yes")
