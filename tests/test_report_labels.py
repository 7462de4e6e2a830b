"""wmtp.report.labels: a number is printed to the precision its interval supports, and not at all when
its interval holds no effect."""

from __future__ import annotations

import math

import pytest

from wmtp.report import labels


@pytest.mark.parametrize(
    ("lo", "hi", "step"),
    [(0.048, 0.112, 0.01), (1.581, 1.629, 0.001), (0.7, 1.0, 0.01), (-4250, 14456, 1000), (3.0, 9.0, 1.0)],
)
def test_the_step_follows_the_half_width(lo: float, hi: float, step: float):
    assert labels.interval_step(lo, hi) == pytest.approx(step)


def test_a_resolved_change_is_rounded_to_its_interval():
    assert labels.fmt_interval(0.0803, 0.048, 0.112, null=0.0) == "0.08 [0.05, 0.11]"
    assert labels.fmt_interval(1.6049, 1.581, 1.629, null=1.0) == "1.605 [1.581, 1.629]"
    assert labels.fmt_interval(-12.34, -20.1, -4.9) == "−12 [−20, −5]"


def test_an_interval_that_holds_no_effect_is_not_resolved_and_prints_no_point():
    text = labels.fmt_interval(1961.2, -4250.3, 14456.0, null=0.0)
    assert text == "not resolved [−4,000, 14,000]"
    assert "1961" not in text and "1,961" not in text
    # the same interval without a null is a number, but only to the thousand
    assert labels.fmt_interval(1961.2, -4250.3, 14456.0) == "2,000 [−4,000, 14,000]"
    assert labels.fmt_interval(1.02, 0.97, 1.08, null=1.0).startswith("not resolved")


def test_missing_numbers_print_nothing_and_a_missing_interval_the_point():
    assert labels.fmt_interval(math.nan, 0.1, 0.2) == ""
    assert labels.fmt_interval(0.5, math.nan, math.nan) == "0.5"
    assert labels.fmt_ci(2.0, 2.0, 2.0) == "2"
