"""``fleetd explain --format html``: one self-contained page drawn from explain's JSON.

:func:`write_report` is a pure function of the report (the object ``fleetd explain
--format json`` prints, local or ``--nodes``; docs/explain.md and docs/json.md) and
writes to a text stream. The page needs nothing from the network and runs no script:

- inline CSS and inline SVG, drawn here; no font, image, script or style sheet is
  fetched, and a Content-Security-Policy (``default-src 'none'``) tells the browser so;
- every string that came from a node (node names, process and thread names, frames,
  summaries, evidence, fixes, warnings) goes through :func:`html.escape`, in text and in
  attributes alike; CSS classes come from fixed tables, never from the data;
- the same report gives the same bytes (no clock is read, nothing is random).

Sections: the verdict and warnings; stragglers (each node's value of the metric that
makes a node slow, as a bar against the fleet median); where each traced thread's time
went (stacked bars of the shares of wall time, the columns of ``processes[].threads``);
op latency histograms (from the ``ops`` rows' percentiles: the share of calls between
p50, p95, p99 and the maximum, per unit of log latency); the causal chains with their
evidence (a timeline per slow call, then every item and the fixes).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from fleetd.analyze import pods
from fleetd.analyze.gpu import OVERHEAD_ABOVE
from fleetd.export.html_frames import flame_graph, top_frames_chart

# The per-thread columns that add up to the wall time (docs/explain.md), with a colour
# and a label each.
BREAKDOWN: tuple[tuple[str, str, str], ...] = (
    ("running_ns", "running", "#4caf50"),
    ("runq_ns", "run queue", "#e53935"),
    ("irq_ns", "IRQ", "#8e24aa"),
    ("d_state_ns", "D state", "#6d4c41"),
    ("lock_ns", "lock", "#fdd835"),
    ("data_ns", "waiting for data", "#1e88e5"),
    ("timer_ns", "timer", "#90a4ae"),
    ("gpu_sync_ns", "GPU sync", "#00897b"),
    ("other_ns", "other sleep", "#cfd8dc"),
)
SEVERITIES = ("HIGH", "MEDIUM", "LOW")
SEVERITY_CLASS = {"HIGH": "high", "MEDIUM": "medium", "LOW": "low"}
# Evidence kinds with a colour of their own on a chain's timeline; the rest are grey.
EVIDENCE_COLOURS = {
    "spike": "#1a237e", "stall": "#1a237e", "call": "#1a237e",
    "off_cpu": "#e53935", "runq_wait": "#fb8c00", "block_io": "#6d4c41",
    "hardirq": "#8e24aa", "softirq": "#ab47bc", "gpu_gap": "#00897b",
}
GPU_SOURCES = ("cuda", "driver", "graph", "nccl")
MAX_THREADS = 40  # rows of the breakdown chart
MAX_OPS_PER_NODE = 12  # histograms per node
MAX_STRAGGLER_CHARTS = 4  # metrics drawn
MAX_EVIDENCE_GROUPS = 5  # timelines per chain
MAX_GROUP_ITEMS = 12  # bars per timeline
DENSITY_DECADES = 3  # the height axis of the op histograms, log scale
LABEL_CHARS = 44  # longest label drawn inside a chart (the full text is in its tooltip)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #212121;
       margin: 0 auto; max-width: 1100px; padding: 1em 1.5em 3em; }
h1 { font-size: 1.5em; margin: .2em 0; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 2em; }
h3 { font-size: 1em; margin: 1.2em 0 .4em; }
nav a { margin-right: 1em; }
.meta, .note { color: #555; }
.verdict { font-weight: 600; padding: .5em .8em; background: #f5f5f5;
           border-left: 4px solid #9e9e9e; }
.verdict.high { border-color: #c62828; } .verdict.medium { border-color: #ef6c00; }
.verdict.quiet { border-color: #2e7d32; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
th, td { border-bottom: 1px solid #e0e0e0; padding: .25em .6em; text-align: left;
         vertical-align: top; }
th { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.node { white-space: nowrap; }
.warn { color: #8a4b00; }
.badge { display: inline-block; min-width: 4.5em; text-align: center; color: #fff;
         border-radius: 3px; padding: 0 .4em; font-size: 12px; font-weight: 700; }
.badge.high { background: #c62828; } .badge.medium { background: #ef6c00; }
.badge.low { background: #757575; }
.yes { color: #c62828; font-weight: 700; }
article.chain { border: 1px solid #e0e0e0; border-left-width: 5px; border-radius: 3px;
                padding: .4em 1em .8em; margin: 1em 0; }
article.chain.high { border-left-color: #c62828; }
article.chain.medium { border-left-color: #ef6c00; }
article.chain.low { border-left-color: #9e9e9e; }
article.chain h3 { margin-top: .4em; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12px; }
.legend span { display: inline-block; margin-right: 1em; font-size: 12px; }
.legend i { display: inline-block; width: .9em; height: .9em; margin-right: .3em;
            vertical-align: -.1em; }
.grid { display: flex; flex-wrap: wrap; gap: .6em 1.2em; }
figure { margin: .3em 0; }
figcaption { font-size: 12px; color: #555; max-width: 330px; }
svg text { font: 11px system-ui, sans-serif; fill: #212121; }
svg .axis { stroke: #9e9e9e; stroke-width: 1; }
svg .median { stroke: #212121; stroke-width: 1.5; stroke-dasharray: 4 3; }
ul.frames { margin: .2em 0; padding-left: 1.5em; }
details > summary { cursor: pointer; }
"""
# No script, no fetch of any kind: inline styles only.
CSP = "default-src 'none'; style-src 'unsafe-inline'"


def write_report(report: Mapping[str, Any], out: TextIO) -> None:
    """Write the HTML page of one explain report (local or fleet) to ``out``."""
    nodes = [str(n) for n in _list(report.get("nodes"))]
    window = _dict(report.get("window"))
    title = f"fleetd explain: {len(nodes)} node(s), {window.get('label') or 'window'}"
    out.write("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
              f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n"
              "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
              f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n")
    out.write(_header(report, nodes, window))
    out.write(_warnings(report))
    out.write(_stragglers(_list(report.get("stragglers")), "stragglers" in report))
    out.write(_gpu(_list(report.get("gpu"))))
    out.write(_threads(_list(report.get("processes"))))
    out.write(_ops(_list(report.get("ops"))))
    out.write(_chains(_list(report.get("chains"))))
    out.write("<footer class=\"note\"><p>Written by <code>fleetd explain --format html</code>"
              "; the fields are described in docs/explain.md and docs/json.md.</p></footer>"
              "\n</body>\n</html>\n")


# ---- values from an untrusted report ---------------------------------------------------


def _e(value: Any) -> str:
    """Any value as escaped text (quotes too: safe in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    """A finite number, or None (bools, strings and NaN are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _short(text: str, n: int = LABEL_CHARS) -> str:
    """Cut before escaping, so that an entity is never split."""
    return text if len(text) <= n else text[: n - 1] + "…"


def _dur(ns: Any) -> str:
    v = _num(ns)
    if v is None:
        return "-"
    if abs(v) >= 1e9:
        return f"{v / 1e9:.2f} s"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.2f} ms"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f} us"
    return f"{v:.0f} ns"


def _pct(share: Any, digits: int = 1) -> str:
    v = _num(share)
    return "-" if v is None else f"{v * 100:.{digits}f}%"


def _metric_value(metric: str, value: Any) -> str:
    """A straggler metric in its own unit (analyze/stragglers.py: rate, share, latency)."""
    v = _num(value)
    if v is None:
        return "-"
    if metric.endswith("_ns"):
        return _dur(v)
    if metric.endswith("_share"):
        return _pct(v)
    if metric.endswith("_per_s"):
        return f"{v:,.1f}/s"
    return f"{v:.4g}"


def _f(x: float) -> str:
    """An SVG coordinate: short and the same on every machine."""
    return f"{x:.1f}"


def _svg(width: float, height: float, label: str, body: Iterable[str]) -> str:
    return (f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{_f(width)}\" "
            f"height=\"{_f(height)}\" viewBox=\"0 0 {_f(width)} {_f(height)}\" role=\"img\" "
            f"aria-label=\"{_e(label)}\">\n" + "\n".join(body) + "\n</svg>")


def _text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return (f"<text x=\"{_f(x)}\" y=\"{_f(y)}\" text-anchor=\"{anchor}\"{extra}>"
            f"{_e(text)}</text>")


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{_e(title)}</title>" if title else ""
    return (f"<rect x=\"{_f(x)}\" y=\"{_f(y)}\" width=\"{_f(max(w, 0.0))}\" "
            f"height=\"{_f(max(h, 0.0))}\" fill=\"{fill}\">{tip}</rect>")


def _line(x1: float, y1: float, x2: float, y2: float, cls: str) -> str:
    return (f"<line class=\"{cls}\" x1=\"{_f(x1)}\" y1=\"{_f(y1)}\" x2=\"{_f(x2)}\" "
            f"y2=\"{_f(y2)}\"/>")


# ---- header and warnings ------------------------------------------------------------


def _header(report: Mapping[str, Any], nodes: list[str], window: Mapping[str, Any]) -> str:
    span = ""
    if window.get("start") and window.get("end"):
        span = f" ({_e(window['start'])} .. {_e(window['end'])})"
    chains = [_dict(c) for c in _list(report.get("chains"))]
    worst = next((s for s in SEVERITIES if any(c.get("severity") == s for c in chains)), None)
    cls = "quiet" if report.get("quiet") is True or worst is None else \
        SEVERITY_CLASS.get(worst, "low")
    verdict = report.get("verdict")
    if not verdict:  # a fleet report has one verdict per node
        counts = {s: sum(1 for c in chains if c.get("severity") == s) for s in SEVERITIES}
        verdict = ", ".join(f"{n} {s}" for s, n in counts.items()) + " chain(s)"
    parts = [
        "<header>\n<h1>fleetd explain</h1>\n",
        f"<p class=\"meta\">{len(nodes)} node(s): {_e(', '.join(nodes) or 'none')}; "
        f"{_e(window.get('label') or '')}{span}</p>\n",
        f"<p class=\"verdict {cls}\">{_e(verdict)}</p>\n",
    ]
    verdicts = _dict(report.get("verdicts"))
    if verdicts:
        parts.append("<table><tr><th>node</th><th>verdict</th></tr>"
                     + "".join(f"<tr><td class=\"node\">{_e(n)}</td><td>{_e(v)}</td></tr>"
                               for n, v in verdicts.items()) + "</table>\n")
    coll = _dict(report.get("collectives"))
    if coll.get("communicators"):
        parts.append(f"<p>Collective arrival: {_e(coll.get('verdict'))}</p>\n")
    gpu = "<a href=\"#gpu\">GPU</a>" if _list(report.get("gpu")) else ""
    parts.append(f"<nav><a href=\"#stragglers\">stragglers</a>{gpu}"
                 "<a href=\"#threads\">threads</a><a href=\"#ops\">op latency</a>"
                 "<a href=\"#chains\">chains</a></nav>\n</header>\n")
    return "".join(parts)


def _warnings(report: Mapping[str, Any]) -> str:
    items = []
    for w in _list(report.get("warnings")):
        if isinstance(w, dict):  # a fleet warning: {node, error, kind}
            items.append(f"<li><b>{_e(w.get('node'))}</b> ({_e(w.get('kind'))}): "
                         f"{_e(w.get('error'))}</li>")
        else:
            items.append(f"<li>{_e(w)}</li>")
    skew = _dict(report.get("skew"))
    rows = "".join(
        f"<tr><td>{_e(n)}</td><td class=\"num\">{_e(_dict(s).get('offset_ms'))}</td>"
        f"<td class=\"num\">{_e(_dict(s).get('error_ms'))}</td></tr>" for n, s in skew.items())
    out = ""
    if items:
        out += ("<section id=\"warnings\" class=\"warn\">\n<h2>Warnings</h2>\n<ul>"
                + "".join(items) + "</ul>\n</section>\n")
    if rows:
        out += ("<section id=\"skew\">\n<h2>Clock skew</h2>\n<table><tr><th>node</th>"
                "<th>offset (ms)</th><th>error (ms)</th></tr>" + rows + "</table>\n</section>\n")
    return out


# ---- stragglers -------------------------------------------------------------------------


def _stragglers(entries: list[Any], ranked: bool) -> str:
    head = "<section id=\"stragglers\">\n<h2>Stragglers</h2>\n"
    ranked_entries = [_dict(s) for s in entries]
    if not ranked_entries:
        why = ("no node could be ranked" if ranked else
               "one node: stragglers are ranked across nodes (a merged file or --nodes)")
        return head + f"<p class=\"note\">{_e(why)}</p>\n</section>\n"
    charts = [c for m in _chart_metrics(ranked_entries)
              if (c := _straggler_chart(m, ranked_entries))]
    rows = []
    for s in ranked_entries:
        flag = s.get("flagged")
        flagged = ("<span class=\"yes\">YES</span>" if flag is True
                   else "no" if flag is False else "-")
        score = _num(s.get("score"))
        metric = str(s.get("metric") or "")
        if s.get("rank") is not None:
            metric += f" (rank {s.get('rank')})"
        rows.append(f"<tr><td class=\"node\">{_e(s.get('node'))}</td><td class=\"num\">"
                    f"{'-' if score is None else f'{score:.2f}'}</td><td>{flagged}</td>"
                    f"<td>{_e(metric)}</td><td>{_e(s.get('reason'))}</td></tr>")
    return (head + "<p class=\"note\">Each bar is a node's value of the metric that makes a "
            "node slow; the dashed line is the fleet median. Flagged nodes are red. Score: "
            "the node's speed relative to the best node on the metric (1.0 = the best).</p>\n"
            + "".join(charts)
            + "<table><tr><th>node</th><th>score</th><th>flagged</th><th>metric</th>"
            "<th>reason</th></tr>" + "".join(rows) + "</table>\n</section>\n")


def _chart_metrics(entries: list[dict[str, Any]]) -> list[str]:
    """The metrics of the flagged nodes, else the first node's: the ones worth a chart."""
    flagged = [s for s in entries if s.get("flagged") is True]
    metrics: list[str] = []
    for s in flagged or entries[:1]:
        m = s.get("metric")
        if isinstance(m, str) and m not in metrics and _metric_rows(m, entries):
            metrics.append(m)
    if not metrics:  # e.g. only collective stragglers: the first metric nodes share
        for s in entries:
            m = s.get("metric")
            if isinstance(m, str) and m not in metrics and _metric_rows(m, entries):
                metrics.append(m)
                break
    return metrics[:MAX_STRAGGLER_CHARTS]


def _metric_rows(metric: str, entries: list[dict[str, Any]]
                 ) -> list[tuple[str, float, bool, dict[str, Any]]]:
    rows = []
    seen: set[str] = set()
    for s in entries:
        got = _dict(_dict(s.get("metrics")).get(metric))
        v = _num(got.get("value"))
        node = str(s.get("node"))
        if v is None or node in seen:
            continue
        seen.add(node)
        rows.append((node, v, s.get("flagged") is True and s.get("metric") == metric, got))
    return rows


def _straggler_chart(metric: str, entries: list[dict[str, Any]]) -> str:
    rows = _metric_rows(metric, entries)
    if not rows:
        return ""
    median = next((m for *_, got in rows if (m := _num(got.get("fleet_median"))) is not None),
                  None)
    label_w, bar_w, row_h, top = 150.0, 430.0, 22.0, 42.0
    width = label_w + bar_w + 110
    height = top + row_h * len(rows) + 10
    hi = max([v for _, v, _, _ in rows] + ([median] if median is not None else [])) or 1.0
    scale = bar_w / (hi * 1.05)
    body = [_text(0, 14, f"{metric}: each node against the fleet median", extra=" "
                  "font-weight=\"bold\"")]
    for i, (node, v, flagged, _) in enumerate(rows):
        y = top + i * row_h
        colour = "#c62828" if flagged else "#1e88e5"
        shown = _metric_value(metric, v)
        body.append(_text(label_w - 6, y + 14, _short(node, 22), "end"))
        body.append(_rect(label_w, y + 3, v * scale, row_h - 6, colour,
                          f"{node}: {metric} {shown}{' (straggler)' if flagged else ''}"))
        body.append(_text(label_w + v * scale + 4, y + 14, shown))
    if median is not None:
        x = label_w + median * scale
        body.append(_line(x, top - 4, x, top + row_h * len(rows), "median"))
        body.append(_text(x, top - 8, f"fleet median {_metric_value(metric, median)}",
                          "middle"))
    return f"<figure>{_svg(width, height, f'{metric} per node', body)}</figure>\n"


# ---- the GPU timeline of an imported trace ------------------------------------------------

GPU_SHARES = (("compute_pct", "compute", "#1e88e5"), ("comm_pct", "communication", "#8e24aa"),
              ("memcpy_pct", "memcpy", "#00897b"), ("idle_pct", "idle", "#bdbdbd"))
GPU_METRICS = ("M1", "M2", "M3a", "M3b", "M3c", "M4", "M5")


def _gpu(ranks: list[Any]) -> str:
    """Per rank of an imported GPU timeline: where the GPU's time went, and M1-M5 against
    the thresholds that make the host-overhead verdict (docs/json.md, fleetd gpu)."""
    found = [_dict(r) for r in ranks]
    if not found:
        return ""
    legend = "<p class=\"legend\">" + "".join(
        f"<span><i style=\"background:{c}\"></i>{_e(label)}</span>"
        for _, label, c in GPU_SHARES) + "</p>\n"
    parts = ["<section id=\"gpu\">\n<h2>GPU timeline</h2>\n<p class=\"note\">Each rank's "
             "GPU time by what ran, and the host-overhead metrics M1-M5 against the "
             "threshold that makes them count (the tick; red: on the side that counts)."
             "</p>\n", legend]
    for r in found:
        who = f"{r.get('node')} pid {r.get('pid')}" + (
            f" rank {r.get('rank')}" if r.get("rank") is not None else "")
        verdict = str(r.get("host_overhead") or "?")
        parts.append(f"<h3>{_e(who)}: host overhead <span class=\""
                     f"{'yes' if verdict == 'YES' else 'note'}\">{_e(verdict)}</span></h3>\n"
                     f"<p>{_e(r.get('summary'))}</p>\n")
        parts.append(_gpu_shares(r, who) + _gpu_metrics(r, who))
    return "".join(parts) + "</section>\n"


def _gpu_shares(r: Mapping[str, Any], who: str) -> str:
    shares = [(key, label, c, v) for key, label, c in GPU_SHARES
              if (v := _num(r.get(key))) is not None and v > 0]
    if not shares:
        return ""
    bar_w, h = 600.0, 22.0
    total = max(sum(v for *_, v in shares), 100.0)
    body, x = [], 0.0
    for _, label, colour, v in shares:
        w = v / total * bar_w
        body.append(_rect(x, 2, w, h, colour, f"{who}: {label} {v:.1f}%"))
        if w > 70:
            body.append(_text(x + 4, 17, f"{label} {v:.1f}%", extra=" style=\"fill:#fff\""))
        x += w
    return f"<figure>{_svg(bar_w, h + 4, f'GPU time of {who}', body)}</figure>\n"


def _gpu_metrics(r: Mapping[str, Any], who: str) -> str:
    """M1-M5 on one 0-1 axis, each with its threshold's tick; red where the value is on
    the side that counts as host overhead (above it, or below for M4)."""
    metrics, limits = _dict(r.get("metrics")), _dict(r.get("thresholds"))
    rows = [(m, v, t) for m in GPU_METRICS
            if (v := _num(metrics.get(m))) is not None and (t := _num(limits.get(m))) is not None]
    if not rows:
        return ""
    label_w, bar_w, row_h, top = 50.0, 400.0, 18.0, 4.0
    body = []
    for i, (m, v, t) in enumerate(rows):
        y = top + i * row_h
        above = OVERHEAD_ABOVE.get(m, True)
        over = v > t if above else v < t
        w = min(max(v, 0.0), 1.0) * bar_w
        body.append(_text(label_w - 6, y + 12, m, "end"))
        body.append(_rect(label_w, y + 2, max(w, 1.5), row_h - 5,
                          "#c62828" if over else "#1e88e5",
                          f"{who}: {m} = {v:.3f}, counts {'above' if above else 'below'} {t:g}"))
        tx = label_w + min(max(t, 0.0), 1.0) * bar_w
        body.append(_line(tx, y, tx, y + row_h - 1, "median"))
        body.append(_text(label_w + bar_w + 6, y + 12,
                          f"{v:.3f} (counts {'>' if above else '<'} {t:g})"))
    end = top + row_h * len(rows)
    return (f"<figure>{_svg(label_w + bar_w + 160, end + 4, f'M1-M5 of {who}', body)}"
            "</figure>\n")


# ---- where each thread's time went ------------------------------------------------------


def _threads(processes: list[Any]) -> str:
    head = ("<section id=\"threads\">\n<h2>Where each thread's time went</h2>\n"
            "<p class=\"note\">Shares of each traced thread's wall time in the window: "
            "running, waiting for a CPU (run queue), interrupts, and sleeps by reason. "
            "Off-CPU intervals are stored from 50 us up, so waiting is a lower bound. "
            "In CUDA overlaps the rest.</p>\n")
    rows = []
    for p in processes:
        for t in _list(_dict(p).get("threads")):
            t = _dict(t)
            wall = _num(t.get("wall_ns"))
            if wall is None or wall <= 0:
                continue
            rows.append((_dict(p), t, wall))
    if not rows:
        return head + "<p class=\"note\">no traced threads in the window</p>\n</section>\n"
    legend = "<p class=\"legend\">" + "".join(
        f"<span><i style=\"background:{c}\"></i>{_e(label)}</span>"
        for _, label, c in BREAKDOWN) + "</p>\n"
    shown = rows[:MAX_THREADS]
    label_w, bar_w, row_h, top = 300.0, 520.0, 20.0, 4.0
    body = []
    for i, (p, t, wall) in enumerate(shown):
        y = top + i * row_h
        name = (f"{p.get('node', '')} {t.get('comm') or ''}[{t.get('pid')}] "
                f"{t.get('thread') or ''} tid {t.get('tid')}")
        body.append(_text(label_w - 6, y + 14, _short(name), "end", extra=""))
        x = label_w
        for key, label, colour in BREAKDOWN:
            share = max(0.0, (_num(t.get(key)) or 0.0) / wall)
            w = min(share * bar_w, label_w + bar_w - x)  # shares past 100% stay inside
            if w <= 0:
                continue
            body.append(_rect(x, y + 3, w, row_h - 6, colour,
                              f"{name}: {label} {_pct(share)} ({_dur(t.get(key))})"))
            x += w
        in_cuda = _num(t.get("in_cuda_ns"))
        est = "*" if t.get("in_cuda_estimated") is True else ""
        body.append(_text(label_w + bar_w + 6, y + 14,
                          f"CUDA {_pct((in_cuda or 0.0) / wall)}{est}"))
    svg = _svg(label_w + bar_w + 90, top + row_h * len(shown) + 4,
               "per-thread time breakdown", body)
    more = (f"<p class=\"note\">{len(rows) - len(shown)} more thread(s) not drawn; "
            "--format json lists them all.</p>\n" if len(rows) > len(shown) else "")
    return (head + legend + f"<figure>{svg}</figure>\n" + more
            + "<p class=\"note\">* in CUDA scaled from the in-kernel histograms (calls "
            "were sampled).</p>\n</section>\n")


# ---- op latency histograms -----------------------------------------------------------


def _ops(ops: list[Any]) -> str:
    head = ("<section id=\"ops\">\n<h2>Op latency</h2>\n<p class=\"note\">Per op, the "
            "share of calls between its percentiles on a logarithmic latency axis: the bar "
            "from p50 to p95 holds 45% of the calls, p95 to p99 4%, p99 to the maximum 1%; "
            "a bar's height is its share per decade of latency (on a log scale), so a "
            "narrow, tall bar is a tight cluster and a long, low one a tail. Half the calls "
            "are at or below p50 (the bracket). Percentiles are exact from stored events, "
            "or estimated from the in-kernel log2 histograms when calls were sampled.</p>\n")
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in ops:
        r = _dict(r)
        p50, count = _num(r.get("p50_ns")), _num(r.get("count"))
        if p50 is None or count is None or count <= 0:
            continue
        by_node.setdefault(str(r.get("node") or ""), []).append(r)
    if not by_node:
        return head + "<p class=\"note\">no op statistics in the report</p>\n</section>\n"
    parts = [head]
    for node, rows in by_node.items():
        gpu = [r for r in rows if r.get("source") in GPU_SOURCES]
        rest = [r for r in rows if r.get("source") not in GPU_SOURCES]
        chosen = (sorted(gpu, key=_total, reverse=True)
                  + sorted(rest, key=_total, reverse=True))[:MAX_OPS_PER_NODE]
        parts.append(f"<h3>{_e(node) or '(node)'}</h3>\n<div class=\"grid\">\n")
        parts += [_histogram(r) for r in chosen]
        parts.append("</div>\n")
        if len(rows) > len(chosen):
            parts.append(f"<p class=\"note\">{len(rows) - len(chosen)} more op(s): "
                         "fleetd ops lists them all.</p>\n")
    parts.append("</section>\n")
    return "".join(parts)


def _total(r: Mapping[str, Any]) -> float:
    return _num(r.get("total_ns")) or 0.0


CHAR_W = 6.2  # px per character of svg text at 11 px (a wide estimate: no overlap)


def _extent(x: float, text: str, anchor: str) -> tuple[float, float]:
    w = len(text) * CHAR_W
    left = x if anchor == "start" else x - w if anchor == "end" else x - w / 2
    return left, left + w


def axis_labels(ticks: list[tuple[float, str, str]], gap: float = 6.0
                ) -> list[tuple[float, str, str]]:
    """The tick labels (x, text, anchor) that fit: the first always, the last unless it
    would overlap the first, a middle one only where it clears its kept neighbours by
    ``gap`` px (never '10 ms100 ms')."""
    if len(ticks) <= 1:
        return ticks
    last_left = _extent(*ticks[-1])[0]
    kept = [ticks[0]]
    right = _extent(*ticks[0])[1]
    for tick in ticks[1:-1]:
        left, end = _extent(*tick)
        if left >= right + gap and end <= last_left - gap:
            kept.append(tick)
            right = end
    if _extent(*ticks[-1])[0] >= right + gap or len(kept) > 1:
        kept.append(ticks[-1])
    return kept


def _decade_label(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:g} {unit}"
    return f"{ns:g} ns"


def _histogram(r: Mapping[str, Any]) -> str:
    op = str(r.get("op") or "?")
    who = f" {r.get('comm') or ''}[{r.get('pid')}]" if r.get("pid") is not None else ""
    p = [max(1.0, v) if (v := _num(r.get(k))) is not None else None
         for k in ("p50_ns", "p95_ns", "p99_ns", "max_ns")]
    p50 = p[0] or 1.0
    known = [v for v in p if v is not None]
    mean = _num(r.get("mean_ns"))
    lo = 10 ** math.floor(math.log10(min([p50, *([mean] if mean and mean >= 1 else [])]) / 2))
    hi = 10 ** math.ceil(math.log10(max(known) * 1.05))
    width, left, right, top, plot_h = 330.0, 10.0, 10.0, 20.0, 60.0
    span = math.log10(hi / lo)

    def x(ns: float) -> float:
        return left + (math.log10(max(ns, lo)) - math.log10(lo)) / span * (width - left - right)

    bins: list[tuple[float, float, float, str]] = []
    for (a, b), share, name in zip(((p[0], p[1]), (p[1], p[2]), (p[2], p[3])),
                                   (0.45, 0.04, 0.01), ("p50-p95", "p95-p99", "p99-max"),
                                   strict=True):
        if a is not None and b is not None and b >= a:
            bins.append((a, b, share, name))
    densities = [share / max(math.log10(b / a), 0.02) for a, b, share, _ in bins]
    peak = max(densities, default=1.0)
    # Heights on a log scale over DENSITY_DECADES: a 1% tail stays visible beside the
    # 45% around the median.
    base = top + plot_h
    body = [_text(left, 13, _short(op + who, 50), extra=" font-weight=\"bold\"")]
    for (a, b, share, name), d in zip(bins, densities, strict=True):
        h = max(2.0, plot_h * (1 + math.log10(d / peak) / DENSITY_DECADES))
        x0, x1 = x(a), x(b)
        body.append(_rect(x0, base - h, max(x1 - x0, 1.5), h, "#1e88e5",
                          f"{op}: {share:.0%} of calls {name}, {_dur(a)} to {_dur(b)}"))
    # Half the calls at or below p50: a bracket from the axis start.
    body.append(_line(x(lo), base - 4, x(p50), base - 4, "axis"))
    body.append(_line(x(p50), base - 9, x(p50), base, "axis"))
    body.append(_text(x(lo) + 2, base - 7, "50%"))
    body.append(_line(left, base, width - right, base, "axis"))
    decades = int(round(span))
    ticks = []
    for i in range(decades + 1):
        v = lo * 10 ** i
        body.append(_line(x(v), base, x(v), base + 4, "axis"))
        anchor = "start" if i == 0 else "end" if i == decades else "middle"
        ticks.append((x(v), _decade_label(v), anchor))
    body += [_text(tx, base + 15, label, anchor) for tx, label, anchor in axis_labels(ticks)]
    max_mark = "" if r.get("max_exact") is not False else "≥ "
    count = _num(r.get("count")) or 0
    how = {"events": "exact, from stored events",
           "histogram": "estimated from in-kernel histograms"}.get(str(r.get("stats_from")),
                                                                 str(r.get("stats_from") or ""))
    caption = (f"{r.get('source') or ''} · {count:,.0f} calls · p50 {_dur(p[0])} · "
               f"p95 {_dur(p[1])} · p99 {_dur(p[2])} · max {max_mark}{_dur(p[3])} · "
               f"mean {_dur(mean)} · {how}")
    svg = _svg(width, base + 20, f"latency histogram of {op}{who}", body)
    return f"<figure>{svg}<figcaption>{_e(caption)}</figcaption></figure>\n"


# ---- chains and their evidence ------------------------------------------------------


def _chains(chains: list[Any]) -> str:
    head = "<section id=\"chains\">\n<h2>Causal chains</h2>\n"
    found = [_dict(c) for c in chains]
    if not found:
        return head + "<p class=\"note\">no chain: no host-side cause found</p>\n</section>\n"
    worth = [c for c in found if c.get("severity") in ("HIGH", "MEDIUM")]
    low = [c for c in found if c.get("severity") not in ("HIGH", "MEDIUM")]
    parts = [head, "<p class=\"note\">Most severe first. Each chain ties slow CUDA calls to "
             "the host events that overlapped them on the same thread; the timelines show "
             "each slow call (top bar) and those events, on the call's own time scale.</p>\n"]
    parts += [_chain(c, i) for i, c in enumerate(worth)]
    if low:
        parts.append(f"<details><summary>{len(low)} LOW chain(s)</summary>\n")
        parts += [_chain(c, len(worth) + i) for i, c in enumerate(low)]
        parts.append("</details>\n")
    parts.append("</section>\n")
    return "".join(parts)


def _who(task: Mapping[str, Any]) -> str:
    text = f"{task.get('comm') or '?'} pid {task.get('pid')}"
    if task.get("tid") is not None and task.get("tid") != task.get("pid"):
        text += f" thread {task.get('thread') or '?'} tid {task.get('tid')}"
    elif task.get("tid") is not None:
        text += f" tid {task.get('tid')}"
    return text + pods.label(task)  # its pod and container, where recorded


def _chain(c: Mapping[str, Any], index: int) -> str:
    sev = str(c.get("severity") or "LOW")
    cls = SEVERITY_CLASS.get(sev, "low")
    where = f" on {c.get('node')}" if c.get("node") else ""
    rows = [f"<tr><th>victim</th><td>{_e(_who(_dict(c.get('victim'))))}</td></tr>"]
    culprit = _dict(c.get("culprit"))
    if culprit:
        share = _num(_dict(_list(c.get("culprits"))[0] if _list(c.get("culprits"))
                           else {}).get("share"))
        extra = " (the victim process itself)" if culprit.get("self") is True else ""
        if share is not None:
            extra += f", {share:.0%} of the attributed time"
        rows.append(f"<tr><th>culprit</th><td>{_e(_who(culprit) + extra)}</td></tr>")
    rows.append(f"<tr><th>explained</th><td>{_pct(c.get('explained'), 0)} of the extra "
                f"time</td></tr><tr><th>impact</th><td>{_pct(c.get('impact'))} of wall time"
                "</td></tr>")
    if c.get("op"):
        rows.append(f"<tr><th>op</th><td>{_e(c.get('op'))}</td></tr>")
    evidence = [_dict(e) for e in _list(c.get("evidence"))]
    fixes = "".join(f"<li>{_e(f)}</li>" for f in _list(c.get("fixes")))
    return (f"<article class=\"chain {cls}\" id=\"chain-{index}\">\n"
            f"<h3><span class=\"badge {cls}\">{_e(sev)}</span> {_e(c.get('root_cause'))}"
            f"{_e(where)} <span class=\"mono note\">{_e(c.get('id'))}</span></h3>\n"
            f"<p>{_e(c.get('summary'))}</p>\n<table>{''.join(rows)}</table>\n"
            + _evidence_svg(evidence) + _evidence_table(evidence)
            + top_frames_chart(_dict(c.get("detail"))) + flame_graph(_dict(c.get("detail")))
            + (f"<h4>Fix</h4>\n<ul>{fixes}</ul>\n" if fixes else "") + "</article>\n")


def _groups(evidence: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A slow call (or stall, gap, example call) and the host items that name it."""
    groups: list[list[dict[str, Any]]] = []
    for e in evidence:
        if _num(e.get("ts_ns")) is None:
            continue
        if e.get("spike") is not None and groups:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups[:MAX_EVIDENCE_GROUPS]


def _call_lengths(groups: list[list[dict[str, Any]]]) -> str:
    """Each slow call's duration as a bar on one logarithmic axis shared by the chain's
    calls, labelled with its value: the zoomed timelines below give every call the same
    width, so a 234 ms call and a 330 us one would look alike."""
    durs = [max(_num(g[0].get("dur_ns")) or 0.0, 0.0) for g in groups]
    if len(groups) < 2 or not any(durs):
        return ""
    label_w, bar_w, row_h, top = 150.0, 420.0, 16.0, 20.0
    positive = [d for d in durs if d > 0]
    lo = 10 ** math.floor(math.log10(min(positive)))
    hi = 10 ** math.ceil(math.log10(max(positive) * 1.001))
    span = max(math.log10(hi / lo), 1.0)

    def x(ns: float) -> float:
        return label_w + (math.log10(max(ns, lo)) - math.log10(lo)) / span * bar_w

    body = [_text(0, 12, "each call's duration (log scale)", extra=" font-weight=\"bold\"")]
    for i, (g, d) in enumerate(zip(groups, durs, strict=True)):
        y = top + i * row_h
        first = g[0]
        when = str(first.get("time") or "")[11:23]
        body.append(_text(label_w - 6, y + 11, _short(f"{first.get('kind')} {when}", 24),
                          "end"))
        w = max(x(d) - label_w, 1.5) if d > 0 else 0.0
        body.append(_rect(label_w, y + 2, w, row_h - 4,
                          EVIDENCE_COLOURS.get(str(first.get("kind")), "#9e9e9e"),
                          f"{first.get('text') or first.get('kind')} ({_dur(d)})"))
        body.append(_text(label_w + w + 4, y + 11, _dur(d)))
    base = top + len(groups) * row_h + 2
    body.append(_line(label_w, base, label_w + bar_w, base, "axis"))
    ticks = []
    for i in range(int(round(span)) + 1):
        v = lo * 10 ** i
        body.append(_line(x(v), base, x(v), base + 4, "axis"))
        ticks.append((x(v), _decade_label(v), "middle" if i else "start"))
    body += [_text(tx, base + 15, t, a) for tx, t, a in axis_labels(ticks)]
    return f"<figure>{_svg(label_w + bar_w + 80, base + 20, 'call durations', body)}</figure>\n"


def _evidence_svg(evidence: Sequence[dict[str, Any]]) -> str:
    groups = _groups(evidence)
    if not groups:
        return ""
    label_w, bar_w, row_h, gap = 90.0, 560.0, 16.0, 22.0
    body: list[str] = []
    y = 0.0
    for group in groups:
        items = group[:MAX_GROUP_ITEMS]
        t0 = min(_num(e.get("ts_ns")) or 0.0 for e in items)
        t1 = max((_num(e.get("ts_ns")) or 0.0) + max(_num(e.get("dur_ns")) or 0.0, 0.0)
                 for e in items)
        span = max(t1 - t0, 1.0)
        first = items[0]
        when = str(first.get("time") or "")[11:]
        body.append(_text(0, y + 12, f"{first.get('kind')} at {when}, {_dur(span)} shown",
                          extra=" font-weight=\"bold\""))
        y += gap - 4
        for e in items:
            start = ((_num(e.get("ts_ns")) or t0) - t0) / span * bar_w
            w = max(max(_num(e.get("dur_ns")) or 0.0, 0.0) / span * bar_w, 1.5)
            kind = str(e.get("kind") or "")
            colour = EVIDENCE_COLOURS.get(kind, "#9e9e9e")
            body.append(_text(label_w - 6, y + 12, _short(kind, 14), "end"))
            body.append(_rect(label_w + start, y + 2, w, row_h - 4, colour,
                              f"{e.get('text') or kind} ({_dur(e.get('dur_ns'))})"))
            y += row_h
        y += 8
    return (_call_lengths(groups)
            + f"<figure>{_svg(label_w + bar_w + 10, y, 'evidence timeline', body)}</figure>\n")


def _evidence_table(evidence: Sequence[dict[str, Any]]) -> str:
    if not evidence:
        return ""
    rows = []
    for e in evidence:
        when = str(e.get("time") or "")[11:]
        text = _e(e.get("text"))
        if _num(e.get("overlap_ns")) is not None:
            text += f" <span class=\"note\">[overlap {_dur(e.get('overlap_ns'))}]</span>"
        frames = [f for f in _list(e.get("stack")) if f is not None]
        if frames:
            text += ("<details><summary>stack</summary><ul class=\"frames mono\">"
                     + "".join(f"<li>{_e(f)}</li>" for f in frames) + "</ul></details>")
        indent = " style=\"padding-left:1.5em\"" if e.get("spike") is not None else ""
        rows.append(f"<tr><td class=\"mono\">{_e(when)}</td><td{indent}>"
                    f"{_e(e.get('kind'))}</td><td>{text}</td></tr>")
    return ("<h4>Evidence</h4>\n<table><tr><th>time (UTC)</th><th>kind</th><th>what</th>"
            "</tr>" + "".join(rows) + "</table>\n")
