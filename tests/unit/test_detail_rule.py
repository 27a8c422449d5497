"""The agent's own rule for launch detail (fleetd.node.detail.watch_waits): while a local
rank has waited in a collective for WAIT_NS or more, the window is held open, within the
node's hourly launch-detail budget, which its windows are charged to.

The tracer is a recording test double (AskLog): the real ask reaches the duty cycle
(tests/unit/test_dutycycle.py) and the live agent (tests/integration/test_detail_window.py).
"""

from __future__ import annotations

import asyncio

import pytest

from fleetd.node import detail


class AskLog:
    """Test double for the agent's tracer: records each ask."""

    def __init__(self) -> None:
        self.asks: list[float] = []

    def ask_detail(self, seconds: float) -> bool:
        self.asks.append(seconds)
        return True


async def _run(waits: list[int]) -> AskLog:
    tracer, left = AskLog(), list(waits)

    def waited() -> int:
        return left.pop(0) if left else 0

    task = asyncio.get_running_loop().create_task(
        detail.watch_waits(tracer, waited, detail.DetailBudget(3600)))
    while left:  # every wait was measured (however slow this machine is)
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)
    task.cancel()
    return tracer


def test_a_long_wait_holds_the_window_and_a_short_one_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detail, "CHECK_S", 0.005)
    w = detail.WAIT_NS
    tracer = asyncio.run(_run([0, w // 2, w, 3 * w, 0]))
    # Each ask holds the window HOLD_S from now (the second adds only the time passed).
    assert tracer.asks == [pytest.approx(detail.HOLD_S, abs=0.05)] * 2


def test_no_wait_asks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detail, "CHECK_S", 0.005)
    assert asyncio.run(_run([0, 0, detail.WAIT_NS - 1])).asks == []


def test_a_tracer_without_a_duty_cycle_ends_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """--mode full: the first ask is refused, and the rule stops checking."""
    monkeypatch.setattr(detail, "CHECK_S", 0.005)

    class Full(AskLog):
        def ask_detail(self, seconds: float) -> bool:
            self.asks.append(seconds)
            return False

    async def run() -> Full:
        tracer = Full()
        await asyncio.wait_for(detail.watch_waits(tracer, lambda: detail.WAIT_NS,
                                                  detail.DetailBudget(3600)), 5)
        return tracer

    assert asyncio.run(run()).asks == [pytest.approx(detail.HOLD_S, abs=0.05)]


def test_the_rule_is_charged_to_the_budget_and_stops_at_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(detail, "CHECK_S", 0.01)
    budget, tracer = detail.DetailBudget(15.0), AskLog()  # the real monotonic clock

    async def run() -> None:
        rule = asyncio.create_task(detail.watch_waits(tracer, lambda: detail.WAIT_NS,
                                                      budget))
        await asyncio.sleep(0.5)
        rule.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rule

    asyncio.run(run())
    # The first check opened HOLD_S; each later one added the time passed since.
    assert tracer.asks[0] == pytest.approx(detail.HOLD_S, abs=0.05)
    assert budget.used() == pytest.approx(10.5, abs=0.3)
    # A budget of 10 s: the first window takes it all, then one warning and no more asks.
    budget, tracer = detail.DetailBudget(10.0), AskLog()
    asyncio.run(run())
    assert tracer.asks == [pytest.approx(10.0, abs=0.05)] and budget.used() == 10
    spent = [r.getMessage() for r in caplog.records if "budget is spent" in r.getMessage()]
    assert len(spent) == 1, spent
