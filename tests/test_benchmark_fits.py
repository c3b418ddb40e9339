"""The pure pieces of benchmarks.scale and benchmarks.control_plane: the fitted exponents and the result lines."""

from __future__ import annotations

import math

import pytest

from benchmarks import control_plane
from benchmarks.scale import power_fit


@pytest.mark.parametrize("k", [0.5, 1.0, 2.0, 3.0])
def test_power_fit_finds_the_exponent_of_an_exact_power_law(k):
    xs = [2, 4, 8, 16, 32, 64]
    c, fitted, used = power_fit(xs, [0.003 * x ** k for x in xs])
    assert fitted == pytest.approx(k) and c == pytest.approx(0.003)
    assert used == [8, 16, 32, 64]  # the small worlds, where fixed costs dominate, are left out


def test_power_fit_uses_every_world_when_few_are_large_and_refuses_what_it_cannot_fit():
    assert power_fit([2, 4, 8], [1.0, 2.0, 4.0])[2] == [2, 4, 8]
    assert power_fit([2, 4], [1.0, 4.0])[1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        power_fit([2, 4], [0.0, 1.0])
    with pytest.raises(ValueError, match="two or more"):
        power_fit([8], [1.0])


@pytest.mark.parametrize("ns, values, k", [
    ([32, 128, 512, 1024], [0.01 * n for n in [32, 128, 512, 1024]], 1.0),
    ([32, 128, 512, 1024], [1e-5 * n * n for n in [32, 128, 512, 1024]], 2.0),
    ([32, 128], [None, 3.0], None),  # one point: no exponent
])
def test_control_plane_exponent(ns, values, k):
    got = control_plane.exponent(ns, values)
    assert (got is None) if k is None else got == pytest.approx(k)


def test_a_result_line_reads_back_as_written():
    figures = {"driver_cpu_per_s": 0.0421, "loss_to_spec_s": 0.0146, "store_ops_per_reform": 811.4,
               "notice_to_all_s": 0.1658, "heartbeat_lag_s": 0.000699, "load": 16.5}
    line = control_plane.format_line(1024, figures)
    assert line.startswith("workers=1024 driver_cpu_per_s=0.0421 loss_to_spec_s=0.0146 store_ops_per_reform=811 "
                           "notice_to_all_s=0.1658 heartbeat_lag_s=0.000699")
    n, back = control_plane.parse_line(line)
    assert n == 1024 and back["store_ops_per_reform"] == 811
    assert all(math.isclose(back[k], v, rel_tol=1e-3) for k, v in figures.items() if k != "store_ops_per_reform")
    with pytest.raises(ValueError, match="not a control_plane result line"):
        control_plane.parse_line("loss_to_spec_s=1")
