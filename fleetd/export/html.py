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

import math
from collections.abc import Mapping
from typing import Any, TextIO

from fleetd.export import svg
from fleetd.export.html_chains import SEVERITY_CLASS, chains_section
from fleetd.export.html_gpu import gpu_section
from fleetd.store.catalog import CALL_SOURCES

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
GPU_SOURCES = CALL_SOURCES  # the op rows of calls into CUDA and NCCL
MAX_THREADS = 40  # rows of the breakdown chart
MAX_OPS_PER_NODE = 12  # histograms per node
MAX_STRAGGLER_CHARTS = 4  # metrics drawn
DENSITY_DECADES = 3  # the height axis of the op histograms, log scale

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


def write_report(report: Mapping[str, object], out: TextIO) -> None:
    """Write the HTML page of one explain report (local or fleet) to ``out``."""
    nodes = [str(n) for n in svg.as_list(report.get("nodes"))]
    window = svg.as_dict(report.get("window"))
    title = f"fleetd explain: {len(nodes)} node(s), {window.get('label') or 'window'}"
    out.write("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
              f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n"
              "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
              f"<title>{svg.esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n")
    out.write(_header(report, nodes, window))
    out.write(_warnings(report))
    out.write(_stragglers(svg.as_list(report.get("stragglers")), "stragglers" in report))
    out.write(gpu_section(svg.as_list(report.get("gpu"))))
    out.write(_threads(svg.as_list(report.get("processes"))))
    out.write(_ops(svg.as_list(report.get("ops"))))
    out.write(chains_section(svg.as_list(report.get("chains"))))
    out.write("<footer class=\"note\"><p>Written by <code>fleetd explain --format html</code>"
              "; the fields are described in docs/explain.md and docs/json.md.</p></footer>"
              "\n</body>\n</html>\n")


def _metric_value(metric: str, value: Any) -> str:
    """A straggler metric in its own unit (analyze/distributed/stragglers.py: rate, share,
    latency)."""
    v = svg.num(value)
    if v is None:
        return "-"
    if metric.endswith("_ns"):
        return svg.dur(v)
    if metric.endswith("_share"):
        return svg.pct(v)
    if metric.endswith("_per_s"):
        return f"{v:,.1f}/s"
    return f"{v:.4g}"




# ---- header and warnings ------------------------------------------------------------


def _header(report: Mapping[str, object], nodes: list[str], window: Mapping[str, object]) -> str:
    span = ""
    if window.get("start") and window.get("end"):
        span = f" ({svg.esc(window['start'])} .. {svg.esc(window['end'])})"
    chains = [svg.as_dict(c) for c in svg.as_list(report.get("chains"))]
    worst = next((s for s in SEVERITIES if any(c.get("severity") == s for c in chains)), None)
    cls = "quiet" if report.get("quiet") is True or worst is None else \
        SEVERITY_CLASS.get(worst, "low")
    verdict = report.get("verdict")
    if not verdict:  # a fleet report has one verdict per node
        counts = {s: sum(1 for c in chains if c.get("severity") == s) for s in SEVERITIES}
        verdict = ", ".join(f"{n} {s}" for s, n in counts.items()) + " chain(s)"
    parts = [
        "<header>\n<h1>fleetd explain</h1>\n",
        f"<p class=\"meta\">{len(nodes)} node(s): {svg.esc(', '.join(nodes) or 'none')}; "
        f"{svg.esc(window.get('label') or '')}{span}</p>\n",
        f"<p class=\"verdict {cls}\">{svg.esc(verdict)}</p>\n",
    ]
    verdicts = svg.as_dict(report.get("verdicts"))
    if verdicts:
        parts.append("<table><tr><th>node</th><th>verdict</th></tr>"
                     + "".join(f"<tr><td class=\"node\">{svg.esc(n)}</td><td>{svg.esc(v)}</td></tr>"
                               for n, v in verdicts.items()) + "</table>\n")
    coll = svg.as_dict(report.get("collectives"))
    if coll.get("communicators"):
        parts.append(f"<p>Collective arrival: {svg.esc(coll.get('verdict'))}</p>\n")
    gpu = "<a href=\"#gpu\">GPU</a>" if svg.as_list(report.get("gpu")) else ""
    parts.append(f"<nav><a href=\"#stragglers\">stragglers</a>{gpu}"
                 "<a href=\"#threads\">threads</a><a href=\"#ops\">op latency</a>"
                 "<a href=\"#chains\">chains</a></nav>\n</header>\n")
    return "".join(parts)


def _warnings(report: Mapping[str, object]) -> str:
    items = []
    for w in svg.as_list(report.get("warnings")):
        if isinstance(w, dict):  # a fleet warning: {node, error, kind}
            items.append(f"<li><b>{svg.esc(w.get('node'))}</b> ({svg.esc(w.get('kind'))}): "
                         f"{svg.esc(w.get('error'))}</li>")
        else:
            items.append(f"<li>{svg.esc(w)}</li>")
    skew = svg.as_dict(report.get("skew"))
    rows = "".join(
        f"<tr><td>{svg.esc(n)}</td><td class=\"num\">"
        f"{svg.esc(svg.as_dict(s).get('offset_ms'))}</td><td class=\"num\">"
        f"{svg.esc(svg.as_dict(s).get('error_ms'))}</td></tr>" for n, s in skew.items())
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
    ranked_entries = [svg.as_dict(s) for s in entries]
    if not ranked_entries:
        why = ("no node could be ranked" if ranked else
               "one node: stragglers are ranked across nodes (a merged file or --nodes)")
        return head + f"<p class=\"note\">{svg.esc(why)}</p>\n</section>\n"
    charts = [c for m in _chart_metrics(ranked_entries)
              if (c := _straggler_chart(m, ranked_entries))]
    rows = []
    for s in ranked_entries:
        flag = s.get("flagged")
        flagged = ("<span class=\"yes\">YES</span>" if flag is True
                   else "no" if flag is False else "-")
        score = svg.num(s.get("score"))
        metric = str(s.get("metric") or "")
        if s.get("rank") is not None:
            metric += f" (rank {s.get('rank')})"
        rows.append(f"<tr><td class=\"node\">{svg.esc(s.get('node'))}</td><td class=\"num\">"
                    f"{'-' if score is None else f'{score:.2f}'}</td><td>{flagged}</td>"
                    f"<td>{svg.esc(metric)}</td><td>{svg.esc(s.get('reason'))}</td></tr>")
    return (head + "<p class=\"note\">Each bar is a node's value of the metric that makes a "
            "node slow; the dashed line is the fleet median. Flagged nodes are red. Score: "
            "the node's speed relative to the best node on the metric (1.0 = the best).</p>\n"
            + "".join(charts)
            + "<table><tr><th>node</th><th>score</th><th>flagged</th><th>metric</th>"
            "<th>reason</th></tr>" + "".join(rows) + "</table>\n</section>\n")


def _chart_metrics(entries: list[dict[str, object]]) -> list[str]:
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


def _metric_rows(metric: str, entries: list[dict[str, object]]
                 ) -> list[tuple[str, float, bool, dict[str, object]]]:
    rows = []
    seen: set[str] = set()
    for s in entries:
        got = svg.as_dict(svg.as_dict(s.get("metrics")).get(metric))
        v = svg.num(got.get("value"))
        node = str(s.get("node"))
        if v is None or node in seen:
            continue
        seen.add(node)
        rows.append((node, v, s.get("flagged") is True and s.get("metric") == metric, got))
    return rows


def _straggler_chart(metric: str, entries: list[dict[str, object]]) -> str:
    rows = _metric_rows(metric, entries)
    if not rows:
        return ""
    median = next((m for *_, got in rows if (m := svg.num(got.get("fleet_median"))) is not None),
                  None)
    label_w, bar_w, row_h, top = 150.0, 430.0, 22.0, 42.0
    width = label_w + bar_w + 110
    height = top + row_h * len(rows) + 10
    hi = max([v for _, v, _, _ in rows] + ([median] if median is not None else [])) or 1.0
    scale = bar_w / (hi * 1.05)
    body = [svg.svg_text(0, 14, f"{metric}: each node against the fleet median", extra=" "
                  "font-weight=\"bold\"")]
    for i, (node, v, flagged, _) in enumerate(rows):
        y = top + i * row_h
        colour = "#c62828" if flagged else "#1e88e5"
        shown = _metric_value(metric, v)
        body.append(svg.svg_text(label_w - 6, y + 14, svg.short(node, 22), "end"))
        body.append(svg.svg_rect(label_w, y + 3, v * scale, row_h - 6, colour,
                          f"{node}: {metric} {shown}{' (straggler)' if flagged else ''}"))
        body.append(svg.svg_text(label_w + v * scale + 4, y + 14, shown))
    if median is not None:
        x = label_w + median * scale
        body.append(svg.svg_line(x, top - 4, x, top + row_h * len(rows), "median"))
        body.append(svg.svg_text(x, top - 8, f"fleet median {_metric_value(metric, median)}",
                          "middle"))
    return f"<figure>{svg.svg_doc(width, height, f'{metric} per node', body)}</figure>\n"


# ---- where each thread's time went ------------------------------------------------------


def _threads(processes: list[Any]) -> str:
    head = ("<section id=\"threads\">\n<h2>Where each thread's time went</h2>\n"
            "<p class=\"note\">Shares of each traced thread's wall time in the window: "
            "running, waiting for a CPU (run queue), interrupts, and sleeps by reason. "
            "Off-CPU intervals are stored from 50 us up, so waiting is a lower bound. "
            "In CUDA overlaps the rest.</p>\n")
    rows = []
    for p in processes:
        for t in svg.as_list(svg.as_dict(p).get("threads")):
            t = svg.as_dict(t)
            wall = svg.num(t.get("wall_ns"))
            if wall is None or wall <= 0:
                continue
            rows.append((svg.as_dict(p), t, wall))
    if not rows:
        return head + "<p class=\"note\">no traced threads in the window</p>\n</section>\n"
    legend = "<p class=\"legend\">" + "".join(
        f"<span><i style=\"background:{c}\"></i>{svg.esc(label)}</span>"
        for _, label, c in BREAKDOWN) + "</p>\n"
    shown = rows[:MAX_THREADS]
    label_w, bar_w, row_h, top = 300.0, 520.0, 20.0, 4.0
    body = []
    for i, (p, t, wall) in enumerate(shown):
        y = top + i * row_h
        name = (f"{p.get('node', '')} {t.get('comm') or ''}[{t.get('pid')}] "
                f"{t.get('thread') or ''} tid {t.get('tid')}")
        body.append(svg.svg_text(label_w - 6, y + 14, svg.short(name), "end", extra=""))
        x = label_w
        for key, label, colour in BREAKDOWN:
            share = max(0.0, (svg.num(t.get(key)) or 0.0) / wall)
            w = min(share * bar_w, label_w + bar_w - x)  # shares past 100% stay inside
            if w <= 0:
                continue
            body.append(svg.svg_rect(x, y + 3, w, row_h - 6, colour,
                              f"{name}: {label} {svg.pct(share)} ({svg.dur(t.get(key))})"))
            x += w
        in_cuda = svg.num(t.get("in_cuda_ns"))
        est = "*" if t.get("in_cuda_estimated") is True else ""
        body.append(svg.svg_text(label_w + bar_w + 6, y + 14,
                          f"CUDA {svg.pct((in_cuda or 0.0) / wall)}{est}"))
    figure = svg.svg_doc(label_w + bar_w + 90, top + row_h * len(shown) + 4,
               "per-thread time breakdown", body)
    more = (f"<p class=\"note\">{len(rows) - len(shown)} more thread(s) not drawn; "
            "--format json lists them all.</p>\n" if len(rows) > len(shown) else "")
    return (head + legend + f"<figure>{figure}</figure>\n" + more
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
    by_node: dict[str, list[dict[str, object]]] = {}
    for r in ops:
        r = svg.as_dict(r)
        p50, count = svg.num(r.get("p50_ns")), svg.num(r.get("count"))
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
        parts.append(f"<h3>{svg.esc(node) or '(node)'}</h3>\n<div class=\"grid\">\n")
        parts += [_histogram(r) for r in chosen]
        parts.append("</div>\n")
        if len(rows) > len(chosen):
            parts.append(f"<p class=\"note\">{len(rows) - len(chosen)} more op(s): "
                         "fleetd ops lists them all.</p>\n")
    parts.append("</section>\n")
    return "".join(parts)


def _total(r: Mapping[str, object]) -> float:
    return svg.num(r.get("total_ns")) or 0.0


def _histogram(r: Mapping[str, object]) -> str:
    op = str(r.get("op") or "?")
    who = f" {r.get('comm') or ''}[{r.get('pid')}]" if r.get("pid") is not None else ""
    p = [max(1.0, v) if (v := svg.num(r.get(k))) is not None else None
         for k in ("p50_ns", "p95_ns", "p99_ns", "max_ns")]
    p50 = p[0] or 1.0
    known = [v for v in p if v is not None]
    mean = svg.num(r.get("mean_ns"))
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
    body = [svg.svg_text(left, 13, svg.short(op + who, 50), extra=" font-weight=\"bold\"")]
    for (a, b, share, name), d in zip(bins, densities, strict=True):
        h = max(2.0, plot_h * (1 + math.log10(d / peak) / DENSITY_DECADES))
        x0, x1 = x(a), x(b)
        body.append(svg.svg_rect(x0, base - h, max(x1 - x0, 1.5), h, "#1e88e5",
                          f"{op}: {share:.0%} of calls {name}, {svg.dur(a)} to {svg.dur(b)}"))
    # Half the calls at or below p50: a bracket from the axis start.
    body.append(svg.svg_line(x(lo), base - 4, x(p50), base - 4, "axis"))
    body.append(svg.svg_line(x(p50), base - 9, x(p50), base, "axis"))
    body.append(svg.svg_text(x(lo) + 2, base - 7, "50%"))
    body.append(svg.svg_line(left, base, width - right, base, "axis"))
    decades = int(round(span))
    ticks = []
    for i in range(decades + 1):
        v = lo * 10 ** i
        body.append(svg.svg_line(x(v), base, x(v), base + 4, "axis"))
        anchor = "start" if i == 0 else "end" if i == decades else "middle"
        ticks.append((x(v), svg.decade_label(v), anchor))
    body += [svg.svg_text(tx, base + 15, label, anchor)
             for tx, label, anchor in svg.axis_labels(ticks)]
    max_mark = "" if r.get("max_exact") is not False else "≥ "
    count = svg.num(r.get("count")) or 0
    how = {"events": "exact, from stored events",
           "histogram": "estimated from in-kernel histograms"}.get(str(r.get("stats_from")),
                                                                 str(r.get("stats_from") or ""))
    caption = (f"{r.get('source') or ''} · {count:,.0f} calls · p50 {svg.dur(p[0])} · "
               f"p95 {svg.dur(p[1])} · p99 {svg.dur(p[2])} · max {max_mark}{svg.dur(p[3])} · "
               f"mean {svg.dur(mean)} · {how}")
    figure = svg.svg_doc(width, base + 20, f"latency histogram of {op}{who}", body)
    return f"<figure>{figure}<figcaption>{svg.esc(caption)}</figcaption></figure>\n"
