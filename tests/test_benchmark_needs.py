"""Benchmarks fail fast: a missing optional package stops one before it measures anything, and a part
that fails later prints what was measured before it (benchmarks/_needs.py)."""

import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks._needs import Results

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_without(module: str, benchmark: str, *args: str) -> subprocess.CompletedProcess:
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = [{benchmark!r}, *{list(args)!r}]; "
            f"runpy.run_module({benchmark!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_recovery_without_ray_train_stops_before_running_anything():
    started = time.monotonic()
    done = _run_without("ray.train", "benchmarks.recovery", "--runs", "1")
    assert done.returncode == 1 and time.monotonic() - started < 60, done
    assert "the Ray Train comparison needs ray.train.torch" in done.stderr and "nothing was run" in done.stderr
    assert "pip install 'ray[train]'" in done.stderr and "--skip-ray-train" in done.stderr
    assert "gloo CPU workers" not in done.stdout  # not even its header: nothing started


def test_scale_without_matplotlib_stops_before_part_1():
    done = _run_without("matplotlib", "benchmarks.scale", "--worlds", "2", "--skip-recovery")
    assert done.returncode == 1 and "drawing" in done.stderr and "needs matplotlib" in done.stderr, done
    assert "pip install -e '.[examples]'" in done.stderr and "ranks" not in done.stdout


def test_a_failing_part_prints_what_was_measured_before_it(capsys):
    results = Results("demo")
    results.add("part 1: 0.1 s")
    with pytest.raises(SystemExit) as info:
        with results.part("part 2"):
            raise RuntimeError("the cluster went away")
    out, err = capsys.readouterr()
    assert info.value.code == 1
    assert out.index("... part 1: 0.1 s") < out.index("demo: part 2 failed; what was measured before it:\npart 1: 0.1 s")
    assert "demo: part 2 failed with RuntimeError: the cluster went away" in err and "Traceback" in err


def _fails_on_rank_1() -> int:
    import elastic_ring as er

    if er.rank() == 1:
        raise ValueError("rank 1 cannot measure this")
    return er.rank()


def test_a_rank_that_raises_fails_the_run_at_once_with_its_traceback():
    """benchmarks._launch.run_ranks names a failing rank within seconds (it used to wait 30 minutes for a result
    that never came; a GPU script's timeout then ate the run without a word)."""
    from benchmarks._launch import RankFailed, run_ranks

    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed") as failed:
        run_ranks(_fails_on_rank_1, 2, collective_timeout_s=10.0, timeout_s=60.0)
    assert "ValueError: rank 1 cannot measure this" in str(failed.value)
    assert time.monotonic() - started < 45
