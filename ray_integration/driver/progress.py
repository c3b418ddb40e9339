"""The driver's progress display, fed by rank 0's ``er.report`` records.

``progress=None`` (the default): a tqdm bar when stderr is a terminal, else one
plain line every :data:`PROGRESS_INTERVAL_S` seconds (logs stay readable in
files and CI). ``True``: always the bar. ``False``: nothing.

Shown: step, epoch, loss (when reported), world size and samples per second.
Step, epoch and samples come with every record when the job uses
``ElasticSampler`` (or calls ``elastic_ring.core.progress.set_progress``); samples/s is the change of
``samples`` over the last :data:`RATE_WINDOW_S` seconds, so a rollback or a
resize shows up in it at once.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any, TextIO

#: Seconds between plain progress lines (when the output is not a terminal).
PROGRESS_INTERVAL_S = 5.0
#: Seconds between redraws of the bar.
BAR_REFRESH_S = 0.25
#: Seconds of records that samples/s is averaged over.
RATE_WINDOW_S = 10.0

_NOT_SHOWN = {"time", "driver_time", "rank", "round", "world_size", "step", "epoch", "samples", "loss"}


def _format(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ProgressDisplay:
    def __init__(self, mode: bool | None, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if mode is False:
            self.kind = "off"
        elif mode is True or self.stream.isatty():
            self.kind = "bar"
        else:
            self.kind = "lines"
        self._bar = None
        self._seen = 0
        self._last_output = 0.0
        self._window: deque[tuple[float, int]] = deque()

    def _rate(self, record: dict) -> float | None:
        samples, now = record.get("samples"), record.get("driver_time", record.get("time"))
        if samples is None or now is None:
            return None
        if self._window and samples < self._window[-1][1]:
            self._window.clear()  # rolled back to an earlier commit
        self._window.append((now, samples))
        while len(self._window) > 2 and now - self._window[0][0] > RATE_WINDOW_S:
            self._window.popleft()
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def text(self, record: dict, world_size: int | None, rate: float | None) -> str:
        parts = [f"{k} {_format(record[k])}" for k in ("step", "epoch", "loss") if k in record]
        parts.append(f"world {world_size if world_size is not None else record.get('world_size')}")
        if rate is not None:
            parts.append(f"{rate:.0f} samples/s")
        parts += [f"{k} {_format(v)}" for k, v in record.items() if k not in _NOT_SHOWN]
        return " ".join(parts)

    def update(self, metrics: list[dict], world_size: int | None) -> None:
        if self.kind == "off":
            return
        rate = None
        for record in metrics[self._seen:]:
            rate = self._rate(record)
        if len(metrics) == self._seen:
            return
        self._seen = len(metrics)
        now = time.monotonic()
        interval = BAR_REFRESH_S if self.kind == "bar" else PROGRESS_INTERVAL_S
        if now - self._last_output < interval:
            return
        self._last_output = now
        record = metrics[-1]
        if self.kind == "lines":
            print(f"[elastic_ring round {record.get('round')}] {self.text(record, world_size, rate)}",
                  file=self.stream, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=None, unit="step", desc="elastic_ring", file=self.stream, dynamic_ncols=True)
        self._bar.n = int(record.get("step", self._seen))
        self._bar.set_postfix_str(self.text({k: v for k, v in record.items() if k != "step"}, world_size, rate),
                                  refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
