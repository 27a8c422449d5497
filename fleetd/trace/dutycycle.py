"""The always-on mode's duty cycle (``--mode always-on``, #36).

The launch probes (the entry-only launches' uprobe session links, probes.Attacher) are
attached for ``on_ns`` at the start of every ``period_ns``; every other probe (syncs,
copies, allocations, graphs, NCCL, the scheduler and the rest of the host layer) stays
attached all the time. The period is the aggregate window's length, so each window holds
one on-period: its launch histograms are scaled by window / time the probes were on
(fleetd.trace.accounting), and marked with that time (aggregate bucket -4).

A window can also be opened on demand (``hold``): the probes go on at once and stay on
until the hold ends, whatever the period says; the agent opens one while a local NCCL
rank waits in a collective, and when ``fleetd watch`` asks a node for detail
(fleetd/node/detail.py). The on-time is counted the same way, so scaling stays right.

What it misses: launch records (arguments, kernel names, stacks, errors, slow launches)
outside the on-periods, and the launch rate's changes inside a period. A window that
could not switch (no session links: an older kernel, per-symbol probes) is traced
continuously and not scaled.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("fleetd.trace.dutycycle")

MODES = ("full", "always-on")


class Switch(Protocol):
    def set_launches(self, on: bool) -> bool: ...


class DutyCycle:
    """Turns the launch probes on and off from the tracer's poll loop, and keeps how
    long they were on in each aggregate window."""

    def __init__(self, switch: Switch, on_ns: int, period_ns: int, start_ns: int) -> None:
        if not 0 < on_ns <= period_ns:
            raise ValueError(f"duty cycle on {on_ns} ns of {period_ns}: not 0 < on <= period")
        self._switch = switch
        self.on_ns, self.period_ns = on_ns, period_ns
        self._cycle = start_ns  # start of the current period
        self._on_since: int | None = start_ns  # the probes are on from the start
        self._counted = 0  # on-time in the current window, up to _on_since
        self._held_until = 0  # a window opened on demand keeps the probes on until then
        self._asked_ns = 0  # a window asked for from another thread, for the next tick
        self.switchable = True

    def hold(self, now: int, for_ns: int) -> None:
        """Open a window at once, for ``for_ns`` from ``now`` (extending a longer one
        already open is a no-op). Called from the tracer's poll thread."""
        self._held_until = max(self._held_until, now + for_ns)
        if self.switchable and self._on_since is None:
            self._on_since = now
            self.switchable = self._switch.set_launches(True)

    def ask(self, for_ns: int) -> None:
        """Open a window for ``for_ns`` at the next poll (at most 100 ms later). Any
        thread may call it: the switch itself stays on the poll thread."""
        self._asked_ns = max(self._asked_ns, for_ns)

    def tick(self, now: int) -> None:
        """Called on every poll: switch when the period says so (a poll's latency late,
        which the on-time counts as it really was)."""
        asked, self._asked_ns = self._asked_ns, 0
        if asked:
            self.hold(now, asked)
        if not self.switchable:
            return
        if self._on_since is not None and now >= max(self._cycle + self.on_ns,
                                                      self._held_until):
            self._counted += now - self._on_since
            self._on_since = None
            self.switchable = self._switch.set_launches(False)
            if not self.switchable:
                log.info("no launch probes to switch: launches traced continuously")
            # A hold that ran past the period used up its on-period: the next opens at
            # the next period's start, not at once.
            self._to_period_of(now)
        elif self._on_since is None and now >= self._cycle + self.period_ns:
            self._to_period_of(now)
            self._on_since = now
            self._switch.set_launches(True)

    def _to_period_of(self, now: int) -> None:
        """The current period becomes the one ``now`` falls in (whole periods only)."""
        self._cycle += self.period_ns * ((now - self._cycle) // self.period_ns)

    def take_on_ns(self, now: int, window_ns: int) -> int | None:
        """The launch probes' on-time in the window ending at ``now`` (then a new window
        starts); None when they were on all along (nothing to scale)."""
        if not self.switchable:
            return None
        on = self._counted
        if self._on_since is not None:
            on += now - self._on_since
            self._on_since = now
        self._counted = 0
        return None if on >= window_ns else on
