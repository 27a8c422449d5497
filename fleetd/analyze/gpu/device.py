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
- M3, exposed host preparation: host preparation is the union of the ranges the
  process marked on the host (NVTX ranges, ``user_annotation`` and ``cpu_op`` ranges;
  profiler steps excluded, as they hold everything); the exposed part is what of it
  falls where the GPU was idle. M3a = exposed / host prep (how badly it is pipelined),
  M3b = exposed / window (what it costs), M3c = exposed / GPU idle (how much of the idle
  it explains). Host prep is a confirmed bottleneck, and the verdict YES, only when M3b
  and M3c both cross their thresholds; M3a alone is a caveat. Without such ranges the
  three are null and ``m3.reason`` says why.
- where the verdict is YES and the tracer sampled the process on the CPU, ``host_frames``
  says what its busiest thread ran while the GPU idled: its samples in the idle gaps and
  their top frames (:mod:`fleetd.analyze.causes.idle_frames`).
- thresholds may be set per phase (``PHASE:M1=0.4``): a step whose name matches PHASE
  (exactly, or as a glob) is judged with them.
"""

from __future__ import annotations

import fnmatch
import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from fleetd.analyze.causes.idle_frames import during_idle
from fleetd.analyze.distributed.stragglers import Metric, score_metric
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.answers import (
    Delays,
    ExposedPrep,
    GpuAnswer,
    GpuFigures,
    GpuRank,
    GpuStep,
    Judgement,
    KernelRow,
    RankStraggler,
    RankVerdict,
)
from fleetd.analyze.reading.window import Window
from fleetd.errors import UsageError
from fleetd.store.db import present_tables

KERNEL, MEMCPY, MEMSET = 1, 2, 3
STEP = 1  # annotation_data.kind of a profiler step
PREP_KINDS = (2, 3, 4)  # nvtx, user_annotation, cpu_op: host ranges that prepare GPU work
WHOLE = "whole recording"  # the label of a window the user did not narrow
THRESHOLDS: dict[str, float] = {"M1": 0.30, "M2": 0.10, "M3a": 0.50, "M3b": 0.05,
                                "M3c": 0.50, "M4": 0.60, "M5": 0.20}
# Which side of its threshold means "host overhead": above for all but utilization.
# Which side of its threshold a metric counts on: above (True) or below (M4).
OVERHEAD_ABOVE = {"M1": True, "M2": True, "M3a": True, "M3b": True, "M3c": True,
                  "M4": False, "M5": True}
_WHAT = {"M1": "GPU idle ratio", "M2": "launch overhead ratio",
         "M3a": "host prep exposed ratio", "M3b": "host prep perf impact",
         "M3c": "host prep idle attribution", "M4": "GPU utilization", "M5": "NCCL ratio"}
_CAVEATS = ("M3a", "M5")  # reported beside the verdict, never deciding it alone
_CONFIRM = ("M3b", "M3c")  # host prep is a bottleneck only when both cross
NO_PREP = ("no host ranges (NVTX, user_annotation or cpu_op) besides profiler steps for "
           "this process, so host preparation cannot be told from the rest of the host's "
           "time: mark it with NVTX ranges (nsys -t nvtx) or profile with CPU activity "
           "on (PyTorch profiler: cpu_op and record_function ranges)")
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


_METRIC_NAMES = {k.upper(): k for k in THRESHOLDS}


def parse_thresholds(specs: Iterable[str]) -> dict[str, float]:
    """``M1=0.25`` overrides a default; ``PHASE:M1=0.4`` sets one for the steps whose
    name matches PHASE (kept under the key ``PHASE:M1``). Unknown metrics, non-numbers
    and phase names with a comma (the node API's list separator) are usage errors."""
    out = dict(THRESHOLDS)
    for spec in specs:
        key, eq, value = spec.rpartition("=")
        phase, colon, metric = key.rpartition(":")
        name = _METRIC_NAMES.get(metric.strip().upper())
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or name is None or not math.isfinite(number) or (
                colon and (not phase.strip() or "," in phase)):
            raise UsageError(f"invalid --threshold {spec!r}",
                             "write METRIC=VALUE or PHASE:METRIC=VALUE with METRIC one of "
                             f"{', '.join(THRESHOLDS)} and PHASE a step name or glob "
                             "(ProfilerStep#3, ProfilerStep*) without commas")
        out[f"{phase.strip()}:{name}" if colon else name] = number
    return out


def phase_limits(thresholds: Mapping[str, float], phase: str) -> dict[str, float]:
    """The thresholds a step named ``phase`` is judged by: the global ones, then every
    phase pattern that matches it, in the order given."""
    out = {k: v for k, v in thresholds.items() if ":" not in k}
    for key, value in thresholds.items():
        pattern, colon, metric = key.rpartition(":")
        if colon and (pattern == phase or fnmatch.fnmatchcase(phase, pattern)):
            out[metric] = value
    return out


# ---- reading ---------------------------------------------------------------------------


def load_ranks(sl: NodeSlice, pid: int | None = None) -> list[Rank]:
    """The node's kernels, copies and sets in the window, grouped by (pid, device)."""
    if len(present_tables(sl.conn, ("gpu_data", "gpu_names"))) < 2:
        return []  # a file of schema 1 has no GPU tables: nothing was imported into it
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


def load_prep(sl: NodeSlice, pid: int) -> list[Interval]:
    """The process's host ranges other than profiler steps: its host preparation."""
    kinds = ", ".join(map(str, PREP_KINDS))
    return [(int(t), int(t) + int(d)) for t, d in sl.conn.execute(
        "SELECT ts_ns, dur_ns FROM annotation_data WHERE id BETWEEN ? AND ? AND pid = ? "
        f"AND kind IN ({kinds})", (sl.node.lo, sl.node.hi, pid))]


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


def distribution(values: Sequence[int]) -> Delays:
    if not values:
        return Delays(count=0, mean=None, p50=None, p95=None, max=None)
    v = sorted(values)
    return Delays(count=len(v), mean=sum(v) / len(v), p50=percentile(v, 50),
                  p95=percentile(v, 95), max=v[-1])


# ---- one rank ----------------------------------------------------------------------------


def _pct(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def exposed_prep(prep: Sequence[Interval], busy: Sequence[Interval], lo: int, hi: int
                 ) -> ExposedPrep:
    """M3: how much of the host preparation in [lo, hi) fell where the GPU was idle.
    Exposed = |prep ∩ idle| = |prep ∪ busy| - |busy|, all clipped to the window."""
    if not prep:
        return ExposedPrep(M3a=None, M3b=None, M3c=None, host_prep_ns=None, exposed_ns=None,
                           reason=NO_PREP)
    window = max(0, hi - lo)
    gpu = union_ns(busy, lo, hi)
    host = union_ns(prep, lo, hi)
    exposed = union_ns([*prep, *busy], lo, hi) - gpu
    idle = window - gpu
    return ExposedPrep(M3a=exposed / host if host else None,
                       M3b=exposed / window if window else None,
                       M3c=exposed / idle if idle else 0.0,
                       host_prep_ns=host, exposed_ns=exposed,
                       reason=None if host else "no host preparation inside this window")


def breakdown(ops: Sequence[Op], lo: int, hi: int, prep: Sequence[Interval] = ()
              ) -> tuple[GpuFigures, dict[str, float | None]]:
    """Temporal breakdown and launch delays of ``ops`` over [lo, hi), and the M metrics
    by name; ``prep`` the process's host preparation ranges (M3)."""
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
    m3 = exposed_prep(prep, spans, lo, hi)
    metrics: dict[str, float | None] = {
        "M1": idle / window if window else None,
        "M2": launch_time / window if window else None,
        "M3a": m3["M3a"], "M3b": m3["M3b"], "M3c": m3["M3c"],
        "M4": all_kernels / window if window else None,
        "M5": comm / all_kernels if all_kernels else 0.0,
    }
    figures: GpuFigures = {
        "m3": m3, "window_ns": window, "idle_ns": idle, "idle_pct": _pct(idle, window),
        "compute_pct": _pct(compute, window), "comm_pct": _pct(comm, window),
        "memcpy_pct": _pct(copies, window), "kernels": len(kernels),
        "nccl_kernels": sum(1 for o in kernels if o.nccl), "nccl_ns": comm,
        "launches": len(launched), "tklqt_ns": sum(delays),
        "launch_delay_ns": distribution(delays), "queue_delay_ns": distribution(queues),
    }
    return figures, metrics


_CAVEAT_WHY = {"M5": "communication is a large share of GPU time and may explain part "
                     "of the waiting",
               "M3a": "most host preparation runs while the GPU idles: it is poorly "
                      "pipelined with the GPU work"}


def verdict(metrics: Mapping[str, float | None], thresholds: Mapping[str, float]
            ) -> Judgement:
    """YES when M1, M2 or M4 is on the host-overhead side of its threshold, or when M3b
    and M3c both are (host preparation confirmed); M3a and M5 are caveats."""
    limits = {k: v for k, v in thresholds.items() if ":" not in k}
    lines: dict[str, str] = {}
    for key, limit in limits.items():
        value = metrics.get(key)
        if value is None or not (value > limit if OVERHEAD_ABOVE[key] else value < limit):
            continue
        side = ">" if OVERHEAD_ABOVE[key] else "<"
        lines[key] = f"{key} {_WHAT[key]} {value:.3f} {side} {limit:g}"
    confirmed = all(k in lines for k in _CONFIRM)
    crossed = [line for k, line in lines.items() if k not in _CAVEATS and k not in _CONFIRM]
    if confirmed:
        crossed.append(" and ".join(lines[k] for k in _CONFIRM) +
                       ": host preparation confirmed as a bottleneck")
    caveats = [f"{lines[k]}: {_CAVEAT_WHY[k]}" for k in _CAVEATS if k in lines]
    return {"host_overhead": "YES" if crossed else "NO", "metrics": dict(metrics),
            "thresholds": limits, "evidence": crossed, "caveats": caveats,
            "host_prep": "confirmed" if confirmed else "unknown" if metrics.get(
                "M3b") is None else "not confirmed"}


def tklqt_reading(queue_p50: float | None, kernel_p50: float | None) -> str:
    """The SKIP paper's reading of launch-and-queue time: when the typical kernel waits
    in the queue longer than a typical kernel runs, work piles up on the device
    (GPU-bound); when it starts about as soon as it is launched, the device waits for
    the host (CPU-bound)."""
    if queue_p50 is None or kernel_p50 is None:
        return "unknown"
    return "GPU-bound" if queue_p50 > kernel_p50 else "CPU-bound"


# Spelled out where a table shows them first (the JSON keeps the short names).
TKLQT_WORDS = "TKLQT (total kernel launch and queuing time)"
M_WORDS = ("M1-M5 (the nsys host-overhead metrics: M1 GPU idle, M2 launch-bound, "
           "M3 exposed host preparation, M4 GPU utilization, M5 NCCL share)")


def one_verdict(host_overhead: str, reading: str) -> str:
    """The one sentence ``gpu`` and ``explain`` both print for a rank.

    M1-M5 decide (they measure the GPU's idle time and what the host did in it); the
    TKLQT reading only qualifies: kernels can queue behind long ones in a burst while
    the GPU still idles between bursts, which is not a contradiction but where the
    idle time sits."""
    if host_overhead == "YES":
        why = ("; launched kernels also queue behind running ones (TKLQT reads "
               "GPU-bound), so the idle time sits between bursts of work"
               if reading == "GPU-bound" else "")
        return f"host-bound: the GPU waits for the host (M1-M5){why}"
    if reading == "GPU-bound":
        return "GPU-bound: the host keeps the GPU fed and kernels queue behind running ones"
    if reading == "CPU-bound":
        return ("no host overhead by M1-M5; kernels start as soon as they are launched "
                "(TKLQT reads CPU-bound): the GPU keeps up with a host that keeps up")
    return "no host overhead by M1-M5 (TKLQT could not be read: no kernels)"


def rank_report(r: Rank, steps: Sequence[tuple[str, int, int]], steps_only: bool,
                thresholds: Mapping[str, float], window: Window,
                prep: Sequence[Interval] = ()) -> GpuRank:
    lo = min(o.ts for o in r.ops)
    hi = max(o.ts + o.dur for o in r.ops)
    if window.label != WHOLE:
        lo, hi = max(lo, window.start_ns), min(hi, window.end_ns)
    inside = [s for s in steps if s[1] >= lo and s[2] <= hi] if steps_only else steps
    if steps_only and inside:
        lo, hi = inside[0][1], max(s[2] for s in inside)
    b, metrics = breakdown(r.ops, lo, hi, prep)
    phased = {k: x for k, x in thresholds.items() if ":" in k}
    per_phase: _PhaseThresholds = {"phase_thresholds": _by_phase(phased)} if phased else {}
    per_step = [_step(r.ops, name, s, e, phase_limits(thresholds, name), prep)
                for name, s, e in inside]
    raised = [f"{p['name']}: {line}" for p in per_step if p["host_overhead"] == "YES"
              for line in p["evidence"]]
    v: RankVerdict = {**verdict(metrics, thresholds), **per_phase, "phases": raised}
    if v["host_overhead"] == "NO" and raised:
        v["host_overhead"] = "YES"  # a phase can raise the verdict, never lower it
    durs = sorted(o.dur for o in r.ops if o.kind == KERNEL and lo <= o.ts < hi)
    reading = tklqt_reading(b["queue_delay_ns"]["p50"], percentile(durs, 50) if durs else None)
    return {"node": r.node, "pid": r.pid, "rank": r.rank, "device": r.device,
            "start_ns": lo, "end_ns": hi, "m3": b["m3"], "window_ns": b["window_ns"],
            "idle_ns": b["idle_ns"], "idle_pct": b["idle_pct"],
            "compute_pct": b["compute_pct"], "comm_pct": b["comm_pct"],
            "memcpy_pct": b["memcpy_pct"], "kernels": b["kernels"],
            "nccl_kernels": b["nccl_kernels"], "nccl_ns": b["nccl_ns"],
            "launches": b["launches"], "tklqt_ns": b["tklqt_ns"],
            "launch_delay_ns": b["launch_delay_ns"], "queue_delay_ns": b["queue_delay_ns"],
            "tklqt_reading": reading, "summary": one_verdict(v["host_overhead"], reading),
            "verdict": v, "steps": per_step}


class _PhaseThresholds(TypedDict, total=False):
    phase_thresholds: dict[str, dict[str, float]]


def _by_phase(phased: Mapping[str, float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key, value in phased.items():
        pattern, _, metric = key.rpartition(":")
        out.setdefault(pattern, {})[metric] = value
    return out


def _step(ops: Sequence[Op], name: str, lo: int, hi: int, thresholds: Mapping[str, float],
          prep: Sequence[Interval] = ()) -> GpuStep:
    b, metrics = breakdown([o for o in ops if o.ts < hi and o.ts + o.dur > lo], lo, hi,
                           [p for p in prep if p[0] < hi and p[1] > lo])
    v = verdict(metrics, thresholds)
    return {"name": name, "start_ns": lo, "step_ns": hi - lo, "idle_ns": b["idle_ns"],
            "idle_pct": b["idle_pct"], "kernels": b["kernels"], "launches": b["launches"],
            "tklqt_ns": b["tklqt_ns"], "metrics": metrics,
            "host_overhead": v["host_overhead"], "evidence": v["evidence"]}


def kernel_table(ranks: Sequence[Rank]) -> list[KernelRow]:
    """Kernels by name over every rank: count, total, mean, p50, p99, share of kernel time."""
    by_name: dict[str, list[int]] = {}
    for r in ranks:
        for o in r.ops:
            if o.kind == KERNEL:
                by_name.setdefault(o.name, []).append(o.dur)
    grand = sum(sum(v) for v in by_name.values())
    out: list[KernelRow] = []
    for name, durs in by_name.items():
        durs.sort()
        total = sum(durs)
        out.append({"name": name, "count": len(durs), "total_ns": total,
                    "mean_ns": total / len(durs), "p50_ns": percentile(durs, 50),
                    "p99_ns": percentile(durs, 99), "share_pct": _pct(total, grand)})
    out.sort(key=lambda k: (-k["total_ns"], k["name"]))
    return out


def gpu_report(slices: Sequence[NodeSlice], window: Window, pid: int | None = None,
               steps_only: bool = False, thresholds: Mapping[str, float] | None = None
               ) -> GpuAnswer:
    """Every rank of every node in ``slices``; the shape is documented in docs/json.md."""
    limits = dict(thresholds or THRESHOLDS)
    ranks: list[Rank] = []
    out: list[GpuRank] = []
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
            rep = rank_report(r, steps, steps_only, limits, window, load_prep(sl, r.pid))
            if rep["verdict"]["host_overhead"] == "YES":
                # Host-bound: what the process's busiest thread ran while the GPU idled,
                # where the tracer sampled it (fleetd.analyze.causes.idle_frames).
                frames = during_idle(sl.conn, sl.node, sl.window, r.pid)
                if frames is not None:
                    rep["host_frames"] = frames
            out.append(rep)
    report: GpuAnswer = {"window": window.to_json(), "ranks": out,
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


def slowest_rank(ranks: Sequence[Mapping[str, Any]]) -> RankStraggler | None:
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
