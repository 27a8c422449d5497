"""The always-on mode's duty cycle (fleetd.trace.dutycycle): when the launch probes are on,
and how long they were on in each window, including windows opened on demand.

The probes' switch is a recording test double (SwitchLog): the real one attaches and
detaches uprobe session links (probes.Attacher.set_launches, exercised live by
tests/integration/test_always_on.py); here only the schedule is under test.
"""

from __future__ import annotations

import threading

from fleetd.trace.dutycycle import DutyCycle

S = 1_000_000_000


class SwitchLog:
    """Test double for probes.Attacher: records each switch and reports success."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_launches(self, on: bool) -> bool:
        self.calls.append(on)
        return True

    @property
    def on(self) -> bool:
        return self.calls[-1] if self.calls else True


def _cycle() -> tuple[DutyCycle, SwitchLog]:
    sw = SwitchLog()
    return DutyCycle(sw, 1 * S, 10 * S, 0), sw


def test_probes_are_on_one_second_in_ten() -> None:
    d, sw = _cycle()
    d.tick(S // 2)
    assert sw.on
    d.tick(S + 1)
    assert not sw.on
    d.tick(9 * S)
    assert not sw.on
    d.tick(10 * S + 5)
    assert sw.on
    assert d.take_on_ns(10 * S + 5, 10 * S) == S + 1  # the new on-period starts at 10 s + 5


def test_a_window_asked_for_opens_at_once_and_lasts() -> None:
    d, sw = _cycle()
    d.tick(S + 1)  # the period's on-time is over
    assert not sw.on
    d.ask(3 * S)
    d.tick(4 * S)  # applied at the next poll
    assert sw.on
    d.tick(6 * S)
    assert sw.on  # still held: 4 s + 3 s
    d.tick(7 * S)
    assert not sw.on
    # on-time: the first second, then 4 s .. 7 s
    assert d.take_on_ns(10 * S, 10 * S) == (S + 1) + 3 * S


def test_a_hold_keeps_the_probes_on_past_the_periods_on_time() -> None:
    d, sw = _cycle()
    d.hold(S // 2, 5 * S)
    d.tick(2 * S)
    assert sw.on
    d.tick(5 * S + S // 2)
    assert not sw.on
    assert d.take_on_ns(10 * S, 10 * S) == 5 * S + S // 2


def test_a_hold_past_the_period_does_not_reopen_at_once() -> None:
    d, sw = _cycle()
    d.tick(S + 1)
    d.hold(9 * S, 3 * S)  # on from 9 s to 12 s, across the 10 s boundary
    d.tick(10 * S + 1)
    assert sw.on
    d.tick(12 * S)
    assert not sw.on
    d.tick(12 * S + 1)  # the 10 s period's on-time was used by the hold
    assert not sw.on
    d.tick(20 * S)
    assert sw.on


def test_ask_from_another_thread_is_taken_by_the_poll() -> None:
    d, sw = _cycle()
    d.tick(2 * S)
    t = threading.Thread(target=d.ask, args=(2 * S,))
    t.start()
    t.join()
    assert not sw.on  # nothing switched outside the poll thread
    d.tick(3 * S)
    assert sw.on


def test_an_ask_does_not_shorten_a_longer_hold() -> None:
    d, sw = _cycle()
    d.tick(2 * S)
    d.hold(2 * S, 5 * S)
    d.ask(S)
    d.tick(4 * S)
    assert sw.on
    d.tick(7 * S)
    assert not sw.on
