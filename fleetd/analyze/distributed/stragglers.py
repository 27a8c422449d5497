"""Straggler ranking: which node's comparable work is slower than its peers', and why.

Input: one ``profile`` per node (:func:`node_profile`, at the end of this module:
features of the node's main CUDA process over the same window). A live agent computes
its answer to ``GET /api/v1/profile`` with it and ``explain --db`` each node of a file,
so the same data in the same window gets the same verdict. Each metric is turned into a
*speed* where higher is better:

* rates (CUDA calls per second): the rate itself;
* shares of the GPU-feeding threads' wall time lost to the run queue or to D state:
  ``1 - share``, the part of the time the thread could work;
* latencies (p50/p99 of launch and sync calls): ``1 / (latency + 1 us)``; the
  microsecond keeps two fast calls from looking twice as different as they are.

For each metric, a node gets

* a relative score ``speed / best speed in the fleet`` (1.0 = the best node; the
  "best median over node median" of nvidia-resiliency-ext's straggler score), and
* a robust z-score ``(fleet median speed - speed) / (1.4826 * MAD)``: how many
  (robust) standard deviations slower than the typical node it is. The denominator is
  at least 1% of the median speed, so that a fleet of near-identical nodes does not
  turn a 0.1% difference into a huge z (and MAD == 0 into a division by zero).

A metric flags the node when both hold: z >= :data:`Z_THRESHOLD` (an outlier, not the
fleet's normal spread) and the score is below the metric's own threshold (slow enough
to matter: 0.8 for rates and shares, lower for latency percentiles, which come from
log2 histograms and jump by 2x between buckets). A latency must also cost time: its
excess over the fleet median, at the node's rate of such calls, at least
:data:`MIN_LATENCY_COST` of the node's time (microseconds more per call at a hundred
calls a second is two processes sharing a CPU, not a straggler). With fewer than three
nodes there is no odd one out (of two that differ, either may be it, and each may be
worse on another metric): none is flagged, and the reason says two cannot be ranked;
collective arrival (fleetd.analyze.distributed.collectives) still names a late rank from
the job's own signal.

The node's ``metric`` is its flagged metric with the highest z (for an unflagged node:
its worst-scoring rate or share metric) and ``score`` is its relative score on it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers import (
    ChainJson,
    MetricScore,
    NodeProfile,
    StragglerEntry,
)
from fleetd.analyze.reading.data import (
    CALL_SOURCES,
    LAUNCH_OPS,
    MAX_AGG_WINDOW_NS,
    SYNC_OPS,
    Node,
    active_span,
    histograms,
    in_list,
)
from fleetd.analyze.reading.rows import OpRow, ThreadRow, TimeColumn
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import CALLS, LAUNCHES

Z_THRESHOLD = 3.5  # Iglewicz and Hoaglin's cut-off for the modified z-score
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma
# Differences below this share of the median are noise, however alike the other nodes
# are: it keeps sigma above 0 when most nodes match exactly (MAD == 0).
SIGMA_FLOOR = 0.01
LATENCY_FLOOR_NS = 1_000
# With two nodes there is no majority to compare against: a median of two is halfway.
MIN_RANKED = 3
# A latency outlier is a straggler only when its excess over the fleet's median, at the
# node's own rate of such calls, costs at least this share of its time: 5 us more per
# sync at 100 syncs/s (0.05%) is two ranks sharing a CPU, 3 ms more is 30% of the step.
MIN_LATENCY_COST = 0.01


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: str  # rate | share | latency
    max_score: float  # flag only below this relative score
    primary: bool = False  # describes an unflagged node
    # A latency's feature holding the node's rate of the calls it times (syncs are not
    # counted apart: all its CUDA calls, an upper bound, so a costly sync is never let off)
    rate: str | None = None

    def speed(self, value: float) -> float:
        if self.kind == "rate":
            return value
        if self.kind == "share":
            return 1.0 - value
        return 1.0 / (value + LATENCY_FLOOR_NS)


METRICS: tuple[Metric, ...] = (
    Metric("cuda_calls_per_s", "rate", 0.8, primary=True),
    Metric("runq_share", "share", 0.8, primary=True),
    Metric("d_state_share", "share", 0.8, primary=True),
    Metric("lock_share", "share", 0.8, primary=True),
    Metric("data_wait_share", "share", 0.8, primary=True),
    Metric("launch_p50_ns", "latency", 0.5, rate="launches_per_s"),
    Metric("sync_p50_ns", "latency", 0.5, rate="cuda_calls_per_s"),
    Metric("launch_p99_ns", "latency", 0.25, rate="launches_per_s"),
    Metric("sync_p99_ns", "latency", 0.25, rate="cuda_calls_per_s"),
)


@dataclass(slots=True)
class Score:
    metric: Metric
    value: float
    median: float  # the fleet's median value of the metric
    best: float  # the best node's value
    score: float  # speed / best speed
    z: float | None  # None with fewer than three nodes
    # A latency's excess over the median at the node's call rate, as a share of its
    # time (None: not a latency, or no rate to weigh it by)
    cost: float | None = None

    @property
    def flagged(self) -> bool:
        # Without a z (fewer than three nodes with the metric) nobody is the outlier.
        return self.score < self.metric.max_score and self.z is not None \
            and self.z >= Z_THRESHOLD and (self.cost is None or self.cost >= MIN_LATENCY_COST)


def rank(profiles: Mapping[str, Mapping[str, Any]], unreachable: Mapping[str, str],
         chains: Sequence[ChainJson] = ()) -> list[StragglerEntry]:
    """One ``{node, score, flagged, metric, reason, ...}`` per node, stragglers first.

    ``profiles``: node -> profile of the nodes that answered; ``unreachable``: node ->
    why it did not (listed last, never as healthy); ``chains``: every node's chains,
    most severe first, so that a straggler's reason can name its worst one.
    """
    features = {n: p.get("features") or {} for n, p in profiles.items()}
    comparable = {n: f for n, f in features.items() if f}
    scores = _score_all(comparable)
    out = []
    for node in profiles:
        if node not in comparable:
            out.append(_entry(node, None, None, None,
                              "no traced CUDA work in the window to compare"))
        elif len(comparable) < MIN_RANKED:
            out.append(_unranked(node, scores.get(node, []), len(comparable)))
        else:
            out.append(_judge(node, scores.get(node, []), chains))
    for node, why in unreachable.items():
        out.append(_entry(node, None, None, None, f"unreachable: {why}"))
    return sorted(out, key=lambda e: _order(e, e["node"] in unreachable))


def _order(e: StragglerEntry, unreachable: bool) -> tuple[int, float, str]:
    """Stragglers, then the others by score, then the nodes that could not be ranked,
    and last those that did not answer."""
    if e["flagged"] is None:
        return (3 if unreachable else 2, 0.0, e["node"])
    return (0 if e["flagged"] else 1, e["score"] if e["score"] is not None else 1.0, e["node"])


def _entry(node: str, score: float | None, flagged: bool | None, metric: str | None,
           reason: str, **extra: Unpack[Scored]) -> StragglerEntry:
    out: StragglerEntry = {"node": node, "score": score, "flagged": flagged,
                           "metric": metric, "reason": reason}
    if "z" in extra:
        out["z"] = extra["z"]
    if "metrics" in extra:
        out["metrics"] = extra["metrics"]
    return out


class Scored(TypedDict, total=False):
    """What a ranked node's entry adds: its robust z and every metric's scores."""

    z: float | None
    metrics: dict[str, MetricScore]


def _score_all(features: Mapping[str, Mapping[str, Any]]) -> dict[str, list[Score]]:
    out: dict[str, list[Score]] = {n: [] for n in features}
    for m in METRICS:
        values = {n: float(f[m.name]) for n, f in features.items()
                  if isinstance(f.get(m.name), int | float) and not isinstance(f[m.name], bool)}
        if len(values) < 2:
            continue  # nothing to compare with
        for node, s in score_metric(m, values).items():
            if m.rate is not None:
                s.cost = _cost(s, features[node].get(m.rate))
            out[node].append(s)
    return out


def _cost(s: Score, rate: object) -> float | None:
    """What a latency's excess over the fleet median costs the node per second of its
    time, at ``rate`` such calls per second; None without a usable rate."""
    if not isinstance(rate, int | float) or isinstance(rate, bool) or rate < 0:
        return None
    return max(0.0, s.value - s.median) * float(rate) / 1e9


def score_metric(m: Metric, values: Mapping[str, float]) -> dict[str, Score]:
    """Relative score and robust z of every node on one metric."""
    speeds = {n: m.speed(v) for n, v in values.items()}
    best_node = max(speeds, key=lambda n: speeds[n])
    best = speeds[best_node]
    med = statistics.median(speeds.values())
    sigma = _robust_sigma(list(speeds.values()), med)
    value_median = statistics.median(values.values())
    out = {}
    for n, s in speeds.items():
        score = s / best if best > 0 else (1.0 if s >= best else 0.0)
        z: float | None = None
        if len(speeds) >= 3:
            # sigma is 0 only when the median speed is 0: nothing ran anywhere.
            z = (med - s) / sigma if sigma > 0 else 0.0
        out[n] = Score(m, values[n], value_median, values[best_node], max(0.0, score), z)
    return out


def _robust_sigma(xs: list[float], med: float) -> float:
    mad = statistics.median(abs(x - med) for x in xs)
    return max(MAD_TO_SIGMA * mad, SIGMA_FLOOR * abs(med))


def _judge(node: str, scores: list[Score], chains: Sequence[ChainJson]
           ) -> StragglerEntry:
    details = _details(scores)
    flagged = [s for s in scores if s.flagged]
    if flagged:
        worst = max(flagged, key=lambda s: (s.z if s.z is not None else math.inf, -s.score))
        reason = _why(worst) + _top_chain(node, chains)
        return _entry(node, round(worst.score, 4), True, worst.metric.name, reason,
                      z=_round(worst.z), metrics=details)
    primary = [s for s in scores if s.metric.primary] or scores
    if not primary:
        return _entry(node, None, None, None, "no metric shared with another node",
                      metrics=details)
    worst = min(primary, key=lambda s: s.score)
    return _entry(node, round(worst.score, 4), False, worst.metric.name,
                  "within the fleet's spread", z=_round(worst.z), metrics=details)


def _unranked(node: str, scores: list[Score], n: int) -> StragglerEntry:
    """A node of a two-node fleet: neither flagged nor called healthy. Of two nodes that
    differ, either may be the odd one (one slow, or the other fast), and each may look
    worse on another metric: judging each by the score alone flagged both."""
    primary = [s for s in scores if s.metric.primary] or scores
    worst = min(primary, key=lambda s: s.score) if primary else None
    gap = (f"; its worst metric: {_why(worst)}" if worst is not None and worst.score < 1.0
           else "")
    return _entry(node, round(worst.score, 4) if worst else None, None,
                  worst.metric.name if worst else None,
                  f"{n} node(s) cannot be ranked: it takes {MIN_RANKED} or more to tell the odd "
                  "one out (the job's collective arrival ranks its ranks when their NCCL "
                  f"calls were traced){gap}", z=None, metrics=_details(scores))


def _details(scores: list[Score]) -> dict[str, MetricScore]:
    return {s.metric.name: {"value": s.value, "score": round(s.score, 4),
                            "z": _round(s.z), "fleet_median": s.median, "best": s.best}
            for s in scores}


def _round(z: float | None) -> float | None:
    return None if z is None else round(z, 2)


def _why(s: Score) -> str:
    z = "" if s.z is None else f", robust z {s.z:.1f}"
    return (f"{s.metric.name} {_fmt(s.metric, s.value)} vs fleet median "
            f"{_fmt(s.metric, s.median)} and best {_fmt(s.metric, s.best)}: "
            f"{1 - s.score:.0%} slower than the best node{z}")


def _fmt(m: Metric, v: float) -> str:
    if m.kind == "share":
        return f"{v:.1%}"
    if m.kind == "latency":
        return f"{v / 1e3:.1f} us" if v < 1e6 else f"{v / 1e6:.2f} ms"
    return f"{v:.1f}/s"


def _top_chain(node: str, chains: Sequence[ChainJson]) -> str:
    mine = [c for c in chains if c.get("node") == node]
    return f"; top chain: {chain_brief(mine[0])}" if mine else ""


def chain_brief(c: ChainJson) -> str:
    """A chain in a reason: ``cpu_contention (HIGH), culprit cpu-hog pid 42``, with the
    pod of the victim and of the culprit where they ran in one (analyze.pods)."""
    culprit: Mapping[str, Any] = c.get("culprit") or {}
    who = (f", culprit {culprit.get('comm')} pid {culprit.get('pid')}{pods.label(culprit)}"
           if culprit.get("comm") else "")
    victim: Mapping[str, Any] = c.get("victim") or {}
    where = f" in pid {victim.get('pid')}{pods.label(victim)}" if pods.label(victim) else ""
    return f"{c.get('root_cause')} ({c.get('severity')}){where}{who}{_what_it_ran(c)}"


def _what_it_ran(c: ChainJson) -> str:
    """For the on-CPU causes: what the feeding thread ran (the top frame and its share
    of the samples), or how it paused (the collector's pauses, the longest)."""
    d = c.get("detail") or {}
    if c.get("root_cause") == "host_cpu_bound" and d.get("top_frames"):
        top = d["top_frames"][0]
        return f", top frame {top.get('frame')} ({float(top.get('share') or 0):.0%})"
    if c.get("root_cause") == "gc_pause" and d.get("pauses"):
        return (f", {d['pauses']} GC pause(s), longest "
                f"{int(d.get('longest_ns') or 0) / 1e6:.0f} ms")
    return ""


# ---- the features: one computation for a live agent's answer and a file's node -------

CALL_CODES = CALLS.codes
LAUNCH_CODES = LAUNCHES.code_set


@dataclass(frozen=True, slots=True)
class Counted:
    """A process's CUDA calls and launches, and the span every one of them was counted in."""

    calls: int
    launches: int
    start_ns: int
    end_ns: int
    source: str  # histograms | events

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.end_ns - self.start_ns) / 1e9)


def node_profile(sl: NodeSlice) -> NodeProfile:
    """The straggler features of one node's window (``GET /api/v1/profile`` of an agent,
    and each node of a file for ``explain --db``): of its main CUDA process (the most
    CUDA time) and the threads of it that called CUDA."""
    node, window, names = sl.name, sl.window, sl.names
    span_s = max(1e-9, (sl.span[1] - sl.span[0]) / 1e9)
    ops, threads = sl.ops, sl.threads
    cuda_time: dict[int, int] = {}
    for r in ops:
        pid = r["pid"]  # the slice's op rows are per process: never None
        if r["source"] in CALL_SOURCES and pid is not None:
            # None: launches none of which was timed (entry-only); they add no time
            cuda_time[pid] = cuda_time.get(pid, 0) + (r["total_ns"] or 0)
    if not cuda_time:
        return {"node": node, "window": window.to_json(), "main_pid": None, "features": {}}
    main = max(cuda_time, key=lambda p: cuda_time[p])
    mine = [r for r in ops if r["pid"] == main]
    feeding = [t for t in threads if t["pid"] == main and t["cuda_calls_stored"]]
    counted = counted_calls(sl, main)
    return {
        "node": node, "window": window.to_json(), "span_s": round(span_s, 3),
        "main_pid": main, "main_comm": names.get(main),
        # What the call rates divide by, and where the calls were counted from.
        "rate_span_s": round(counted.seconds, 3) if counted else None,
        "counted_from": counted.source if counted else None,
        "features": {
            "cuda_calls_per_s": round(counted.calls / counted.seconds, 3) if counted else None,
            "launches_per_s": round(counted.launches / counted.seconds, 3) if counted else None,
            **_pct(mine, LAUNCH_OPS, "launch"),
            **_pct(mine, SYNC_OPS, "sync"),
            "feeding_threads": len(feeding),
            "off_cpu_share": _share(feeding, "off_cpu_ns"),
            "runq_share": _share(feeding, "runq_ns"),
            "d_state_share": _share(feeding, "d_state_ns"),
            "lock_share": _share(feeding, "lock_ns"),
            "data_wait_share": _share(feeding, "data_ns"),
            "block_io_ns": sum(r["total_ns"] or 0 for r in ops if r["op"] == "block_io"
                               and r["pid"] == main),
        },
    }


def counted_calls(sl: NodeSlice, pid: int) -> Counted | None:
    """``pid``'s CUDA calls over the part of the window in which every call was counted.

    A rate is calls over the time they were counted in, and the two must be the same
    span. A sampling tracer (``--sample N``, 100 by default) stores one call in N as an
    event and counts every call in histograms it writes every 10 s; a live agent's newest
    calls are in no histogram yet, while its events reach the file within a second.
    Dividing the histograms' count by the events' span called a node slow for where its
    agent happened to be in its 10 s, and the same run merged into a file, its histograms
    complete, was judged differently. So: with histograms, their count over the span
    they cover, clipped to when the process made calls; without, the stored events, when
    they are every call; else nothing yet (None), never a hundredth of the rate.

    A histogram window the window's edge cuts counts the part of its calls that fell
    inside, told by its stored calls (a sample spread over the calls as they came), not
    by the part of its 10 s inside: a job that began mid-window made all its calls in
    the part after, and the time's share undercounted it by where each agent's windows
    began (node-2 at 0.76 of the best in a lockstep job whose ranks all ran at one pace)."""
    start, end = active_span(sl.conn, sl.node, sl.window, pid)
    covered = _histogram_cover(sl, pid)
    if covered is not None:
        lo, hi = max(start, covered[0]), min(end, covered[1])
        if hi <= lo:
            return None
        calls = launches = 0.0
        for part in _histogram_windows(sl, pid):
            for (_, op), h in histograms(sl.conn, sl.node, part, CALL_CODES, pid).items():
                n = h.count * _inside(sl, pid, op, part)
                calls += n
                launches += n if op in LAUNCH_CODES else 0.0
        return Counted(round(calls), round(launches), lo, hi, "histograms")
    if _sampled(sl):
        return None
    rows = [r for r in sl.ops if r["pid"] == pid and r["source"] in CALL_SOURCES]
    return Counted(sum(r["count"] for r in rows),
                   sum(r["count"] for r in rows if r["op"] in LAUNCH_OPS),
                   start, end, "events")


def _histogram_windows(sl: NodeSlice, pid: int) -> list[Window]:
    """The tracer's histogram windows of ``pid``'s calls that overlap the slice's window."""
    win = sl.window
    rows = sl.conn.execute(
        "SELECT DISTINCT ts_ns, dur_ns FROM aggregate_data WHERE node = ? AND pid = ? AND "
        f"op IN {in_list(CALL_CODES)} AND ts_ns >= ? AND ts_ns < ? AND ts_ns + dur_ns > ? "
        "ORDER BY ts_ns",
        (sl.node.key, pid, win.start_ns - MAX_AGG_WINDOW_NS, win.end_ns, win.start_ns))
    return [Window(int(ts), int(ts) + max(1, int(dur)), "histogram") for ts, dur in rows]


def _inside(sl: NodeSlice, pid: int, op: int, part: Window) -> float:
    """The share of one histogram window's calls of ``op`` made inside the slice's
    window: 1 for a histogram window inside it, else the share of its stored calls
    inside, else (none stored) the share of its time."""
    win = sl.window
    if part.start_ns >= win.start_ns and part.end_ns <= win.end_ns:
        return 1.0
    total, inside = sl.conn.execute(
        "SELECT count(*), coalesce(sum(ts_ns >= ? AND ts_ns < ?), 0) FROM event_data "
        "WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND pid = ? AND op = ?",
        (win.start_ns, win.end_ns, part.start_ns, part.end_ns, sl.node.lo, sl.node.hi, pid,
         op)).fetchone()
    if total:
        return float(inside) / float(total)
    overlap = min(part.end_ns, win.end_ns) - max(part.start_ns, win.start_ns)
    return max(0.0, overlap / max(1, part.dur_ns))


def _histogram_cover(sl: NodeSlice, pid: int) -> tuple[int, int] | None:
    """[first start, last end) of ``pid``'s call histograms that overlap the window,
    clipped to it."""
    win: Window = sl.window
    node: Node = sl.node
    row = sl.conn.execute(
        "SELECT min(ts_ns), max(ts_ns + dur_ns) FROM aggregate_data WHERE node = ? AND "
        f"pid = ? AND op IN {in_list(CALL_CODES)} AND ts_ns >= ? AND ts_ns < ? "
        "AND ts_ns + dur_ns > ?",
        (node.key, pid, win.start_ns - MAX_AGG_WINDOW_NS, win.end_ns, win.start_ns),
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return max(win.start_ns, int(row[0])), min(win.end_ns, int(row[1]))


def _sampled(sl: NodeSlice) -> bool:
    """Whether a trace session of the node kept only a sample of the calls as events."""
    for (text,) in sl.conn.execute("SELECT targets FROM session_data WHERE node = ? AND "
                                   "targets IS NOT NULL", (sl.node.key,)):
        try:
            sample = json.loads(text).get("sample")
        except (ValueError, AttributeError):
            continue  # an older or foreign row
        if isinstance(sample, int) and sample > 1:
            return True
    return False


def _pct(rows: list[OpRow], names: frozenset[str], prefix: str
         ) -> dict[str, float | str | None]:
    """p50/p99 of the busiest op of a family (percentiles do not add across ops): three
    of the profile's ``features``, named after ``prefix``."""
    fam = [r for r in rows if r["op"] in names]
    if not fam:
        return {f"{prefix}_op": None, f"{prefix}_p50_ns": None, f"{prefix}_p99_ns": None}
    top = max(fam, key=lambda r: r["count"])
    return {f"{prefix}_op": top["op"], f"{prefix}_p50_ns": top["p50_ns"],
            f"{prefix}_p99_ns": top["p99_ns"]}


def _share(threads: list[ThreadRow], key: TimeColumn) -> float | None:
    wall = sum(t["wall_ns"] for t in threads)
    return round(sum(t[key] for t in threads) / wall, 4) if wall else None
