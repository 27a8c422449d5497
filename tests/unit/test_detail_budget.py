"""The hourly launch-detail budget (fleetd/node/detail.py, issue #40 point 7): windows
are charged for what they add past the one already open, cut to what is left, and
leave the budget an hour after they end (the rule charged to it: test_detail_rule.py)."""

from __future__ import annotations

import pytest

from fleetd.node.detail import DetailBudget


class Clock:
    """A settable monotonic clock, seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _open(budget: DetailBudget, seconds: float) -> float | None:
    """Ask for a window; the seconds it is open from now, or None when refused."""
    grant = budget.offer(seconds)
    if grant is None:
        return None
    budget.charge(grant)
    return grant.end - budget.clock()


def test_windows_are_charged_for_what_they_add_and_cut_to_what_is_left() -> None:
    clock = Clock()
    b = DetailBudget(30.0, clock)
    assert _open(b, 10) == 10 and b.used() == 10
    clock.now += 4
    assert _open(b, 10) == 10 and b.used() == 14  # 6 s were open already: 4 s added
    assert _open(b, 5) == 10 and b.used() == 14  # inside the open window: free
    clock.now += 10
    assert _open(b, 60) == 16 and b.used() == 30  # cut to the 16 s left
    assert b.json() == {"per_hour_s": 30.0, "used_s": 30.0, "remaining_s": 0.0}
    clock.now += 20  # the window has closed; nothing is left for an hour
    assert b.offer(5) is None


def test_time_leaves_the_budget_an_hour_after_its_window() -> None:
    clock = Clock()
    b = DetailBudget(30.0, clock)
    assert _open(b, 30) == 30 and b.offer(31) is None  # 1 s more than is open
    clock.now += 3600 + 10  # ten of the thirty seconds are more than an hour old
    assert b.used() == pytest.approx(20) and _open(b, 60) == pytest.approx(10)
    clock.now += 3600 + 30
    assert b.used() == 0 and b.spans == []
