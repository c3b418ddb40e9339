"""The driver's progress display: a tqdm bar on a terminal, plain lines every few seconds
otherwise, nothing with progress=False; samples/s from the records' samples and times."""

import io

import pytest

from ray_integration.driver import progress as progress_mod
from ray_integration.driver.progress import ProgressDisplay


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def records(n, start=0.0, samples_per_s=64.0):
    return [{"time": start + i, "rank": 0, "round": 2, "world_size": 2, "step": i + 1, "epoch": 0,
             "samples": int((i + 1) * samples_per_s), "loss": 1.0 / (i + 1), "lr": 0.1} for i in range(n)]


def test_not_a_terminal_gives_plain_lines_every_few_seconds(monkeypatch):
    out = io.StringIO()
    display = ProgressDisplay(None, out)
    assert display.kind == "lines"
    metrics = records(5)
    display.update(metrics[:3], 2)
    display.update(metrics, 2)  # within PROGRESS_INTERVAL_S: no second line
    lines = out.getvalue().splitlines()
    assert lines == ["[elastic_ring round 2] step 3 epoch 0 loss 0.3333 world 2 64 samples/s lr 0.1"], lines
    monkeypatch.setattr(progress_mod, "PROGRESS_INTERVAL_S", 0.0)
    display.update(records(6), 3)
    assert out.getvalue().splitlines()[-1].startswith("[elastic_ring round 2] step 6 epoch 0 loss 0.1667 world 3")


def test_terminal_gives_a_tqdm_bar_and_false_gives_nothing():
    tty = Terminal()
    display = ProgressDisplay(None, tty)
    assert display.kind == "bar"
    display.update(records(4), 2)
    display.close()
    text = tty.getvalue()
    assert "elastic_ring" in text and "4step" in text.replace(" ", "") and "world 2" in text and "samples/s" in text
    quiet = Terminal()
    off = ProgressDisplay(False, quiet)
    off.update(records(4), 2)
    off.close()
    assert off.kind == "off" and quiet.getvalue() == ""


def test_rate_restarts_after_a_rollback():
    display = ProgressDisplay(False, io.StringIO())
    assert display._rate({"time": 0.0, "samples": 0}) is None
    assert display._rate({"time": 1.0, "samples": 100}) == pytest.approx(100.0)
    assert display._rate({"time": 2.0, "samples": 40}) is None  # restored to an earlier commit
    assert display._rate({"time": 3.0, "samples": 90}) == pytest.approx(50.0)
