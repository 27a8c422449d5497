"""Which host cause CHANGED on a straggling rank: its per-cause time in the straggle's own
seconds against a reference, the same rank's seconds before the onset (its baseline)
and its on-time peers' seconds of the same window.

The costliest chain is the wrong answer where every rank pays a cause alike: on a host
short of CPU each rank of a job waits for it most of its time, straggling or not, and a
garbage-collection storm or slow disk that makes one rank late costs it a few percent of
its wall time beside that. What makes the rank late is the time that rose, so each cause
is ranked by its excess over the reference.

The per-cause time is what the node's analyzers already state, once: each chain's
``impact`` (its lost share of wall time, docs/explain.md), summed per root cause over
the chains whose victim is the process, from the node's ``GET /api/v1/chains`` answer for
that window (no second root-cause path here). A chain below its rule's threshold counts
as 0, so a reference is exact to within those thresholds (1-2 % of wall).

The reference of a cause is the larger of the rank's own baseline and the peers' median:
a cause the rank had before is not new, and one its peers have as much of is shared (the
rank that enters last waits less in the collective and so is runnable more of its time
than its peers: its own baseline keeps that from counting as contention). The excess is
ranked by how unlikely it is as noise: a share measured over a few seconds varies by an
amount that grows with the share (counts of stalls and samples: their spread grows as
the square root of their mean), so the score is ``excess / sqrt(reference + NOISE_FLOOR)``;
a few points more of a cause that takes 80 % of every rank's time is weaker evidence
than the same points of a cause that was absent.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from fleetd.analyze.reading.answers import ChainJson
from fleetd.wire.shapes import ChainsReply

# Causes that say nothing about the host: the time was on the GPU side, or was paid once.
NOT_HOST = frozenset({"unexplained", "startup"})
MIN_EXCESS = 0.02  # of wall time: a cause that rose by less is not named (gc_pause's floor)
# A reference asleep most of its window (its group stopped: a hang) says too little per
# second awake to compare.
MIN_AWAKE = 0.2
NOISE_FLOOR = 0.05  # share added under the square root: a cause absent before still varies
# ...and a rise must stand out of that noise: 2.2 points of wall for a cause that was
# absent, 9 for one at 80% (a rank's run-queue share per second awake moved by +-4
# points between healthy windows of the bench/detect.py bed).
MIN_SCORE = 0.1
# A rule that fires on a ratio of the thread's own time, not on a share of wall: the
# host is the bottleneck when the thread runs most of the time it is not queued. Any
# CPU-bound rank that stops waiting for its peers (the late one) crosses it, its CPU time
# unchanged; its reference is at least the breakdown's column the impact is counted from.
COUNTED_FROM = {"host_cpu_bound": "running"}
# The waits for a CPU that more work of the thread's own turns into (ranked).
CPU_WAITS = frozenset({"cpu_throttled", "cpu_contention"})
# A task that ran while the rank waited for a CPU is new when it took this many times
# more of the rank's wall time than in its reference (a task absent from a reference
# chain's culprits, which list its top ones only, took at most the least listed one): a
# hog beside the rank is a change even on a host where every rank already waits for a
# CPU most of its time, so the wait's share did not rise.
NEW_TAKER_RATIO = 3.0
# The thread ran less than its reference per second awake (its CPU was taken: a quota cut,
# a hog) when below this share of it. Under its slice's quota a rank that asks more of
# the CPU (a GC storm) runs as much as the quota lets it, no more: 0.97 of its reference
# on the bed where the quota is what it runs at, against 0.14-0.25 under a quota cut and
# 0.48-0.68 beside a hog; a plain "less" took those 3% for a CPU taken from it.
RAN_LESS = 0.85

Taker = tuple[int, str]  # (pid, comm) of a task that ran while the process waited


@dataclass(frozen=True, slots=True)
class Shares:
    """A process over one window, from its node's chains answer: each cause's summed
    chain impact (share of wall), its share of wall on a CPU outside CUDA calls, and
    asleep (S state: waiting for its peers in a collective, among others)."""

    causes: dict[str, float]
    running: float
    asleep: float
    # per task that ran while the process waited for a CPU (its CPU_WAITS chains'
    # culprits, not itself): the time it took, as a share of the process's wall
    takers: dict[Taker, float] = field(default_factory=dict)
    waits: dict[Taker, str] = field(default_factory=dict)  # ...the CPU wait it took most in
    # the most a task not among those culprits can have taken (a chain lists its top
    # culprits only: an unlisted task took no more than the least listed one)
    unlisted: float = 0.0

    def took(self, t: Taker) -> float:
        return self.takers.get(t, self.unlisted)

    def floor(self, cause: str) -> float:
        """The cause's share, or the column its rule counts from where that is more."""
        own = self.causes.get(cause, 0.0)
        return max(own, self.running) if COUNTED_FROM.get(cause) == "running" else own


class CauseChangeJson(TypedDict):
    """The named cause's share of the rank's wall time in the straggle window, its own
    before the onset, its on-time peers' (median) then, and the excess ranked
    (``fleetd watch --format json``; docs/json.md). None where unknown. A CPU wait named
    for a new task that ran while the rank waited (:func:`new_taker`): that task's time,
    against its own in the references."""

    cause: str
    share: float
    baseline: float | None
    peers: float | None
    excess: float


@dataclass(frozen=True, slots=True)
class Change:
    """One cause of the late rank, against its reference."""

    cause: str
    now: float  # share of wall in the straggle window
    before: float | None  # the rank's own, before the onset (None: no baseline)
    peers: float | None  # the on-time peers' median (None: no peer answered)

    @property
    def reference(self) -> float:
        known = [x for x in (self.before, self.peers) if x is not None]
        return max(known) if known else 0.0

    @property
    def excess(self) -> float:
        return self.now - self.reference

    @property
    def score(self) -> float:
        return self.excess / math.sqrt(self.reference + NOISE_FLOOR)

    def to_json(self) -> CauseChangeJson:
        return {"cause": self.cause, "share": round(self.now, 4),
                "baseline": None if self.before is None else round(self.before, 4),
                "peers": None if self.peers is None else round(self.peers, 4),
                "excess": round(self.excess, 4)}


def shares(reply: ChainsReply, pid: int) -> Shares | None:
    """The process's shares in a node's chains answer; None when the answer does not
    list the process (no events of it in that window: nothing is known, which is not
    the same as nothing having happened)."""
    row = next((p for p in reply["processes"] if p.get("pid") == pid), None)
    if row is None:
        return None
    wall = (row["running_ns"] + row["runq_ns"] + row["irq_ns"] + row["d_state_ns"]
            + row["sleeping_ns"])  # the breakdown's columns that add up to wall time
    if wall <= 0:
        return None
    causes: dict[str, float] = {}
    takers: dict[Taker, float] = {}
    waits: dict[Taker, tuple[int, str]] = {}
    for c in reply["chains"]:
        if c["victim"]["pid"] == pid and c["root_cause"] not in NOT_HOST:
            causes[c["root_cause"]] = causes.get(c["root_cause"], 0.0) + max(0.0, c["impact"])
            for t, ns in _took(c):
                takers[t] = takers.get(t, 0.0) + ns / wall
                waits[t] = max(waits.get(t, (0, "")), (ns, c["root_cause"]))
    least = [ns / wall for c in reply["chains"] if c["victim"]["pid"] == pid
             for _, ns in _took(c)]
    return Shares(causes, max(0, row["running_ns"] - row["in_cuda_ns"]) / wall,
                  row["sleeping_ns"] / wall, takers, {t: w for t, (_, w) in waits.items()},
                  min(least, default=0.0))


def _took(chain: ChainJson) -> list[tuple[Taker, int]]:
    """The tasks a CPU_WAITS chain names as having run while its victim waited, and for
    how long (the analyzer's attribution: a task that really took the time)."""
    if chain["root_cause"] not in CPU_WAITS:
        return []
    return [((u["pid"], u["comm"] or "?"), u["ns"]) for u in chain["culprits"]
            if not u.get("self") and u.get("pid") and u.get("ns")]


@dataclass(frozen=True, slots=True)
class NewTaker:
    """A task new among those that ran while the late rank waited for a CPU: ``change``
    is its time (share of the rank's wall) against the same task's in the references,
    filed under the CPU wait whose chains name it."""

    taker: Taker
    change: Change


def new_taker(now: Shares, before: Shares | None, peers: Sequence[Shares],
              ranks: frozenset[int] = frozenset(), *, unseen: bool = False
              ) -> NewTaker | None:
    """The task that took the most of the late rank's wall while it waited for a CPU
    and was absent, or NEW_TAKER_RATIO times smaller, in its references (per second
    awake, as :func:`ranked` scales them), by MIN_EXCESS and MIN_SCORE; None if none.
    The job's own ranks (``ranks``, pids) are left out: a peer that runs more while
    this rank is late is waiting for it, not taking its CPU.

    ``unseen``: only a task that no reference lists at all, by MIN_EXCESS and MIN_SCORE
    over the most each reference can have hidden (its least listed culprit): the ratio
    is then taken against a ceiling, not the task's time: on three recorded runs of the
    bench/detect.py bed the tasks no reference listed took 1.23x that ceiling at most
    outside a quota cut, the hogs 1.7-3.3x. For where no cause rose and the rank ran
    less (:func:`ran_less`): its CPU was taken, and this task was not there to take it."""
    before, peers = _awake_enough(before, peers)
    refs = [*peers, *([before] if before is not None else [])]
    best: NewTaker | None = None
    for t, share in sorted(now.takers.items()):
        if t[0] in ranks or (unseen and any(t in r.takers for r in refs)):
            continue
        theirs = [p.took(t) * _awake(now) / _awake(p) for p in peers]
        x = Change(now.waits[t], share,
                   None if before is None else before.took(t) * _awake(now) / _awake(before),
                   statistics.median(theirs) if theirs else None)
        if (x.excess >= MIN_EXCESS and x.score >= MIN_SCORE
                and (unseen or x.now >= NEW_TAKER_RATIO * x.reference)
                and (best is None or x.score > best.change.score)):
            best = NewTaker(t, x)
    return best


def ranked(now: Shares, before: Shares | None, peers: Sequence[Shares], *,
           settled: bool = True) -> list[Change]:
    """The causes of the late rank that rose by MIN_EXCESS or more over their reference,
    out of its noise (MIN_SCORE), the least likely as noise first. A reference's shares
    are of the seconds it was awake, scaled to the late rank's: a rank on time sleeps in
    the collective while it waits for the late one, which has no such seconds, so per
    second of wall it pays less of every cause than the same host work costs the late
    rank.

    A wait for a CPU (CPU_WAITS) is how more CPU work of the thread's own costs time
    under a quota or on a busy host: unless the thread ran less than its reference per
    second awake (:func:`ran_less`: the CPU was taken from it, not asked more of; a
    rank at its quota runs no more, whatever it asks), any other cause that
    rose too is named first (a GC storm, or the copying of a disk fault's writes, past
    the slice's quota: the GC or the I/O, throttled). Until ``settled`` (the window holds
    on-CPU samples of the straggle written: own work such as a GC storm is seen only
    from those samples), a CPU wait is named only where the thread ran less."""
    before, peers = _awake_enough(before, peers)
    out = []
    for cause in sorted(now.causes):
        theirs = [_per_awake(p, cause, now) for p in peers]
        x = Change(cause, now.causes[cause],
                   None if before is None else _per_awake(before, cause, now),
                   statistics.median(theirs) if theirs else None)
        if x.excess >= MIN_EXCESS and x.score >= MIN_SCORE:
            out.append(x)
    asked_more = not ran_less(now, before, peers)
    if not settled and asked_more:
        out = [x for x in out if x.cause not in CPU_WAITS]
    other = asked_more and any(x.cause not in CPU_WAITS for x in out)
    return sorted(out, key=lambda x: (other and x.cause in CPU_WAITS, -x.score, x.cause))


def ran_less(now: Shares, before: Shares | None, peers: Sequence[Shares]) -> bool:
    """The thread ran less per second awake than its references (both, where known), by
    more than a quota's cap hides (RAN_LESS)."""
    before, peers = _awake_enough(before, peers)
    refs = [r.running * _awake(now) / _awake(r) for r in ([before] if before else [])]
    if peers:
        refs.append(statistics.median(p.running * _awake(now) / _awake(p) for p in peers))
    return bool(refs) and now.running < RAN_LESS * min(refs)


def _awake_enough(before: Shares | None, peers: Sequence[Shares]
                  ) -> tuple[Shares | None, list[Shares]]:
    """The references awake for MIN_AWAKE of their window at least (the others say too
    little per second awake to compare)."""
    return (before if before is not None and _awake(before) >= MIN_AWAKE else None,
            [p for p in peers if _awake(p) >= MIN_AWAKE])


def _per_awake(ref: Shares, cause: str, now: Shares) -> float:
    """The reference's share of ``cause``, per second awake, at the late rank's."""
    return ref.floor(cause) * _awake(now) / _awake(ref)


def _awake(s: Shares) -> float:
    return max(0.05, 1.0 - s.asleep)  # never divide by a rank asleep throughout


def chain_of(reply: ChainsReply, pid: int, cause: str | None,
             taker: Taker | None = None) -> ChainJson | None:
    """The process's costliest chain of ``cause`` (None: of any host cause) in the
    answer: the one named, with its culprit as its node's analyzers found it (a task
    that took the time). With ``taker``: the CPU wait chain in which that task took the
    most time, with it as the chain's culprit (it is one of the chain's culprits)."""
    if taker is not None:
        took = [(ns, c) for c in reply["chains"] if c["victim"]["pid"] == pid
                for t, ns in _took(c) if t == taker]
        if not took:
            return None
        chain = copy.copy(max(took, key=lambda x: x[0])[1])
        u = next(u for u in chain["culprits"] if (u["pid"], u["comm"] or "?") == taker)
        chain["culprit"] = {"pid": u["pid"], "comm": u["comm"], "self": False}
        return chain
    mine = [c for c in reply["chains"] if c["victim"]["pid"] == pid
            and c["root_cause"] not in NOT_HOST and cause in (None, c["root_cause"])]
    return max(mine, key=lambda c: c["impact"], default=None)
