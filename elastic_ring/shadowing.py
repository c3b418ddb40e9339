"""A clear error when a user's module takes the name of one of our top-level packages.

``elastic_ring``, ``state`` and ``ray_integration`` are top-level names, and ``state.py`` beside a training
script is a very common file. Python imports whatever comes first on ``sys.path`` (or whatever was
imported first), so such a file *shadows* our package, and the failure surfaces later as
``No module named 'state.checkpoints'; 'state' is not a package``. On Ray, the driver's working
directory and script directory come first on every worker's ``sys.path``, so a file there breaks every
worker even when the driver imports fine.

``state/__init__.py`` and ``ray_integration/__init__.py`` call :func:`check` on the packages they
import, before they import them: a :class:`PackageShadowedError` (an ``ImportError``) names the file
and the fix instead. This module uses the standard library only and imports nothing of the project, so
that they can load it from its file even when the name ``elastic_ring`` itself is taken.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Iterable

#: Our top-level packages, each with a file that only our copy of it holds. A package is ours when it
#: is a regular package with that file; where it lives does not matter (``runtime_env={"py_modules":
#: [...]}`` ships each package to a directory of its own).
PACKAGES = {"elastic_ring": "shadowing.py", "state": "step_link.py", "ray_integration": "trainer.py"}

#: In every message of :class:`PackageShadowedError`, and stable: the driver can look for it in the
#: text of a worker's start failure.
MARKER = "shadows elastic_ring's package"

_RAY_NOTE = ("On Ray, the driver's working directory and script directory come first on every worker's sys.path: "
             "a file there shadows the package on the workers even when the driver imports fine.")


class PackageShadowedError(ImportError):
    """One of our package names resolves to something else (a user's ``state.py``, a folder, a stale
    ``.pyc``): ``path`` is that file or folder, ``name`` the package name."""


def check(*names: str) -> None:
    """Raise :class:`PackageShadowedError` if one of ``names`` (our package names) is, or would be
    imported as, something other than our package. Imports nothing: it looks at ``sys.modules`` and
    asks the import system where the name would come from."""
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            origin, locations = getattr(module, "__file__", None), list(getattr(module, "__path__", None) or [])
            how = f"Python imported it as '{name}' before elastic_ring's package, so `import {name}` returns it"
        else:
            spec = importlib.util.find_spec(name)
            if spec is None:
                continue  # not found at all: the import itself says so
            origin, locations = _spec_location(spec)
            how = f"Python finds it first on sys.path, so `import {name}` does not reach elastic_ring's"
        if not _is_ours(name, origin, locations):
            raise _error(name, origin, locations, how)


def check_path_prefix(entries: Iterable[str], names: Iterable[str] = tuple(PACKAGES)) -> None:
    """Raise :class:`PackageShadowedError` if a process whose ``sys.path`` starts with ``entries`` (then
    this process's ``sys.path``) would import one of ``names`` as something other than our package.

    For a driver, before it starts workers: Ray puts the driver's working directory and script directory
    (or the runtime_env's working_dir) first on the workers' ``sys.path``, and a ``state.py`` there is not
    on the driver's own path when it was started as ``python path/to/script.py``."""
    entries = [os.path.abspath(entry) for entry in entries if entry]
    for name in names:
        spec = importlib.machinery.PathFinder.find_spec(name, entries + list(sys.path))
        if spec is None:
            continue  # not on the path: ours comes from an installed finder (pip install -e), which is fine
        origin, locations = _spec_location(spec)
        if not _is_ours(name, origin, locations):
            path = _location(origin, locations)
            entry = next((e for e in entries if path.startswith(e.rstrip(os.sep) + os.sep)), None)
            first = f"Ray puts {entry} first on the workers' sys.path" if entry else "it comes first on sys.path"
            how = f"{first}, so `import {name}` on the workers would not reach elastic_ring's"
            raise _error(name, origin, locations, how, ray_note=False)


def _spec_location(spec: importlib.machinery.ModuleSpec) -> tuple[str | None, list[str]]:
    origin = spec.origin if spec.has_location else None
    return origin, list(spec.submodule_search_locations or [])


def _is_ours(name: str, origin: str | None, locations: list[str]) -> bool:
    if not locations or not origin or not os.path.basename(origin).startswith("__init__."):
        return False  # a plain module, a stale .pyc, or a folder without __init__.py: none of ours is that
    folder = os.path.dirname(origin)
    if not os.path.isdir(folder):
        return True  # inside a zip or another importer: nothing to compare, so trust it
    stem = os.path.splitext(PACKAGES[name])[0]
    return any(os.path.exists(os.path.join(folder, stem + ext)) for ext in (".py", ".pyc"))


def _location(origin: str | None, locations: list[str]) -> str:
    if locations and origin and os.path.basename(origin).startswith("__init__."):
        return os.path.dirname(origin) + os.sep   # a package: its folder
    if locations:
        return locations[0] + os.sep              # a folder without __init__.py (a namespace package)
    return origin or "<unknown location>"


def _error(name: str, origin: str | None, locations: list[str], how: str,
           ray_note: bool = True) -> PackageShadowedError:
    path = _location(origin, locations)
    new = f"train_{name}"
    if path.endswith(os.sep):
        what = f"The folder {path}" if origin else f"The folder {path} (no __init__.py: a namespace package)"
        fix = f"rename the folder, e.g. {name}/ -> {new}/ (and change your imports of it)"
    elif path.endswith(".pyc"):
        what = f"The stale compiled file {path}"
        fix = f"delete that file (its {name}.py is gone), or rename the module it was compiled from"
    else:
        what = f"The file {path}"
        fix = (f"rename it, e.g. {os.path.basename(path)} -> {new}{os.path.splitext(path)[1]} (and "
               f"`import {new}` where you import it), and delete a stale __pycache__/{name}.*.pyc beside it")
    message = f"{what} {MARKER} '{name}': {how}. Fix: {fix}." + (f" {_RAY_NOTE}" if ray_note else "")
    return PackageShadowedError(message, name=name, path=path)


__all__ = ["MARKER", "PACKAGES", "PackageShadowedError", "check", "check_path_prefix"]
