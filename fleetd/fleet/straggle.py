"""Stragglers seen live by ``fleetd watch``: each poll's ranks answers judged for the rank
that enters last (:mod:`fleetd.analyze.distributed.lateness`), with hysteresis, and the late rank's
top host cause asked of its node.

A rank is flagged once the rule has called it late at :data:`FLAG_POLLS` consecutive
polls, and recovers once it has not for :data:`CALM_POLLS` (no flapping on a rank that
is late at half the polls). While a flagged rank has no named cause, its node is asked
for the rank's top causal chain over the straggle's own seconds (``GET /api/v1/chains``,
as a hang's culprit is: :mod:`fleetd.fleet.chains`), at most every :data:`CAUSE_EVERY_S`;
the first chain with a root cause names it. The window starts :data:`CAUSE_LEAD_S` before
the first poll that called the rank late (at least :data:`CAUSE_MIN_S`, at most
:data:`CAUSE_SINCE_S` long): the rank's seconds before it turned late are the same for
every rank of the job (a CPU they all share) and would outweigh what changed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from fleetd.analyze.distributed.hangs import RankView
from fleetd.analyze.distributed.lateness import Lateness, lateness
from fleetd.fleet.chains import chains_of
from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer
from fleetd.wire.ranks import TopChain

log = logging.getLogger("fleetd.fleet.straggle")

FLAG_POLLS = 2  # consecutive polls late before a rank is flagged
CALM_POLLS = 3  # consecutive polls not late before it recovers
CAUSE_EVERY_S = 2.0  # a flagged rank's node asked again for its chain, until it names one
CAUSE_SINCE_S = 15  # the chain window at most: the straggle's own seconds, not the minutes before
CAUSE_MIN_S = 5  # ...and at least (a sampled cgroup, a few steps)
CAUSE_LEAD_S = 2  # ...from this long before the first poll that called the rank late


class StragglerJson(TypedDict):
    """One flagged rank (``fleetd watch --format json``; docs/json.md)."""

    kind: str  # "straggler"
    key: str
    group: str
    matching: str
    node: str
    pid: int
    comm: str | None
    rank: int
    job: str | None
    ratio: float  # share of the window's collectives it entered last
    late_ms: float  # median time it entered after the next rank, at those
    collectives: int
    summary: str
    top_chain: TopChain | None


@dataclass
class _Open:
    found: StragglerJson
    calm: int = 0
    asked: float = 0.0  # monotonic time its node was last asked for a chain
    began: float = 0.0  # monotonic time of the first poll that called it late


@dataclass
class Changes:
    """What one poll turned: ranks newly flagged, flagged ranks whose cause was just
    named, ranks that recovered."""

    flagged: list[StragglerJson] = field(default_factory=list)
    named: list[StragglerJson] = field(default_factory=list)
    recovered: list[StragglerJson] = field(default_factory=list)


@dataclass
class StraggleWatch:
    """The stragglers of a watch: per poll, which ranks turned late, and which recovered."""

    flag_polls: int = FLAG_POLLS
    calm_polls: int = CALM_POLLS
    streak: dict[str, int] = field(default_factory=dict)  # key -> consecutive late polls
    began: dict[str, float] = field(default_factory=dict)  # key -> the streak's first poll
    open: dict[str, _Open] = field(default_factory=dict)
    changes: Changes = field(default_factory=Changes)  # the last poll's

    async def poll(self, answer: FleetAnswer, client: FleetClient,
                   views: Sequence[RankView], age_error_s: float | None) -> Changes:
        """One poll: judge the ranks, then ask for the causes still unnamed."""
        flagged, recovered = self.update(views, age_error_s)
        self.changes = Changes(flagged, await self.causes(answer, client), recovered)
        return self.changes

    def update(self, views: Sequence[RankView], age_error_s: float | None
               ) -> tuple[list[StragglerJson], list[StragglerJson]]:
        """This poll's ranks in; (newly flagged, recovered) out."""
        err = None if age_error_s is None else int(age_error_s * 1e9)
        judged = lateness(views, age_error_ns=err)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("lateness: %s", "; ".join(
                f"rank {x.rank} last {x.last}/{x.collectives} by {x.late_ns / 1e6:.1f} ms, "
                f"step {x.step_ns / 1e6:.1f} ms" for x in judged))
        late = {_key(x): x for x in judged if x.late}
        flagged: list[StragglerJson] = []
        for key, x in late.items():
            self.streak[key] = self.streak.get(key, 0) + 1
            self.began.setdefault(key, time.monotonic())
            if key in self.open:
                self.open[key].calm = 0
                _refresh(self.open[key].found, x)
            elif self.streak[key] >= self.flag_polls:
                self.open[key] = _Open(_json(key, x), began=self.began[key])
                flagged.append(self.open[key].found)
        for key in [k for k in self.streak if k not in late]:
            del self.streak[key]
            self.began.pop(key, None)
        recovered: list[StragglerJson] = []
        for key in [k for k in self.open if k not in late]:
            o = self.open[key]
            o.calm += 1
            if o.calm >= self.calm_polls:
                recovered.append(self.open.pop(key).found)
        return flagged, recovered

    def current(self) -> list[StragglerJson]:
        return [o.found for o in self.open.values()]

    async def causes(self, answer: FleetAnswer, client: FleetClient) -> list[StragglerJson]:
        """Ask the nodes of flagged ranks without a cause for their top chain; the ones
        that got a root cause now."""
        now = time.monotonic()
        due = [o for o in self.open.values() if not _named(o.found)
               and now - o.asked >= CAUSE_EVERY_S]
        if not due:
            return []
        for o in due:
            o.asked = now
        found = {}
        for since, group in _by_window(due, now).items():
            found.update(await chains_of(
                answer, client, [(o.found["node"], o.found["pid"]) for o in group], since))
        named = []
        for o in due:
            chain = found.get((o.found["node"], o.found["pid"]))
            if chain is not None and chain.get("root_cause"):
                o.found["top_chain"] = chain
                named.append(o.found)
        return named


def _by_window(due: list[_Open], now: float) -> dict[str, list[_Open]]:
    """The flagged ranks by the chain window each is asked for (``"7s"``): from
    CAUSE_LEAD_S before its streak began, within [CAUSE_MIN_S, CAUSE_SINCE_S]."""
    out: dict[str, list[_Open]] = {}
    for o in due:
        s = min(CAUSE_SINCE_S, max(CAUSE_MIN_S, math.ceil(now - o.began + CAUSE_LEAD_S)))
        out.setdefault(f"{s}s", []).append(o)
    return out


def _key(x: Lateness) -> str:
    return f"straggler:{x.key}:{x.rank}"


def _named(s: StragglerJson) -> bool:
    chain = s["top_chain"]
    return bool(chain and chain["root_cause"])


def _summary(x: Lateness) -> str:
    v = x.view
    return (f"rank {x.rank} ({v.node} pid {v.pid}) of {x.group} entered last at "
            f"{x.last} of its last {x.collectives} collectives, "
            f"{x.late_ns / 1e6:.1f} ms after the next rank (median)")


def _json(key: str, x: Lateness) -> StragglerJson:
    v = x.view
    return StragglerJson(kind="straggler", key=key, group=x.group, matching=x.matching,
                         node=v.node, pid=v.pid, comm=v.comm, rank=x.rank, job=v.job,
                         ratio=round(x.ratio, 3), late_ms=round(x.late_ns / 1e6, 3),
                         collectives=x.collectives, summary=_summary(x), top_chain=None)


def _refresh(s: StragglerJson, x: Lateness) -> None:
    s["ratio"], s["late_ms"] = round(x.ratio, 3), round(x.late_ns / 1e6, 3)
    s["collectives"] = x.collectives
