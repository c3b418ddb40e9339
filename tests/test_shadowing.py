"""A user's module named like one of our top-level packages (``state.py`` beside a training script is the
usual one) fails the import at once with an error that names the file and the fix, on the driver and on
the Ray workers (real processes, real Ray).

Without the check, ``from ray_integration import ElasticTrainer`` failed with ``No module named
'state.checkpoints'; 'state' is not a package``, and on Ray every worker failed that way.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from elastic_ring import shadowing
from elastic_ring.shadowing import MARKER, PACKAGES, PackageShadowedError, check, check_path_prefix

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Our imports stop at the check, before torch or Ray load: well under a second, seconds on a busy machine.
FAILS_WITHIN_S = 10.0


def run_script(folder: pathlib.Path, body: str, cwd: pathlib.Path | None = None,
               timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    script = folder / "train.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=cwd or folder, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - started


def assert_clear_error(done: subprocess.CompletedProcess, elapsed: float, path: str, fix: str) -> str:
    assert done.returncode != 0, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic_ring.shadowing.PackageShadowedError: "), done.stderr
    assert f"{path} {MARKER}" in last and f"Fix: {fix}" in last, last
    assert "is not a package" not in done.stderr and "No module named" not in done.stderr, done.stderr
    assert elapsed < FAILS_WITHIN_S, f"took {elapsed:.1f} s"
    return last


def test_a_state_py_beside_the_script_fails_the_import_naming_the_file_and_the_fix(tmp_path):
    (tmp_path / "state.py").write_text("STEP = 0  # the user's own training state\n")
    done, elapsed = run_script(tmp_path, "from ray_integration import ElasticTrainer\n")
    last = assert_clear_error(done, elapsed, str(tmp_path / "state.py"), "rename it, e.g. state.py -> train_state.py")
    assert "Python finds it first on sys.path" in last and "__pycache__/state.*.pyc" in last, last


def test_the_users_state_imported_first_fails_the_import_of_ours(tmp_path):
    (tmp_path / "state.py").write_text("STEP = 0\n")
    done, elapsed = run_script(tmp_path, """\
        import state  # the user's, beside the script
        assert state.STEP == 0
        from ray_integration import ElasticTrainer
    """)
    last = assert_clear_error(done, elapsed, str(tmp_path / "state.py"), "rename it, e.g. state.py -> train_state.py")
    assert "Python imported it as 'state' before elastic_ring's package" in last, last


@pytest.mark.parametrize("case", ["elastic_ring.py under state", "state/ package", "stale state.pyc"])
def test_other_shapes_of_shadowing(tmp_path, case):
    if case == "elastic_ring.py under state":  # a script named after the library; state/__init__ checks it
        (tmp_path / "elastic_ring.py").write_text("X = 1\n")
        body, path, fix = "import state\n", str(tmp_path / "elastic_ring.py"), "rename it, e.g. elastic_ring.py ->"
    elif case == "state/ package":
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / "__init__.py").write_text("")
        body, path, fix = "import ray_integration\n", str(tmp_path / "state") + os.sep, "rename the folder"
    else:  # its state.py was renamed, but a state.pyc (not in __pycache__) still imports
        (tmp_path / "state.py").write_text("X = 1\n")
        subprocess.run([sys.executable, "-c", "import py_compile; py_compile.compile('state.py', cfile='state.pyc')"],
                       cwd=tmp_path, check=True)
        (tmp_path / "state.py").unlink()
        body, path, fix = "import ray_integration\n", str(tmp_path / "state.pyc"), "delete that file"
    done, elapsed = run_script(tmp_path, body)
    assert_clear_error(done, elapsed, path, fix)


def test_a_folder_named_state_without_init_does_not_shadow_an_installed_package(tmp_path):
    # e.g. a folder of checkpoints: a namespace package loses to a regular package later on sys.path
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "model.pt").write_bytes(b"")
    done, _ = run_script(tmp_path, """\
        import state
        from ray_integration import ElasticTrainer
        print("imported", state.__file__)
    """)
    assert done.returncode == 0, done.stderr
    assert f"imported {ROOT / 'state' / '__init__.py'}" in done.stdout, done.stdout


def test_our_own_packages_pass_the_check():
    check(*PACKAGES)
    check_path_prefix([str(ROOT)])  # the repository as the working directory: ours, first


def test_the_driver_can_check_what_the_workers_will_import(tmp_path):
    # Ray puts the driver's working directory first on the workers' sys.path (ElasticTrainer can check it
    # before it starts any worker: no worker fails, no crash dump)
    (tmp_path / "state.py").write_text("")
    with pytest.raises(PackageShadowedError) as info:
        check_path_prefix([str(tmp_path)])
    text = str(info.value)
    assert info.value.path == str(tmp_path / "state.py") and info.value.name == "state", text
    assert f"Ray puts {tmp_path} first on the workers' sys.path" in text and MARKER in text, text


def test_the_error_is_an_import_error_that_survives_pickling():
    error = shadowing._error("state", "/somewhere/state.py", [], "Python finds it first on sys.path")
    assert isinstance(error, ImportError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is PackageShadowedError and str(copy) == str(error) and copy.path == "/somewhere/state.py"


def test_each_package_holds_its_signature_file_and_the_check_imports_only_the_standard_library():
    for package, signature in PACKAGES.items():
        assert (ROOT / package / signature).is_file(), f"{package}/{signature} is how the check knows our {package}"
    tree = ast.parse((ROOT / "elastic_ring" / "shadowing.py").read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


DRIVER = """\
import json, sys, time

import ray

from ray_integration import ElasticTrainer, RunFailed


def fn(config):
    return "trained"


ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
try:
    started = time.monotonic()
    try:
        ElasticTrainer(min_workers=1, max_workers=1, progress=False, start_timeout_s=60).run(fn)
        outcome = {"type": None, "text": "the run succeeded"}
    except Exception as exc:  # reported to the test as it is
        outcome = {"type": type(exc).__name__, "text": str(exc)}
    outcome["elapsed"] = time.monotonic() - started
    print("OUTCOME " + json.dumps(outcome))
finally:
    ray.shutdown()
"""


@pytest.mark.slow  # ~12 s; CI checks the same driver-side check without Ray, and the worker-side path with Ray
def test_workers_that_see_a_state_py_the_driver_does_not_end_the_run_with_the_clear_error(tmp_path):
    # the driver script lives elsewhere, so the driver's own sys.path lacks its working directory; Ray puts
    # that directory first on the workers' sys.path, so only the workers import the user's state.py
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir()
    scripts.mkdir()
    (work / "state.py").write_text("STEP = 0\n")
    done, _ = run_script(scripts, DRIVER, cwd=work, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, done.stdout + done.stderr
    outcome = json.loads(lines[-1][len("OUTCOME "):])
    text = outcome["text"]
    assert outcome["type"] == "PackageShadowedError", outcome  # the driver checks before any worker starts
    assert f"{work / 'state.py'} {MARKER} 'state'" in text and "train_state.py" in text, text
    assert "runtime_env={'working_dir': '.'}" not in text, text  # shipping the directory would ship state.py too
    assert outcome["elapsed"] < 20, f"took {outcome['elapsed']:.1f} s: {text}"


@pytest.mark.slow  # ~14 s of Ray; the clear error itself stays covered by this module's process tests
def test_workers_alone_importing_a_state_py_end_the_run_at_the_first_with_the_clear_error(tmp_path):
    # the shadowing folder reaches only the workers (their runtime_env's PYTHONPATH puts it first): the driver's
    # own check cannot see it, and the first worker's import failure ends the run with the same clear error
    shadow, scripts = tmp_path / "shadow", tmp_path / "scripts"
    shadow.mkdir()
    scripts.mkdir()
    (shadow / "state.py").write_text("STEP = 0\n")
    body = DRIVER.replace('ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)',
                          f'ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, '
                          f'runtime_env={{"env_vars": {{"PYTHONPATH": "{shadow}:{ROOT}"}}}})')
    done, _ = run_script(scripts, body, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, done.stdout + done.stderr
    outcome = json.loads(lines[-1][len("OUTCOME "):])
    text = outcome["text"]
    assert outcome["type"] == "RunFailed", outcome
    assert f"{shadow / 'state.py'} {MARKER} 'state'" in text and "train_state.py" in text, text
    assert "could not start or load fn:" in text, text   # the first failure ends it (no second worker)
    assert "runtime_env={'working_dir': '.'}" not in text, text
    assert outcome["elapsed"] < 20, f"took {outcome['elapsed']:.1f} s: {text}"
