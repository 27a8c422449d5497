"""Which rank arrives last at a group's collectives, over its last few seconds: a
straggler seen live, from the ranks' recent collectives (``GET /api/v1/ranks``) alone.

Each rank's answer carries its recent collectives with their ages (the node's now minus
the call's entry). Once a group's numbers are aligned (:func:`fleetd.analyze.distributed.hangs.
build_groups`), a collective every member entered gives each member an entry time
(minus its age); the member that entered last, and by how much after the next one, is
that collective's laggard. A healthy group spreads "last" over its members by chance
(1/n each); a straggler is last at most of them, by a margin. Ages of different nodes
compare within one poll's length (the most their "now"s differ), well under the
margins here.

What is pure here is shared by ``fleetd watch`` (every node's ranks, each poll:
:mod:`fleetd.fleet.straggle`) and the agent (its own ranks, when a group has several of
them on the node: ``fleetd_rank_late_ratio``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fleetd.analyze.distributed.hangs import Group, RankView, build_groups

WINDOW_NS = 5_000_000_000  # the collectives considered: entered within the last 5 s
MIN_COLLECTIVES = 5  # fewer shared collectives than this say nothing
LATE_RATIO = 0.75  # last at this share of them (chance is 1/n)...
LATE_MARGIN_NS = 2_000_000  # ...entering this long after the next rank (median)...
# ...and at least this share of a step (the median time between collectives): ranks
# contending for a busy host's CPUs trail each other by a few ms, one of them often
# for seconds (the last one a barrier releases); a straggler holds the job back by a
# good part of each step.
STEP_SHARE = 0.25
# A rank last at nearly all of them is flagged on a smaller share: a steady trail the
# noise does not give (a CPU hog beside a rank on a host already short of CPU).
ALWAYS_RATIO, ALWAYS_STEP_SHARE = 0.9, 0.1


@dataclass(frozen=True, slots=True)
class Lateness:
    """One member of a group over the window: how often it entered last, by how much."""

    group: str  # the group's label (communicator HASH, job ID)
    key: str
    matching: str
    rank: int
    view: RankView
    collectives: int  # collectives of the window every member entered
    last: int  # of them, the ones it entered last
    late_ns: int  # median gap behind the next rank at those (0 when never last)
    step_ns: int  # median time between the group's consecutive collectives

    @property
    def ratio(self) -> float:
        return self.last / self.collectives if self.collectives else 0.0

    @property
    def late(self) -> bool:
        """The rule: last at most of enough collectives, by a margin."""
        if self.collectives < MIN_COLLECTIVES or self.late_ns < LATE_MARGIN_NS:
            return False
        share = self.late_ns / self.step_ns if self.step_ns else 1.0
        return ((self.ratio >= LATE_RATIO and share >= STEP_SHARE)
                or (self.ratio >= ALWAYS_RATIO and share >= ALWAYS_STEP_SHARE))


def lateness(views: Sequence[RankView], window_ns: int = WINDOW_NS,
             age_error_ns: int | None = 0) -> list[Lateness]:
    """Every sure member of every group with 2 or more of them, over the window."""
    out: list[Lateness] = []
    for g in build_groups(views, age_error_ns):
        out += _of_group(g, window_ns)
    return out


def _entries(g: Group, window_ns: int) -> dict[int, dict[int, int]]:
    """Per aligned collective number: each sure member's entry (minus its age, ns)."""
    offsets = g.alignment.offsets if g.alignment is not None else {}
    by_seq: dict[int, dict[int, int]] = {}
    for r, m in g.members.items():
        if not m.sure or m.view.dead:
            continue
        calls = {x.seq: x.age_ns for x in m.recent}
        calls.setdefault(m.recorded, m.age_ns)  # its latest, when not in recent
        for seq, age in calls.items():
            if age <= window_ns:
                by_seq.setdefault(seq + offsets.get(r, 0), {})[r] = -age
    return by_seq


def _of_group(g: Group, window_ns: int) -> list[Lateness]:
    by_seq = _entries(g, window_ns)
    members = sorted({r for e in by_seq.values() for r in e})
    if len(members) < 2:
        return []
    shared = [e for _, e in sorted(by_seq.items()) if len(e) == len(members)]
    firsts = [min(e.values()) for e in shared]
    step = int(statistics.median(b - a for a, b in zip(firsts, firsts[1:], strict=False))
               ) if len(firsts) > 1 else 0
    gaps: dict[int, list[int]] = {r: [] for r in members}
    for e in shared:
        order = sorted(e, key=lambda r: e[r])
        last, before = order[-1], order[-2]
        gaps[last].append(e[last] - e[before])
    return [Lateness(g.label, g.key, g.matching, r, g.members[r].view, len(shared),
                     len(gaps[r]), int(statistics.median(gaps[r])) if gaps[r] else 0, step)
            for r in members]


def stragglers(views: Sequence[RankView], window_ns: int = WINDOW_NS,
               age_error_ns: int | None = 0) -> list[Lateness]:
    """The members the rule calls late, most often last first."""
    found = [x for x in lateness(views, window_ns, age_error_ns) if x.late]
    return sorted(found, key=lambda x: (-x.ratio, -x.late_ns))
