"""The causal chains of an explain page: each chain's victim, culprit and shares, its
slow calls on one log scale, a zoomed timeline per call with the host events that
overlapped it, the evidence table, frames and fixes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fleetd.analyze.reading import pods
from fleetd.export import svg
from fleetd.export.html_frames import flame_graph, top_frames_chart

SEVERITY_CLASS = {"HIGH": "high", "MEDIUM": "medium", "LOW": "low"}
# Evidence kinds with a colour of their own on a chain's timeline; the rest are grey.
EVIDENCE_COLOURS = {
    "spike": "#1a237e", "stall": "#1a237e", "call": "#1a237e",
    "off_cpu": "#e53935", "runq_wait": "#fb8c00", "block_io": "#6d4c41",
    "hardirq": "#8e24aa", "softirq": "#ab47bc", "gpu_gap": "#00897b",
}
MAX_EVIDENCE_GROUPS = 5  # timelines per chain
MAX_GROUP_ITEMS = 12  # bars per timeline


def chains_section(chains: list[Any]) -> str:
    head = "<section id=\"chains\">\n<h2>Causal chains</h2>\n"
    found = [svg.as_dict(c) for c in chains]
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


def _who(task: Mapping[str, object]) -> str:
    text = f"{task.get('comm') or '?'} pid {task.get('pid')}"
    if task.get("tid") is not None and task.get("tid") != task.get("pid"):
        text += f" thread {task.get('thread') or '?'} tid {task.get('tid')}"
    elif task.get("tid") is not None:
        text += f" tid {task.get('tid')}"
    return text + pods.label(task)  # its pod and container, where recorded


def _chain(c: Mapping[str, object], index: int) -> str:
    sev = str(c.get("severity") or "LOW")
    cls = SEVERITY_CLASS.get(sev, "low")
    where = f" on {c.get('node')}" if c.get("node") else ""
    rows = [f"<tr><th>victim</th><td>{svg.esc(_who(svg.as_dict(c.get('victim'))))}</td></tr>"]
    culprit = svg.as_dict(c.get("culprit"))
    if culprit:
        ranked = svg.as_list(c.get("culprits"))
        share = svg.num(svg.as_dict(ranked[0] if ranked else {}).get("share"))
        extra = " (the victim process itself)" if culprit.get("self") is True else ""
        if share is not None:
            extra += f", {share:.0%} of the attributed time"
        rows.append(f"<tr><th>culprit</th><td>{svg.esc(_who(culprit) + extra)}</td></tr>")
    rows.append(f"<tr><th>explained</th><td>{svg.pct(c.get('explained'), 0)} of the extra "
                f"time</td></tr><tr><th>impact</th><td>{svg.pct(c.get('impact'))} of wall time"
                "</td></tr>")
    if c.get("op"):
        rows.append(f"<tr><th>op</th><td>{svg.esc(c.get('op'))}</td></tr>")
    evidence = [svg.as_dict(e) for e in svg.as_list(c.get("evidence"))]
    fixes = "".join(f"<li>{svg.esc(f)}</li>" for f in svg.as_list(c.get("fixes")))
    return (f"<article class=\"chain {cls}\" id=\"chain-{index}\">\n"
            f"<h3><span class=\"badge {cls}\">{svg.esc(sev)}</span> {svg.esc(c.get('root_cause'))}"
            f"{svg.esc(where)} <span class=\"mono note\">{svg.esc(c.get('id'))}</span></h3>\n"
            f"<p>{svg.esc(c.get('summary'))}</p>\n<table>{''.join(rows)}</table>\n"
            + _evidence_svg(evidence) + _evidence_table(evidence)
            + top_frames_chart(svg.as_dict(c.get("detail")))
            + flame_graph(svg.as_dict(c.get("detail")))
            + (f"<h4>Fix</h4>\n<ul>{fixes}</ul>\n" if fixes else "") + "</article>\n")


def _groups(evidence: Sequence[dict[str, object]]) -> list[list[dict[str, object]]]:
    """A slow call (or stall, gap, example call) and the host items that name it."""
    groups: list[list[dict[str, object]]] = []
    for e in evidence:
        if svg.num(e.get("ts_ns")) is None:
            continue
        if e.get("spike") is not None and groups:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups[:MAX_EVIDENCE_GROUPS]


def _call_lengths(groups: list[list[dict[str, object]]]) -> str:
    """Each slow call's duration as a bar on one logarithmic axis shared by the chain's
    calls, labelled with its value: the zoomed timelines below give every call the same
    width, so a 234 ms call and a 330 us one would look alike."""
    durs = [max(svg.num(g[0].get("dur_ns")) or 0.0, 0.0) for g in groups]
    if len(groups) < 2 or not any(durs):
        return ""
    label_w, bar_w, row_h, top = 150.0, 420.0, 16.0, 20.0
    positive = [d for d in durs if d > 0]
    lo = 10 ** math.floor(math.log10(min(positive)))
    hi = 10 ** math.ceil(math.log10(max(positive) * 1.001))
    span = max(math.log10(hi / lo), 1.0)

    def x(ns: float) -> float:
        return label_w + (math.log10(max(ns, lo)) - math.log10(lo)) / span * bar_w

    body = [svg.svg_text(0, 12, "each call's duration (log scale)", extra=" font-weight=\"bold\"")]
    for i, (g, d) in enumerate(zip(groups, durs, strict=True)):
        y = top + i * row_h
        first = g[0]
        when = str(first.get("time") or "")[11:23]
        body.append(svg.svg_text(label_w - 6, y + 11, svg.short(f"{first.get('kind')} {when}", 24),
                          "end"))
        w = max(x(d) - label_w, 1.5) if d > 0 else 0.0
        body.append(svg.svg_rect(label_w, y + 2, w, row_h - 4,
                          EVIDENCE_COLOURS.get(str(first.get("kind")), "#9e9e9e"),
                          f"{first.get('text') or first.get('kind')} ({svg.dur(d)})"))
        body.append(svg.svg_text(label_w + w + 4, y + 11, svg.dur(d)))
    base = top + len(groups) * row_h + 2
    body.append(svg.svg_line(label_w, base, label_w + bar_w, base, "axis"))
    ticks = []
    for i in range(int(round(span)) + 1):
        v = lo * 10 ** i
        body.append(svg.svg_line(x(v), base, x(v), base + 4, "axis"))
        ticks.append((x(v), svg.decade_label(v), "middle" if i else "start"))
    body += [svg.svg_text(tx, base + 15, t, a) for tx, t, a in svg.axis_labels(ticks)]
    drawn = svg.svg_doc(label_w + bar_w + 80, base + 20, "call durations", body)
    return f"<figure>{drawn}</figure>\n"


def _evidence_svg(evidence: Sequence[dict[str, object]]) -> str:
    groups = _groups(evidence)
    if not groups:
        return ""
    label_w, bar_w, row_h, gap = 90.0, 560.0, 16.0, 22.0
    body: list[str] = []
    y = 0.0
    for group in groups:
        items = group[:MAX_GROUP_ITEMS]
        t0 = min(svg.num(e.get("ts_ns")) or 0.0 for e in items)
        t1 = max((svg.num(e.get("ts_ns")) or 0.0) + max(svg.num(e.get("dur_ns")) or 0.0, 0.0)
                 for e in items)
        span = max(t1 - t0, 1.0)
        first = items[0]
        when = str(first.get("time") or "")[11:]
        body.append(svg.svg_text(0, y + 12, f"{first.get('kind')} at {when}, {svg.dur(span)} shown",
                          extra=" font-weight=\"bold\""))
        y += gap - 4
        for e in items:
            start = ((svg.num(e.get("ts_ns")) or t0) - t0) / span * bar_w
            w = max(max(svg.num(e.get("dur_ns")) or 0.0, 0.0) / span * bar_w, 1.5)
            kind = str(e.get("kind") or "")
            colour = EVIDENCE_COLOURS.get(kind, "#9e9e9e")
            body.append(svg.svg_text(label_w - 6, y + 12, svg.short(kind, 14), "end"))
            body.append(svg.svg_rect(label_w + start, y + 2, w, row_h - 4, colour,
                              f"{e.get('text') or kind} ({svg.dur(e.get('dur_ns'))})"))
            y += row_h
        y += 8
    return (_call_lengths(groups)
            + f"<figure>{svg.svg_doc(label_w + bar_w + 10, y, 'evidence timeline', body)}"
            "</figure>\n")


def _evidence_table(evidence: Sequence[dict[str, object]]) -> str:
    if not evidence:
        return ""
    rows = []
    for e in evidence:
        when = str(e.get("time") or "")[11:]
        text = svg.esc(e.get("text"))
        if svg.num(e.get("overlap_ns")) is not None:
            text += f" <span class=\"note\">[overlap {svg.dur(e.get('overlap_ns'))}]</span>"
        frames = [f for f in svg.as_list(e.get("stack")) if f is not None]
        if frames:
            text += ("<details><summary>stack</summary><ul class=\"frames mono\">"
                     + "".join(f"<li>{svg.esc(f)}</li>" for f in frames) + "</ul></details>")
        indent = " style=\"padding-left:1.5em\"" if e.get("spike") is not None else ""
        rows.append(f"<tr><td class=\"mono\">{svg.esc(when)}</td><td{indent}>"
                    f"{svg.esc(e.get('kind'))}</td><td>{text}</td></tr>")
    return ("<h4>Evidence</h4>\n<table><tr><th>time (UTC)</th><th>kind</th><th>what</th>"
            "</tr>" + "".join(rows) + "</table>\n")

