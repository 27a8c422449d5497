"""The hourly launch-detail budget (fleetd/node/detail.py, issue #40 point 7): windows
are charged for what they add past the one already open, cut to what is left, and
leave the budget an hour after they end; the agent's own wait rule is charged too."""

from __future__ import annotations

import asyncio

import pytest

from fleetd.node import detail
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


class Tracer:
    """The tracer side of the rule: records what it was asked (always-on mode)."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def ask_detail(self, seconds: float) -> bool:
        self.asked.append(seconds)
        return True


def test_the_wait_rule_is_charged_and_stops_at_the_budget(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(detail, "CHECK_S", 0.01)
    budget = DetailBudget(15.0)  # the real monotonic clock: checks 10 ms apart
    tracer = Tracer()

    async def run() -> None:
        rule = asyncio.create_task(detail.watch_waits(tracer, lambda: detail.WAIT_NS,
                                                      budget))
        await asyncio.sleep(0.5)
        rule.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rule

    asyncio.run(run())
    # The first check opened 10 s; later ones add the time passed; after 5 s of
    # checks the rule would need more than is left: each asks at most what is left.
    assert tracer.asked[0] == pytest.approx(detail.HOLD_S, abs=0.05)
    assert budget.used() == pytest.approx(10.5, abs=0.3)
    # A budget of 10 s, less than the rule's hold: cut, then refused with one warning.
    budget, tracer = DetailBudget(10.0), Tracer()
    asyncio.run(run())
    assert tracer.asked == [pytest.approx(10.0, abs=0.05)] and budget.used() == 10
    spent = [r.getMessage() for r in caplog.records if "budget is spent" in r.getMessage()]
    assert len(spent) == 1, spent
