"""The GPU side of a node: where device time went, how late kernels started after their
launch call, and whether host overhead starves the GPU (the M1-M5 method).

Everything is computed per process and device (a rank) from the exact nanosecond times
of the imported GPU rows (``gpu_data``), each kernel joined to the host call that
launched it by the link the importer stored (correlation id -> launch event):

- temporal breakdown over the rank's window (first GPU start .. last GPU end, or whole
  profiler steps with ``steps_only``): idle = window minus the union of every kernel,
  copy and set; compute = union of non-NCCL kernels; communication = union of NCCL
  kernels; memcpy = union of copies and sets. The busy parts may overlap (streams run
  side by side), so they need not add up to 100 with idle.
- launch delay = kernel GPU start - launch call start; TKLQT (the SKIP paper's total
  kernel launch and queuing time) = their sum. Queue delay (HTA's) = kernel start -
  launch call end, clipped at 0.
- M1 GPU idle ratio, M2 launch overhead ratio (time inside the launch calls over the
  window), M4 GPU utilization (union of kernels over the window), M5 NCCL ratio (NCCL
  kernel time over kernel time); the verdict is YES when M1, M2 or M4 crosses its
  threshold, and M5 above its own is reported as a caveat. Each profiler step is a
  phase with its own verdict, which can raise the overall verdict but never lower it.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetd.analyze.model import NodeSlice
from fleetd.analyze.stragglers import Metric, score_metric
from fleetd.analyze.window import Window
from fleetd.errors import UsageError

KERNEL, MEMCPY, MEMSET = 1, 2, 3
STEP = 1  # annotation_data.kind of a profiler step
WHOLE = "whole recording"  # the label of a window the user did not narrow
THRESHOLDS: dict[str, float] = {"M1": 0.30, "M2": 0.10, "M4": 0.60, "M5": 0.20}
# Which side of its threshold means "host overhead": above for all but utilization.
_ABOVE = {"M1": True, "M2": True, "M4": False, "M5": True}
_WHAT = {"M1": "GPU idle ratio", "M2": "launch overhead ratio", "M4": "GPU utilization",
         "M5": "NCCL ratio"}
NOTE_NO_GPU = ("no GPU activity in this window: import an nsys export or a PyTorch "
               "profiler trace with fleetd import")

Interval = tuple[int, int]  # [start, end)


@dataclass(slots=True)
class Op:
    ts: int
    dur: int
    kind: int
    name: str
    nccl: bool
    launch_ts: int | None
    launch_dur: int | None


@dataclass(slots=True)
class Rank:
    node: str
    pid: int
    device: int
    rank: int | None
    ops: list[Op] = field(default_factory=list)


def parse_thresholds(specs: Iterable[str]) -> dict[str, float]:
    """``M1=0.25`` overrides; unknown metrics and non-numbers are usage errors."""
    out = dict(THRESHOLDS)
    for spec in specs:
        key, eq, value = spec.partition("=")
        key = key.strip().upper()
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or key not in THRESHOLDS or not math.isfinite(number):
            raise UsageError(f"invalid --threshold {spec!r}",
                             f"write METRIC=VALUE with METRIC one of {', '.join(THRESHOLDS)}")
        out[key] = number
    return out


# ---- reading ---------------------------------------------------------------------------


def load_ranks(sl: NodeSlice, pid: int | None = None) -> list[Rank]:
    """The node's kernels, copies and sets in the window, grouped by (pid, device)."""
    node = sl.node
    win = sl.window
    bounds = "" if win.label == WHOLE else "AND g.ts_ns < ? AND g.ts_ns + g.dur_ns > ?"
    params: list[Any] = [node.lo, node.hi]
    if win.label != WHOLE:
        params += [win.end_ns, win.start_ns]
    only = ""
    if pid is not None:
        only = "AND g.pid = ?"
        params.append(pid)
    rows = sl.conn.execute(
        "SELECT g.pid, g.device, g.ts_ns, g.dur_ns, g.kind, coalesce(s.name, ''), "
        "g.collective != 0, e.ts_ns, e.dur_ns FROM gpu_data g "
        "LEFT JOIN gpu_names s ON s.hash = g.name "
        "LEFT JOIN event_data e ON g.launch != 0 AND e.id = ((g.id >> 40) << 40) | g.launch "
        f"WHERE g.id BETWEEN ? AND ? AND g.kind IN (1, 2, 3) {bounds} {only} "
        "ORDER BY g.ts_ns", params)
    groups: dict[tuple[int, int], Rank] = {}
    ranks = _process_ranks(sl.conn, node.key)
    for p, dev, ts, dur, kind, name, nccl, lts, ldur in rows:
        r = groups.get((p, dev))
        if r is None:
            r = groups[(p, dev)] = Rank(node.name, int(p), int(dev), ranks.get(int(p)))
        r.ops.append(Op(int(ts), int(dur), int(kind), str(name), bool(nccl),
                        None if lts is None else int(lts), None if ldur is None else int(ldur)))
    return [groups[k] for k in sorted(groups)]


def _process_ranks(conn: sqlite3.Connection, key: int) -> dict[int, int | None]:
    return {int(p): r for p, r in conn.execute(
        "SELECT pid, rank FROM process_data WHERE node = ?", (key,))}


def load_steps(sl: NodeSlice, pid: int) -> list[tuple[str, int, int]]:
    """The process's profiler steps (name, start, end), in time order."""
    return [(str(n), int(t), int(t) + int(d)) for n, t, d in sl.conn.execute(
        "SELECT coalesce(s.name, ''), a.ts_ns, a.dur_ns FROM annotation_data a "
        "LEFT JOIN gpu_names s ON s.hash = a.name WHERE a.id BETWEEN ? AND ? AND a.pid = ? "
        "AND a.kind = ? ORDER BY a.ts_ns", (sl.node.lo, sl.node.hi, pid, STEP))]


# ---- arithmetic ------------------------------------------------------------------------


def union_ns(intervals: Iterable[Interval], lo: int, hi: int) -> int:
    """Length of the union of ``intervals`` clipped to [lo, hi)."""
    total = 0
    cur_s = cur_e = None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Sequence[int]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None}
    v = sorted(values)
    return {"count": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50),
            "p95": percentile(v, 95), "max": v[-1]}


# ---- one rank ----------------------------------------------------------------------------


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def breakdown(ops: Sequence[Op], lo: int, hi: int) -> dict[str, Any]:
    """Temporal breakdown, launch delays and the M metrics of ``ops`` over [lo, hi)."""
    window = max(0, hi - lo)
    spans = [(o.ts, o.ts + o.dur) for o in ops]
    kernels = [o for o in ops if o.kind == KERNEL and lo <= o.ts < hi]
    busy = union_ns(spans, lo, hi)
    compute = union_ns(((o.ts, o.ts + o.dur) for o in ops if o.kind == KERNEL and not o.nccl),
                       lo, hi)
    comm = union_ns(((o.ts, o.ts + o.dur) for o in ops if o.kind == KERNEL and o.nccl), lo, hi)
    copies = union_ns(((o.ts, o.ts + o.dur) for o in ops if o.kind != KERNEL), lo, hi)
    all_kernels = union_ns(((o.ts, o.ts + o.dur) for o in ops if o.kind == KERNEL), lo, hi)
    launched = [o for o in kernels if o.launch_ts is not None]
    delays = [o.ts - int(o.launch_ts or 0) for o in launched]
    queues = [max(0, o.ts - int(o.launch_ts or 0) - int(o.launch_dur or 0)) for o in launched]
    launch_time = sum(int(o.launch_dur or 0) for o in launched)
    idle = window - busy
    metrics = {
        "M1": idle / window if window else None,
        "M2": launch_time / window if window else None,
        "M4": all_kernels / window if window else None,
        "M5": comm / all_kernels if all_kernels else 0.0,
    }
    return {
        "window_ns": window, "idle_ns": idle, "idle_pct": _pct(idle, window),
        "compute_pct": _pct(compute, window), "comm_pct": _pct(comm, window),
        "memcpy_pct": _pct(copies, window), "kernels": len(kernels),
        "nccl_kernels": sum(1 for o in kernels if o.nccl), "nccl_ns": comm,
        "launches": len(launched), "tklqt_ns": sum(delays),
        "launch_delay_ns": distribution(delays), "queue_delay_ns": distribution(queues),
        "metrics": metrics,
    }


def verdict(metrics: Mapping[str, float | None], thresholds: Mapping[str, float]
            ) -> dict[str, Any]:
    """YES when M1, M2 or M4 is on the host-overhead side of its threshold."""
    crossed: list[str] = []
    caveats: list[str] = []
    for key, limit in thresholds.items():
        value = metrics.get(key)
        if value is None:
            continue
        over = value > limit if _ABOVE[key] else value < limit
        if not over:
            continue
        line = (f"{key} {_WHAT[key]} {value:.3f} {'>' if _ABOVE[key] else '<'} {limit:g}")
        (caveats if key == "M5" else crossed).append(line)
    if caveats:
        caveats = [c + ": communication is a large share of GPU time and may explain "
                   "part of the waiting" for c in caveats]
    return {"host_overhead": "YES" if crossed else "NO", "metrics": dict(metrics),
            "thresholds": dict(thresholds), "evidence": crossed, "caveats": caveats}


def tklqt_reading(queue_p50: float | None, kernel_p50: float | None) -> str:
    """The SKIP paper's reading of launch-and-queue time: when the typical kernel waits
    in the queue longer than a typical kernel runs, work piles up on the device
    (GPU-bound); when it starts about as soon as it is launched, the device waits for
    the host (CPU-bound)."""
    if queue_p50 is None or kernel_p50 is None:
        return "unknown"
    return "GPU-bound" if queue_p50 > kernel_p50 else "CPU-bound"


def rank_report(r: Rank, steps: Sequence[tuple[str, int, int]], steps_only: bool,
                thresholds: Mapping[str, float], window: Window) -> dict[str, Any]:
    lo = min(o.ts for o in r.ops)
    hi = max(o.ts + o.dur for o in r.ops)
    if window.label != WHOLE:
        lo, hi = max(lo, window.start_ns), min(hi, window.end_ns)
    inside = [s for s in steps if s[1] >= lo and s[2] <= hi] if steps_only else steps
    if steps_only and inside:
        lo, hi = inside[0][1], max(s[2] for s in inside)
    b = breakdown(r.ops, lo, hi)
    v = verdict(b.pop("metrics"), thresholds)
    per_step = [_step(r.ops, name, s, e, thresholds) for name, s, e in inside]
    raised = [f"{p['name']}: {line}" for p in per_step if p["host_overhead"] == "YES"
              for line in p["evidence"]]
    if v["host_overhead"] == "NO" and raised:
        v["host_overhead"] = "YES"  # a phase can raise the verdict, never lower it
    v["phases"] = raised
    durs = sorted(o.dur for o in r.ops if o.kind == KERNEL and lo <= o.ts < hi)
    reading = tklqt_reading(b["queue_delay_ns"]["p50"], percentile(durs, 50) if durs else None)
    return {"node": r.node, "pid": r.pid, "rank": r.rank, "device": r.device,
            "start_ns": lo, "end_ns": hi, **b,
            "tklqt_reading": reading,
            "verdict": v, "steps": per_step}


def _step(ops: Sequence[Op], name: str, lo: int, hi: int, thresholds: Mapping[str, float]
          ) -> dict[str, Any]:
    b = breakdown([o for o in ops if o.ts < hi and o.ts + o.dur > lo], lo, hi)
    v = verdict(b["metrics"], thresholds)
    return {"name": name, "start_ns": lo, "step_ns": hi - lo, "idle_ns": b["idle_ns"],
            "idle_pct": b["idle_pct"], "kernels": b["kernels"], "launches": b["launches"],
            "tklqt_ns": b["tklqt_ns"], "metrics": b["metrics"],
            "host_overhead": v["host_overhead"], "evidence": v["evidence"]}


def kernel_table(ranks: Sequence[Rank]) -> list[dict[str, Any]]:
    """Kernels by name over every rank: count, total, mean, p50, p99, share of kernel time."""
    by_name: dict[str, list[int]] = {}
    for r in ranks:
        for o in r.ops:
            if o.kind == KERNEL:
                by_name.setdefault(o.name, []).append(o.dur)
    grand = sum(sum(v) for v in by_name.values())
    out: list[dict[str, Any]] = []
    for name, durs in by_name.items():
        durs.sort()
        total = sum(durs)
        out.append({"name": name, "count": len(durs), "total_ns": total,
                    "mean_ns": total / len(durs), "p50_ns": percentile(durs, 50),
                    "p99_ns": percentile(durs, 99), "share_pct": _pct(total, grand)})
    out.sort(key=lambda k: (-int(k["total_ns"]), str(k["name"])))
    return out


def gpu_report(slices: Sequence[NodeSlice], window: Window, pid: int | None = None,
               steps_only: bool = False, thresholds: Mapping[str, float] | None = None
               ) -> dict[str, Any]:
    """Every rank of every node in ``slices``; the shape is documented in docs/json.md."""
    limits = dict(thresholds or THRESHOLDS)
    ranks: list[Rank] = []
    out: list[dict[str, Any]] = []
    warnings = list(window.warnings)
    for sl in slices:
        for r in load_ranks(sl, pid):
            if not r.ops:
                continue
            ranks.append(r)
            steps = load_steps(sl, r.pid)
            if steps_only and not steps:
                warnings.append(f"{r.node} pid {r.pid}: no profiler steps, so --steps "
                                "uses the whole recording")
            out.append(rank_report(r, steps, steps_only, limits, window))
    report: dict[str, Any] = {"window": window.to_json(), "ranks": out,
                              "kernels": kernel_table(ranks), "warnings": warnings,
                              "straggler": slowest_rank(out)}
    if not out:
        report["note"] = NOTE_NO_GPU
    return report


# ---- comparing ranks -------------------------------------------------------------------

# Step time (or the whole window without steps) and the GPU idle share, scored like the
# nodes' straggler features: relative to the best rank, with the robust z beyond two.
RANK_METRICS = (Metric("step_ns", "latency", 0.8, primary=True),
                Metric("idle_share", "share", 0.8, primary=True))


def rank_features(r: Mapping[str, Any]) -> dict[str, float]:
    steps = [s["step_ns"] for s in r.get("steps") or [] if isinstance(s.get("step_ns"), int)]
    step = sum(steps) / len(steps) if steps else float(r.get("window_ns") or 0)
    return {"step_ns": step, "idle_share": float(r.get("idle_pct") or 0.0) / 100.0}


def slowest_rank(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The slowest of two or more ranks, with the straggler scoring of ``explain``;
    ``flagged`` says whether it is beyond the fleet's spread. None for a single rank."""
    if len(ranks) < 2:
        return None
    keys = {f"{r['node']}/{r['pid']}/{r['device']}": r for r in ranks}
    scored = [(k, sc) for m in RANK_METRICS
              for k, sc in score_metric(m, {k: rank_features(r)[m.name]
                                            for k, r in keys.items()}).items()]
    # A flagged score first, then the lowest: the rank furthest behind the best one.
    key, sc = min(scored, key=lambda ks: (not ks[1].flagged, ks[1].score, ks[0]))
    score = sc.score
    r = keys[key]
    z = "" if sc.z is None else f", robust z {sc.z:.1f}"
    return {"node": r["node"], "pid": r["pid"], "rank": r.get("rank"), "device": r["device"],
            "metric": sc.metric.name, "value": sc.value, "median": sc.median, "best": sc.best,
            "score": round(score, 4), "flagged": sc.flagged,
            "reason": f"{sc.metric.name} {sc.value:.4g} vs median {sc.median:.4g} and best "
                      f"{sc.best:.4g}: {1 - score:.0%} slower than the best rank{z}"
                      + ("" if sc.flagged else " (within the ranks' spread)")}
