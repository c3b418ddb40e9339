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
