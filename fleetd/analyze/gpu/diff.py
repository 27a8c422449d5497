"""Two GPU timelines compared: what got slower from a baseline to a target.

Works on two :func:`fleetd.analyze.gpu.device.gpu_report` results (each side one database: an
imported trace, a merged file, a node's recording with imports), in the manner of HTA's
trace diff and the nsys two-report comparison:

- the headline figures of each side (step time, GPU idle, kernel time, launches, launch
  delay, TKLQT) and their change; a side with several ranks is summed (counts and
  times) or averaged (shares, step time, delays) over its ranks;
- profiler steps paired by position (the n-th step of one side against the n-th of the
  other: step numbers differ between runs), the step time averaged over the side's ranks;
- kernel time by name over every rank of a side, biggest regression (target minus
  baseline total time) first; a kernel on one side only counts as zero on the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fleetd.analyze.reading.answers_diff import (
    DiffSide,
    GpuDiff,
    KernelDelta,
    MetricDelta,
    StepDelta,
)

# (name, how a side's figure is made from its ranks, True when larger is worse; None:
# not judged, a larger compute or communication share can be good or bad news)
_METRICS: tuple[tuple[str, str, bool | None], ...] = (
    ("step_ns", "mean", True),
    ("window_ns", "mean", True),
    ("idle_pct", "mean", True),
    ("compute_pct", "mean", None),
    ("comm_pct", "mean", None),
    ("kernel_ns", "sum", True),
    ("kernels", "sum", True),
    ("launches", "sum", True),
    ("launch_delay_p50_ns", "mean", True),
    ("queue_delay_p50_ns", "mean", True),
    ("tklqt_ns", "sum", True),
)


def _rank_figures(r: Mapping[str, Any]) -> dict[str, float | None]:
    steps = [int(s["step_ns"]) for s in r.get("steps") or []]
    return {
        "step_ns": sum(steps) / len(steps) if steps else None,
        "window_ns": float(r["window_ns"]),
        "idle_pct": float(r["idle_pct"]),
        "compute_pct": float(r["compute_pct"]),
        "comm_pct": float(r["comm_pct"]),
        "kernel_ns": None,  # filled from the kernel table: ranks do not carry it
        "kernels": float(r["kernels"]),
        "launches": float(r["launches"]),
        "launch_delay_p50_ns": _opt(r["launch_delay_ns"].get("p50")),
        "queue_delay_p50_ns": _opt(r["queue_delay_ns"].get("p50")),
        "tklqt_ns": float(r["tklqt_ns"]),
    }


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


def side_figures(report: Mapping[str, Any]) -> dict[str, float | None]:
    """One side's headline figures over its ranks."""
    per_rank = [_rank_figures(r) for r in report.get("ranks") or []]
    out: dict[str, float | None] = {}
    for name, how, _ in _METRICS:
        values = [v for f in per_rank if (v := f[name]) is not None]
        if not values:
            out[name] = None
        else:
            out[name] = sum(values) / len(values) if how == "mean" else float(sum(values))
    out["kernel_ns"] = float(sum(int(k["total_ns"]) for k in report.get("kernels") or []))
    return out


def _change(base: float | None, target: float | None) -> tuple[float | None, float | None]:
    if base is None or target is None:
        return None, None
    delta = target - base
    return delta, (100.0 * delta / base if base else None)


def metric_rows(base: Mapping[str, float | None], target: Mapping[str, float | None]
                ) -> list[MetricDelta]:
    rows: list[MetricDelta] = []
    for name, _, larger_worse in _METRICS:
        b, t = base.get(name), target.get(name)
        delta, pct = _change(b, t)
        worse = (None if delta is None or larger_worse is None
                 else delta > 0 if larger_worse else delta < 0)
        rows.append({"metric": name, "baseline": b, "target": t, "delta": delta,
                     "delta_pct": pct, "worse": worse})
    return rows


def step_rows(base: Mapping[str, Any], target: Mapping[str, Any]) -> list[StepDelta]:
    """Steps paired by position; each side's n-th step time averaged over its ranks."""
    def by_position(report: Mapping[str, Any]) -> list[tuple[str, float]]:
        cols: list[list[tuple[str, int]]] = []
        for r in report.get("ranks") or []:
            for i, s in enumerate(r.get("steps") or []):
                if i == len(cols):
                    cols.append([])
                cols[i].append((str(s["name"]), int(s["step_ns"])))
        return [(c[0][0], sum(ns for _, ns in c) / len(c)) for c in cols]

    b, t = by_position(base), by_position(target)
    rows: list[StepDelta] = []
    for i in range(max(len(b), len(t))):
        bn, bv = b[i] if i < len(b) else (None, None)
        tn, tv = t[i] if i < len(t) else (None, None)
        delta, pct = _change(bv, tv)
        rows.append({"index": i, "baseline_name": bn, "target_name": tn, "baseline_ns": bv,
                     "target_ns": tv, "delta_ns": delta, "delta_pct": pct})
    return rows


def kernel_rows(base: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]
                ) -> list[KernelDelta]:
    """Kernels by name, biggest increase of total time first (then name)."""
    b = {str(k["name"]): k for k in base}
    t = {str(k["name"]): k for k in target}
    rows: list[KernelDelta] = []
    for name in b.keys() | t.keys():
        kb, kt = b.get(name), t.get(name)
        bn, tn = (int(kb["total_ns"]) if kb else 0), (int(kt["total_ns"]) if kt else 0)
        bc, tc = (int(kb["count"]) if kb else 0), (int(kt["count"]) if kt else 0)
        rows.append({
            "name": name, "baseline_count": bc, "target_count": tc, "baseline_ns": bn,
            "target_ns": tn, "delta_ns": tn - bn,
            "delta_pct": 100.0 * (tn - bn) / bn if bn else None,
            "baseline_mean_ns": bn / bc if bc else None, "target_mean_ns": tn / tc if tc else None,
            "only_in": "baseline" if kt is None else "target" if kb is None else None})
    rows.sort(key=lambda r: (-r["delta_ns"], r["name"]))
    return rows


def _side(report: Mapping[str, Any], source: str) -> DiffSide:
    ranks = report.get("ranks") or []
    return {"source": source, "ranks": [
        {"node": r["node"], "pid": r["pid"], "rank": r.get("rank"), "device": r["device"]}
        for r in ranks], "figures": side_figures(report)}


def gpu_diff(base: Mapping[str, Any], target: Mapping[str, Any], base_source: str,
             target_source: str) -> GpuDiff:
    """The comparison; the shape is documented in docs/json.md (``fleetd diff``)."""
    warnings = [f"{which}: {w}" for which, rep in (("baseline", base), ("target", target))
                for w in rep.get("warnings") or []]
    for which, rep in (("baseline", base), ("target", target)):
        if not rep.get("ranks"):
            warnings.append(f"{which} has no GPU activity: import an nsys export or a "
                            "PyTorch profiler trace")
    bs, ts = _side(base, base_source), _side(target, target_source)
    metrics = metric_rows(bs["figures"], ts["figures"])
    return {"baseline": bs, "target": ts, "metrics": metrics,
            "regressions": [m["metric"] for m in sorted(
                (m for m in metrics if m["worse"] and m["delta_pct"] is not None),
                key=lambda m: -abs(m["delta_pct"] or 0.0))],
            "steps": step_rows(base, target),
            "kernels": kernel_rows(base.get("kernels") or [], target.get("kernels") or []),
            "warnings": warnings}
