"""Count the Python function calls a piece of code makes (benchmarks only).

A step's Python calls are a measure of its host overhead that does not move with the machine's load, unlike
its time: ``benchmarks.step`` prints them for ours and for DDP. A *call* is a Python frame that starts or
resumes (a function, a comprehension, each resumption of a generator); calls into C (torch ops, builtins)
are not counted.

* Python >= 3.12: :mod:`sys.monitoring` (``PY_START`` and ``PY_RESUME``) sees every thread, so gradient hooks
  that autograd runs on its own device threads (CUDA) are counted too.
* Python 3.11: :func:`sys.setprofile` sees the calling thread only. On CPU autograd runs backward (and its
  hooks) on the thread that called ``backward()``, so a CPU step is counted whole; on CUDA the hooks are not.

Where the counts come from is reported (:attr:`CallCounter.scope`), so a table can say which it printed.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Callable


class CallCounter:
    """``with CallCounter() as c: ...`` then ``c.calls`` (and ``c.by_function`` when ``detail``)."""

    def __init__(self, detail: bool = False) -> None:
        self.calls = 0
        self.detail = detail
        self.by_function: Counter = Counter()
        monitoring = getattr(sys, "monitoring", None)
        self.scope = "all threads (sys.monitoring)" if monitoring is not None else "calling thread (sys.setprofile)"
        self._tool: int | None = None

    def __enter__(self) -> "CallCounter":
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is not None:
            self._start_monitoring(monitoring)
        else:
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        monitoring = getattr(sys, "monitoring", None)
        self.calls -= 1  # this method's own frame was counted
        if self.detail:
            self.by_function[(__file__.rsplit("/", 1)[-1], "__exit__")] -= 1
        if monitoring is not None and self._tool is not None:
            monitoring.set_events(self._tool, 0)
            monitoring.register_callback(self._tool, monitoring.events.PY_START, None)
            monitoring.register_callback(self._tool, monitoring.events.PY_RESUME, None)
            monitoring.free_tool_id(self._tool)
            self._tool = None
        else:
            sys.setprofile(None)

    # ------------------------------------------------------------ Python >= 3.12
    def _start_monitoring(self, monitoring) -> None:
        for tool in (monitoring.PROFILER_ID, 5, 4, 3):
            if monitoring.get_tool(tool) is None:
                break
        else:
            raise RuntimeError("no free sys.monitoring tool id to count Python calls with")
        monitoring.use_tool_id(tool, "elastic-ring-benchmark-call-counter")
        self._tool = tool
        events = monitoring.events
        monitoring.register_callback(tool, events.PY_START, self._monitor)
        monitoring.register_callback(tool, events.PY_RESUME, self._monitor)
        monitoring.set_events(tool, events.PY_START | events.PY_RESUME)

    def _monitor(self, code, offset) -> None:
        self.calls += 1
        if self.detail:
            self.by_function[(code.co_filename.rsplit("/", 1)[-1], code.co_name)] += 1

    # ------------------------------------------------------------ Python 3.11
    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            self.calls += 1
            if self.detail:
                code = frame.f_code
                self.by_function[(code.co_filename.rsplit("/", 1)[-1], code.co_name)] += 1


def calls_per_run(fn: Callable[[], object], runs: int) -> float:
    """Python calls per run of ``fn``, averaged over ``runs`` runs."""
    with CallCounter() as counter:
        for _ in range(runs):
            fn()
    return counter.calls / runs
