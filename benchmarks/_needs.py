"""What a benchmark needs, checked before it runs anything, and results that survive a later failure.

* :func:`require` / :func:`require_nccl`: raise ``SystemExit`` with a message naming what is missing,
  what needs it, how to install it and how to skip it, before the benchmark measures anything.
* :class:`Results`: lines printed the moment they are measured; :meth:`Results.part` runs one part of a
  benchmark and, if it fails, prints what was measured before, then the failure, and exits 1.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import traceback
from typing import Callable, Iterator

#: How to install each optional need (the README names the same extras).
INSTALL = {
    "ray.train": "pip install 'ray[train]'  (elastic-ring's own install, pip install -e ., pulls it in)",
    "matplotlib": "pip install -e '.[examples]'  (or pip install matplotlib)",
    "nccl": "pip install -e '.[gpu]'  (libnccl >= 2.25 from the nvidia-nccl-cu12 wheel) on a machine with CUDA",
}


def require(module: str, *, benchmark: str, why: str, install: str, skip: str | None = None) -> None:
    """Exit with a clear message if ``module`` does not import (``why``: what of the benchmark needs it)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(_missing(benchmark, why, f"{module}, which does not import here ({exc})", install,
                                  skip)) from None


def require_nccl(*, benchmark: str, why: str, skip: str | None = None) -> None:
    """Exit with a clear message unless CUDA and a libnccl that elastic_ring can use are present."""
    import torch

    import elastic_ring as er

    if not torch.cuda.is_available():
        raise SystemExit(_missing(benchmark, why, "CUDA (torch.cuda.is_available() is False here)", INSTALL["nccl"],
                                  skip))
    if not er.nccl_available():
        raise SystemExit(_missing(benchmark, why, "libnccl >= 2.25, which elastic_ring cannot load here",
                                  INSTALL["nccl"], skip))


def _missing(benchmark: str, why: str, what: str, install: str, skip: str | None) -> str:
    message = f"{benchmark}: {why} needs {what}; nothing was run. Install it: {install}"
    return message + (f"; or pass {skip}" if skip else "")


class Results:
    """A benchmark's result lines, each printed (flushed) as it is added and kept for the summary."""

    def __init__(self, benchmark: str) -> None:
        self.benchmark = benchmark
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        print(f"... {line}", flush=True)
        self.lines.append(line)

    def extend(self, lines: list[str]) -> None:
        for line in lines:
            self.add(line)

    @contextlib.contextmanager
    def part(self, name: str, partial: Callable[[], None] | None = None) -> Iterator[None]:
        """Run one part; on a failure (or Ctrl-C) print what was measured (``partial()``, else the lines so far),
        then the failure, and exit 1."""
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:
            print(f"\n{self.benchmark}: {name} failed; what was measured before it:", flush=True)
            if partial is not None:
                partial()
            else:
                print("\n".join(self.lines) if self.lines else "(nothing)", flush=True)
            print(f"\n{self.benchmark}: {name} failed with {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            traceback.print_exc()
            raise SystemExit(1) from exc
