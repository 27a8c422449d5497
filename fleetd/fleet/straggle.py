"""Stragglers seen live by ``fleetd watch``: each poll's ranks answers judged for the rank
that enters last (:mod:`fleetd.analyze.distributed.lateness`), with hysteresis, and the late rank's
top host cause asked of its node.

A rank is flagged once the rule has called it late at :data:`FLAG_POLLS` consecutive
polls, and recovers once it has not for :data:`CALM_POLLS` (no flapping on a rank that
is late at half the polls). While a flagged rank has no named cause, its node is asked
for the rank's top causal chain over the straggle's own seconds (``GET /api/v1/chains``,
as a hang's culprit is: :mod:`fleetd.fleet.chains`), at most every :data:`CAUSE_EVERY_S`;
the cause named is the one that CHANGED (:mod:`fleetd.fleet.cause_change`): the rank's
chains over the straggle's own seconds, per cause, against the same rank's chains over
:data:`BASELINE_S` before the onset (asked once) and its on-time peers' over the same
window (up to :data:`PEERS_ASKED`, those on its own node first), ranked by the excess.
A cause every rank of the job pays alike (a CPU they all share) is not the straggler's.
The straggle window starts :data:`CAUSE_LEAD_S` before the first poll that called the
rank late (at least :data:`CAUSE_MIN_S`, at most :data:`CAUSE_SINCE_S` long); the
baseline ends a lateness window (:data:`~fleetd.analyze.distributed.lateness.WINDOW_NS`)
and :data:`BASELINE_GAP_S` before that poll, where the fault cannot have begun yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from fleetd.analyze.distributed.hangs import RankView
from fleetd.analyze.distributed.lateness import WINDOW_NS, Lateness, lateness
from fleetd.analyze.reading.answers import ChainJson
from fleetd.fleet import cause_change
from fleetd.fleet.cause_change import CauseChangeJson, Shares
from fleetd.fleet.chains import ChainsAsk, chains_answers
from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer
from fleetd.store.bounds import ABSOLUTE, Bounds
from fleetd.wire.ranks import TopChain, top_chain
from fleetd.wire.shapes import ChainsReply

log = logging.getLogger("fleetd.fleet.straggle")

FLAG_POLLS = 2  # consecutive polls late before a rank is flagged
CALM_POLLS = 3  # consecutive polls not late before it recovers
CAUSE_EVERY_S = 2.0  # a flagged rank's node asked again for its chain, until it names one
# A node short of CPU or disk (the fault itself: a disk fault slows its agent's database
# too) can take several seconds to answer for a window: each ask may take this long, and
# a poll waits CAUSE_WAIT_S for a round before it goes on (the round goes on beside).
CAUSE_ASK_S = 30.0
CAUSE_WAIT_S = 2.0
CAUSE_SINCE_S = 15  # the chain window at most: the straggle's own seconds, not the minutes before
CAUSE_MIN_S = 5  # ...and at least (a sampled cgroup, a few steps)
CAUSE_LEAD_S = 2  # ...from this long before the first poll that called the rank late
USUAL_S = 60  # a rank's own lateness remembered this long (OwnLateness)...
USUAL_SKIP_S = 10  # ...less its last seconds
USUAL_POLLS = 10  # ...once it has this many polls
USUAL_LAST = 3  # a poll counts its gap when it was last this often, else 0
# A poll whose nodes answered further apart than this is not judged (streaks and calm
# counts held): a rank's lateness is read from ages its node measured at its own "now",
# and a delivery delayed on our side makes it late at every collective. On the
# bench/detect.py bed the spread of a poll with a late rank was 13.5 ms at the median,
# 27 ms at p90, over two full runs; 4 of its 450 polls spread 355-750 ms, all within 15 s
# of a disk fault's end (its writeback), and made a rank 168-243 ms late at every
# collective: two false alarms.
UNSURE_S = 0.25
BASELINE_S = 10  # the rank's own seconds before the onset, its per-cause reference
BASELINE_MIN_S = 4  # ...at least (after its last straggle), else its peers' alone
BASELINE_GAP_S = 1  # ...ending this long before the earliest the onset can be
PEERS_ASKED = 3  # on-time ranks of its group whose same seconds are the other reference
# No cause rose: the costliest chain is named once the straggle window is this long
# (the onset is 4-5 s before the first late poll, so it ends 10 s or more after it).
FALLBACK_S = 8
# On-CPU samples (a GC storm's among them) reach the node's database within 2 s of being
# taken (fleetd.trace.enrich.oncpu.INTERVAL_NS, 1 s, and the agent's 1 s maintenance
# tick): a straggle window this long holds a second or more of the straggle's own
# samples, and a CPU wait the rank's own work caused can be told from one imposed on it.
SETTLED_S = 3


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
    changed: NotRequired[CauseChangeJson]  # the named cause against its references


@dataclass
class _Open:
    found: StragglerJson
    calm: int = 0
    asked: float = 0.0  # monotonic time its node was last asked for a chain
    began: float = 0.0  # monotonic time of the first poll that called it late
    peers: list[tuple[str, int]] = field(default_factory=list)  # (node, pid), on time
    ranks: frozenset[int] = frozenset()  # pids of its group's ranks (not a new taker)
    baseline: Shares | None = None  # its per-cause shares before the onset
    baseline_asked: bool = False
    clean_since: float = -math.inf  # monotonic: when it last recovered (its baseline after)


@dataclass
class Changes:
    """What one poll turned: ranks newly flagged, flagged ranks whose cause was just
    named, ranks that recovered."""

    flagged: list[StragglerJson] = field(default_factory=list)
    named: list[StragglerJson] = field(default_factory=list)
    recovered: list[StragglerJson] = field(default_factory=list)


@dataclass
class OwnLateness:
    """Each rank's own lateness at the polls it was not flagged at: a rank is late by
    what it trails beyond its usual (a rank of a loaded host that enters last by 7 ms at
    most steps for minutes has not just turned late). Its usual is the median of its
    polls of the last USUAL_S less the last USUAL_SKIP_S (an onset under way is not its
    usual), each poll its median gap behind the next rank when it was last at USUAL_LAST
    or more of the window's collectives, else 0; none before USUAL_POLLS such polls."""

    clock: Callable[[], float] = time.monotonic
    seen: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def record(self, key: str, late_ns: int) -> None:
        now = self.clock()
        polls = self.seen.setdefault(key, deque())
        polls.append((now, late_ns))
        while polls and polls[0][0] < now - USUAL_S:
            polls.popleft()

    def usual(self, key: str) -> int:
        now = self.clock()
        old = [v for t, v in self.seen.get(key, ()) if t <= now - USUAL_SKIP_S]
        return int(statistics.median(old)) if len(old) >= USUAL_POLLS else 0

    def beyond(self, x: Lateness) -> bool:
        """The rule, on x's lateness beyond its usual."""
        usual = self.usual(_key(x))
        return x.late and (not usual or dataclasses.replace(x, late_ns=x.late_ns - usual).late)


@dataclass
class StraggleWatch:
    """The stragglers of a watch: per poll, which ranks turned late, and which recovered."""

    flag_polls: int = FLAG_POLLS
    calm_polls: int = CALM_POLLS
    own: OwnLateness = field(default_factory=OwnLateness)
    streak: dict[str, int] = field(default_factory=dict)  # key -> consecutive late polls
    began: dict[str, float] = field(default_factory=dict)  # key -> the streak's first poll
    open: dict[str, _Open] = field(default_factory=dict)
    recovered_at: dict[str, float] = field(default_factory=dict)  # key -> monotonic
    changes: Changes = field(default_factory=Changes)  # the last poll's
    asker: FleetClient | None = None  # the chains asks' client (None: the poll's)
    asking: _Round | None = None  # the round of chains asks under way

    async def poll(self, answer: FleetAnswer, client: FleetClient,
                   views: Sequence[RankView], age_error_s: float | None,
                   read_at: Mapping[str, float] | None = None) -> Changes:
        """One poll: judge the ranks, then ask for the causes still unnamed."""
        flagged, recovered = self.update(views, age_error_s, read_at)
        self.changes = Changes(flagged, await self.causes(answer, client), recovered)
        return self.changes

    def update(self, views: Sequence[RankView], age_error_s: float | None,
               read_at: Mapping[str, float] | None = None
               ) -> tuple[list[StragglerJson], list[StragglerJson]]:
        """This poll's ranks in; (newly flagged, recovered) out. ``read_at``: per node,
        when its answer was read (monotonic s): its ages are moved to one "now" first."""
        if age_error_s is not None and age_error_s > UNSURE_S:
            log.info("poll not judged: its nodes answered %.0f ms apart", age_error_s * 1e3)
            return [], []  # streaks and calm counts held for the next poll
        err = None if age_error_s is None else int(age_error_s * 1e9)
        judged = lateness(in_one_now(views, read_at or {}), age_error_ns=err)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("lateness (age error %.1f ms): %s", (age_error_s or 0) * 1e3, "; ".join(
                f"rank {x.rank} last {x.last}/{x.collectives} by {x.late_ns / 1e6:.1f} ms, "
                f"step {x.step_ns / 1e6:.1f} ms" for x in judged))
        late = {_key(x): x for x in judged if self.own.beyond(x)}
        flagged: list[StragglerJson] = []
        for key, x in late.items():
            self.streak[key] = self.streak.get(key, 0) + 1
            self.began.setdefault(key, time.monotonic())
            if key in self.open:
                self.open[key].calm = 0
                _refresh(self.open[key].found, x)
            elif self.streak[key] >= self.flag_polls:
                self.open[key] = _Open(_json(key, x), began=self.began[key],
                                       peers=_peers(x, judged, late),
                                       ranks=frozenset(y.view.pid for y in judged
                                                       if y.key == x.key),
                                       clean_since=self.recovered_at.get(key, -math.inf))
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
                self.recovered_at[key] = time.monotonic()
        for x in judged:  # a flagged rank's seconds are no part of its usual
            if _key(x) not in self.open:
                self.own.record(_key(x), x.late_ns if x.last >= USUAL_LAST else 0)
        return flagged, recovered

    def current(self) -> list[StragglerJson]:
        return [o.found for o in self.open.values()]

    async def causes(self, answer: FleetAnswer, client: FleetClient) -> list[StragglerJson]:
        """Ask for the chains of the flagged ranks without a cause (the straggle window),
        their baselines (once) and their peers'; the ones that got a cause now. A round
        of asks runs beside the polls (on ``asker`` where set: a connection of its own,
        so a node busy making a slow answer still answers the polls): a poll waits for it
        CAUSE_WAIT_S, then goes on, and a later poll names what it found. A slow answer
        delays the cause, it is not cut off and lost; one round at a time."""
        named = self._collect()
        if self.asking is None:
            self.asking = self._start(answer, self.asker or client)
            if self.asking is not None:
                await asyncio.wait([self.asking.task], timeout=CAUSE_WAIT_S)
                named += self._collect()
        return named

    async def aclose(self) -> None:
        """Stop a round still asking (the watch ends)."""
        if self.asking is not None:
            self.asking.task.cancel()
            await asyncio.gather(self.asking.task, return_exceptions=True)
            self.asking = None

    def _start(self, answer: FleetAnswer, client: FleetClient) -> _Round | None:
        now = time.monotonic()
        due = [o for o in self.open.values() if not _named(o.found)
               and now - o.asked >= CAUSE_EVERY_S]
        if not due:
            return None
        asks: dict[int, tuple[ChainsAsk, list[ChainsAsk], ChainsAsk | None]] = {}
        for o in due:
            o.asked = now
            window = (("since", _since(o, now)),)
            base = None if o.baseline_asked else _baseline_ask(o, now)
            o.baseline_asked = o.baseline_asked or base is None  # none to ask: peers alone
            asks[id(o)] = (ChainsAsk(o.found["node"], o.found["pid"], window),
                           [ChainsAsk(n, p, window) for n, p in o.peers], base)
        # the late ranks' own windows first: a node answers one ask at a time
        wanted = [late for late, _, _ in asks.values()] + [
            a for _, peers, base in asks.values() for a in (*peers, *([base] if base else []))]
        task = asyncio.create_task(chains_answers(answer, client, wanted,
                                                  timeout_s=CAUSE_ASK_S))
        return _Round(task, due, asks, now)

    def _collect(self) -> list[StragglerJson]:
        """Name the causes a finished round found, for the ranks still flagged."""
        r = self.asking
        if r is None or not r.task.done():
            return []
        self.asking = None
        got = r.task.result()
        named = []
        for o in r.due:
            if self.open.get(o.found["key"]) is not o or _named(o.found):
                continue  # recovered meanwhile
            late, peers, base = r.asks[id(o)]
            if base is not None and base in got:  # else asked again with the next
                o.baseline, o.baseline_asked = cause_change.shares(got[base], base.pid), True
            if _name(o, got.get(late), [cause_change.shares(got[p], p.pid) for p in peers
                                        if p in got],
                     fallback=r.at - o.began + CAUSE_LEAD_S >= FALLBACK_S,
                     settled=r.at - o.began + CAUSE_LEAD_S >= SETTLED_S):
                named.append(o.found)
        return named


@dataclass
class _Round:
    """One round of chains asks, running beside the polls."""

    task: asyncio.Task[dict[ChainsAsk, ChainsReply]]
    due: list[_Open]
    asks: dict[int, tuple[ChainsAsk, list[ChainsAsk], ChainsAsk | None]]
    at: float  # monotonic: when it was asked (its straggle window's end)


def _name(o: _Open, reply: ChainsReply | None, peers: list[Shares | None], *,
          fallback: bool = True, settled: bool = True) -> bool:
    """Name the cause that rose most in the late rank's answer; where none rose by
    MIN_EXCESS (a cause every rank pays that pressed harder on this one: a CPU hog
    beside it on a host already short of CPU), its costliest chain with ``fallback``.
    Until ``settled`` (the window holds the straggle's own on-CPU samples), a CPU wait
    is named only where the rank ran less (:func:`cause_change.ranked`)."""
    if reply is None:
        return False
    pid = o.found["pid"]
    mine = cause_change.shares(reply, pid)
    if mine is None:
        return False
    refs = [p for p in peers if p is not None]
    found = cause_change.ranked(mine, o.baseline, refs, settled=settled)
    # a task new beside the rank (a hog) took the time it waited for a CPU: named after
    # any other cause that rose, at once (its chains are written as it runs)
    new = cause_change.new_taker(mine, o.baseline, refs, o.ranks)
    if new is None and not found and cause_change.ran_less(mine, o.baseline, refs):
        # nothing rose but the rank's CPU was taken: by a task no reference lists
        new = cause_change.new_taker(mine, o.baseline, refs, o.ranks, unseen=True)
    if new is not None and new.change.cause not in {x.cause for x in found}:
        found.append(new.change)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("rank %d causes: %s", o.found["rank"], "; ".join(
            f"{x.cause} {x.now:.3f} (before {x.before}, peers {x.peers}, score "
            f"{x.score:.3f})" for x in found) or f"none rose of {mine}")
    for x in found:
        taker = new.taker if new is not None and x.cause == new.change.cause else None
        if _take(o, cause_change.chain_of(reply, pid, x.cause, taker)):
            o.found["changed"] = x.to_json()
            return True
    return fallback and not found and _take(o, cause_change.chain_of(reply, pid, None))


def _take(o: _Open, chain: ChainJson | None) -> bool:
    top = top_chain({"chains": [chain]}) if chain is not None else None
    if top is None or not top.get("root_cause"):
        return False
    o.found["top_chain"] = top
    return True


def _since(o: _Open, now: float) -> str:
    """The straggle window (``"7s"``): from CAUSE_LEAD_S before its streak began, within
    [CAUSE_MIN_S, CAUSE_SINCE_S]."""
    return f"{min(CAUSE_SINCE_S, max(CAUSE_MIN_S, math.ceil(now - o.began + CAUSE_LEAD_S)))}s"


def _baseline_ask(o: _Open, now: float) -> ChainsAsk | None:
    """The rank's BASELINE_S before the earliest its straggle can have begun (a lateness
    window before its first late poll) and after it last recovered, by our clock (nodes
    whose clocks differ from ours by a second or two still answer for seconds before the
    onset); None when that leaves less than BASELINE_MIN_S."""
    last = o.began - WINDOW_NS / 1e9 - BASELINE_GAP_S
    first = max(last - BASELINE_S, o.clean_since)
    if last - first < BASELINE_MIN_S:
        return None
    wall_ns = time.time_ns() - int(now * 1e9)  # our clock at monotonic 0
    window = Bounds(ABSOLUTE, wall_ns + int(first * 1e9), wall_ns + int(last * 1e9)).params()
    return ChainsAsk(o.found["node"], o.found["pid"], tuple(sorted(window.items())))


def _peers(x: Lateness, judged: Sequence[Lateness], late: Mapping[str, Lateness]
           ) -> list[tuple[str, int]]:
    """Up to PEERS_ASKED on-time members of x's group, those on x's node first (they
    share its host: what they pay alike is the host's, not the straggler's)."""
    on_time = [y for y in judged if y.key == x.key and y.rank != x.rank
               and _key(y) not in late]
    on_time.sort(key=lambda y: (y.view.node != x.view.node, y.rank))
    return [(y.view.node, y.view.pid) for y in on_time[:PEERS_ASKED]]


def in_one_now(views: Sequence[RankView], read_at: Mapping[str, float]) -> list[RankView]:
    """The views with each node's collective ages counted from the moment the latest
    node's answer was read: each node measured its ages at its own "now", somewhere in
    the poll, and a node that answered first would seem late at every collective by the
    time the others took (under load, tens of ms: a step's share). Its "now" is taken
    as the time its answer was read, less a delivery the nodes share; what is left is
    how much their deliveries differ. Nodes with no time are left as they are."""
    if len(read_at) < 2:
        return list(views)
    latest = max(read_at.values())
    out = []
    for v in views:
        at = read_at.get(v.node)
        shift = 0 if at is None else int((latest - at) * 1e9)
        out.append(v if not shift else dataclasses.replace(v, collectives=[
            dataclasses.replace(c, age_ns=c.age_ns + shift, recent=tuple(
                dataclasses.replace(x, age_ns=x.age_ns + shift) for x in c.recent))
            for c in v.collectives]))
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
