"""CUDA graph lifecycle per process: capture, instantiate, launch, over time.

A CUDA graph pays off by being captured once and replayed many times. The failure mode
is re-capture: shapes change, the capture is invalidated, and the process keeps
capturing and instantiating (tens of ms each) instead of launching. This view answers
"how often, when, and what did it cost": per phase counts and latencies (from
:meth:`fleetd.analyze.pernode.model.NodeSlice.op_stats`, so sampled calls are counted from the
histograms), the replay ratio, and a timeline whose capture episodes are compared with
the launch rate outside them.

Graph calls are always stored as events by the tracer (never sampled away), so the
timeline counts them exactly.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.answers import (
    GraphEpisode,
    GraphPhase,
    GraphProcess,
    GraphRates,
    GraphsAnswer,
)
from fleetd.analyze.reading.data import Node, code, in_list
from fleetd.analyze.reading.rows import OpRow
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import GRAPH_LAUNCHES
from fleetd.store.timeparse import format_ns

PHASES: dict[str, tuple[str, ...]] = {
    "begin_capture": ("cudaStreamBeginCapture",),
    "end_capture": ("cudaStreamEndCapture",),
    "instantiate": ("cudaGraphInstantiate",),
    "update": ("cudaGraphExecUpdate",),
    "launch": GRAPH_LAUNCHES.names,
    "destroy": ("cudaGraphExecDestroy",),
}
PHASE_OF = {code(op): phase for phase, ops in PHASES.items() for op in ops}
# Calls that build a graph rather than run one: their time is the cost of (re)capture.
BUILD_PHASES = frozenset({"begin_capture", "end_capture", "instantiate", "update"})
TIMELINE_COLUMNS = ["start", "captures", "instantiations", "updates", "launches",
                    "launches_per_s", "build_ms"]
# Below this many replays per instantiation, a graph costs more than it saves.
MIN_REPLAYS = 10
MIN_BUILDS = 3  # fewer instantiations are warm-up (one graph per shape), not re-capture
RATE_DROP = 0.5  # launch rate during capture episodes this much below outside: re-capture
BUILD_SHARE = 0.05  # or this share of wall time spent capturing/instantiating


@dataclass(slots=True)
class _Run:
    """A run of timeline buckets that build graphs, summed (a :class:`GraphEpisode`)."""

    start: str
    buckets: int = 0
    captures: int = 0
    instantiations: int = 0
    updates: int = 0
    launches: int = 0
    build_ms: float = 0.0


@dataclass(slots=True)
class _Proc:
    pid: int
    calls: list[tuple[int, int, str]] = field(default_factory=list)  # ts, dur, phase


def graph_lifecycle(slices: list[NodeSlice], win: Window, pid: int | None = None,
                    buckets: int = 20) -> GraphsAnswer:
    """Every process with CUDA graph calls in the window, node by node."""
    procs: list[GraphProcess] = []
    for sl in slices:
        stats = [r for r in sl.op_stats(pid, True)
                 if r["source"] == "graph" or r["op"] == "cuGraphLaunch"]
        for p in _load(sl.conn, sl.node, win, pid).values():
            mine = [r for r in stats if r["pid"] == p.pid]
            procs.append(_process(sl.node, p, mine, sl.names.get(p.pid), sl.span, buckets))
    procs.sort(key=lambda p: -int(p["phases"]["instantiate"]["count"]
                                  if "instantiate" in p["phases"] else 0))
    return {"window": win.to_json(), "processes": procs, "warnings": list(win.warnings)}


def _load(conn: sqlite3.Connection, n: Node, win: Window, pid: int | None) -> dict[int, _Proc]:
    sql = ("SELECT pid, ts_ns, dur_ns, op FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
           f"AND id BETWEEN ? AND ? AND op IN {in_list(PHASE_OF)}")
    params: list[int] = [win.start_ns, win.end_ns, n.lo, n.hi]
    if pid is not None:
        sql += " AND pid = ?"
        params.append(pid)
    out: dict[int, _Proc] = {}
    for p, ts, dur, op in conn.execute(sql + " ORDER BY ts_ns", params):
        out.setdefault(int(p), _Proc(int(p))).calls.append((int(ts), int(dur), PHASE_OF[op]))
    return out


def _process(n: Node, p: _Proc, stats: list[OpRow], comm: str | None,
             span: tuple[int, int], buckets: int) -> GraphProcess:
    span_ns = max(1, span[1] - span[0])
    phases = _phases(stats, p)
    count = {ph: int(v["count"]) for ph, v in phases.items()}
    build_ns = sum(int(v["total_ns"] or 0) for ph, v in phases.items() if ph in BUILD_PHASES)
    builds = count.get("instantiate", 0) + count.get("update", 0)
    launches = count.get("launch", 0)
    rows, width = _timeline(p, span, buckets)
    episodes, rate_in, rate_out = _episodes(rows, width)
    rates: GraphRates = {
        "launches_per_s": round(launches / (span_ns / 1e9), 2),
        "instantiations_per_s": round(count.get("instantiate", 0) / (span_ns / 1e9), 3),
        "launches_per_instantiation": round(launches / builds, 1) if builds else None,
        "build_share_of_wall": round(build_ns / span_ns, 4),
        "launches_per_s_outside_captures": rate_out,
        "launches_per_s_during_captures": rate_in,
    }
    return {
        "node": n.name, "pid": p.pid, "comm": comm, "phases": phases, "rates": rates,
        "first_capture": _first(p, "begin_capture"), "episodes": episodes,
        "timeline": {"bucket_ns": width, "columns": TIMELINE_COLUMNS, "rows": rows},
        "verdict": _verdict(count, rates, episodes),
    }


def _phases(stats: list[OpRow], p: _Proc) -> dict[str, GraphPhase]:
    """Per phase: count and latency; the stats rows (histogram-aware) when there are."""
    out: dict[str, GraphPhase] = {}
    for r in stats:
        ph = PHASE_OF[code(r["op"])]
        prev = out.get(ph)
        if prev is None or r["count"] > prev["count"]:
            out[ph] = GraphPhase(count=r["count"], total_ns=r["total_ns"], p50_ns=r["p50_ns"],
                                 p99_ns=r["p99_ns"], max_ns=r["max_ns"])
    # A phase without a stats row (none in the window's timed ops): count its events.
    for ph in {ph for _, _, ph in p.calls} - set(out):
        durs = [d for _, d, x in p.calls if x == ph]
        out[ph] = GraphPhase(count=len(durs), total_ns=sum(durs), p50_ns=None, p99_ns=None,
                             max_ns=max(durs))
    return {ph: out[ph] for ph in PHASES if ph in out}


def _timeline(p: _Proc, span: tuple[int, int], buckets: int) -> tuple[list[list[Any]], int]:
    width = max(1, -(-(span[1] - span[0]) // buckets))
    acc: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for ts, dur, ph in p.calls:
        b = min(buckets - 1, max(0, (ts - span[0]) // width))
        acc[b][ph] += 1
        if ph in BUILD_PHASES:
            acc[b]["build_ns"] += dur
    rows = []
    for b in range(buckets):
        a = acc.get(b, {})
        rows.append([format_ns(span[0] + b * width), a.get("begin_capture", 0),
                     a.get("instantiate", 0), a.get("update", 0), a.get("launch", 0),
                     round(a.get("launch", 0) / (width / 1e9), 1),
                     round(a.get("build_ns", 0) / 1e6, 3)])
    return rows, width


def _episodes(rows: list[list[Any]], width: int
              ) -> tuple[list[GraphEpisode], float | None, float | None]:
    """Runs of buckets that instantiate or update graphs (the expensive part of a
    capture), and the launch rate inside them versus outside."""
    runs: list[_Run] = []
    inside: list[float] = []
    outside: list[float] = []
    current: _Run | None = None
    for row in rows:  # TIMELINE_COLUMNS
        building = row[2] + row[3] > 0
        (inside if building else outside).append(row[5])
        if building:
            if current is None:
                current = _Run(row[0])
                runs.append(current)
            current.buckets += 1
            current.captures += row[1]
            current.instantiations += row[2]
            current.updates += row[3]
            current.launches += row[4]
            current.build_ms += row[6]
        else:
            current = None
    episodes = [GraphEpisode(start=e.start, captures=e.captures,
                             instantiations=e.instantiations, updates=e.updates,
                             launches=e.launches, build_ms=round(e.build_ms, 3),
                             duration_ms=round(e.buckets * width / 1e6, 1)) for e in runs]
    rate_in = round(sum(inside) / len(inside), 1) if inside else None
    rate_out = round(sum(outside) / len(outside), 1) if outside else None
    return episodes, rate_in, rate_out


def _first(p: _Proc, phase: str) -> str | None:
    return next((format_ns(ts) for ts, _, ph in p.calls if ph == phase), None)


def _verdict(count: dict[str, int], rates: GraphRates, episodes: list[GraphEpisode]) -> str:
    builds = count.get("instantiate", 0) + count.get("update", 0)
    launches = count.get("launch", 0)
    if builds == 0:
        return (f"{launches} graph launch(es) and no capture in the window: graphs built "
                "earlier are being replayed")
    per = rates["launches_per_instantiation"] or 0
    r_in = rates["launches_per_s_during_captures"]
    r_out = rates["launches_per_s_outside_captures"]
    drop = (1 - r_in / r_out) if r_in is not None and r_out else 0.0
    share = rates["build_share_of_wall"]
    recapturing = builds >= MIN_BUILDS and (
        per < MIN_REPLAYS or share >= BUILD_SHARE or (drop >= RATE_DROP and len(episodes) > 1))
    if not recapturing:
        return (f"healthy: {builds} instantiation(s)/update(s), {launches} launches "
                f"({per:g} per instantiation)")
    parts = [f"re-capturing: {count.get('begin_capture', 0)} capture(s) and {builds} "
             f"instantiation(s)/update(s) in {len(episodes)} episode(s), {per:g} "
             "launches per instantiation"]
    if r_out:
        parts.append(f"launch rate {r_out:g}/s outside captures vs {r_in or 0:g}/s during "
                     f"({drop:.0%} drop)")
    parts.append(f"capturing/instantiating took {share:.1%} of wall time")
    return "; ".join(parts) + ("; keep input shapes static (pad or bucket them) so one "
                               "captured graph is replayed, or update it with "
                               "cudaGraphExecUpdate instead of re-instantiating")
