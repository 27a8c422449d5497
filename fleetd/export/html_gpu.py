"""The GPU section of an explain page: each rank's GPU time by what ran, and M1-M5
against the thresholds of the host-overhead verdict (fleetd.analyze.gpu.device)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetd.analyze.gpu.device import OVERHEAD_ABOVE
from fleetd.export import svg

GPU_SHARES = (("compute_pct", "compute", "#1e88e5"), ("comm_pct", "communication", "#8e24aa"),
              ("memcpy_pct", "memcpy", "#00897b"), ("idle_pct", "idle", "#bdbdbd"))
GPU_METRICS = ("M1", "M2", "M3a", "M3b", "M3c", "M4", "M5")


def gpu_section(ranks: list[Any]) -> str:
    """Per rank of an imported GPU timeline: where the GPU's time went, and M1-M5 against
    the thresholds that make the host-overhead verdict (docs/json.md, fleetd gpu)."""
    found = [svg.as_dict(r) for r in ranks]
    if not found:
        return ""
    legend = "<p class=\"legend\">" + "".join(
        f"<span><i style=\"background:{c}\"></i>{svg.esc(label)}</span>"
        for _, label, c in GPU_SHARES) + "</p>\n"
    parts = ["<section id=\"gpu\">\n<h2>GPU timeline</h2>\n<p class=\"note\">Each rank's "
             "GPU time by what ran, and the host-overhead metrics M1-M5 against the "
             "threshold that makes them count (the tick; red: on the side that counts)."
             "</p>\n", legend]
    for r in found:
        who = f"{r.get('node')} pid {r.get('pid')}" + (
            f" rank {r.get('rank')}" if r.get("rank") is not None else "")
        verdict = str(r.get("host_overhead") or "?")
        parts.append(f"<h3>{svg.esc(who)}: host overhead <span class=\""
                     f"{'yes' if verdict == 'YES' else 'note'}\">{svg.esc(verdict)}</span></h3>\n"
                     f"<p>{svg.esc(r.get('summary'))}</p>\n")
        parts.append(_gpu_shares(r, who) + _gpu_metrics(r, who))
    return "".join(parts) + "</section>\n"


def _gpu_shares(r: Mapping[str, Any], who: str) -> str:
    shares = [(key, label, c, v) for key, label, c in GPU_SHARES
              if (v := svg.num(r.get(key))) is not None and v > 0]
    if not shares:
        return ""
    bar_w, h = 600.0, 22.0
    total = max(sum(v for *_, v in shares), 100.0)
    body, x = [], 0.0
    for _, label, colour, v in shares:
        w = v / total * bar_w
        body.append(svg.svg_rect(x, 2, w, h, colour, f"{who}: {label} {v:.1f}%"))
        if w > 70:
            body.append(svg.svg_text(x + 4, 17, f"{label} {v:.1f}%", extra=" style=\"fill:#fff\""))
        x += w
    return f"<figure>{svg.svg_doc(bar_w, h + 4, f'GPU time of {who}', body)}</figure>\n"


def _gpu_metrics(r: Mapping[str, Any], who: str) -> str:
    """M1-M5 on one 0-1 axis, each with its threshold's tick; red where the value is on
    the side that counts as host overhead (above it, or below for M4)."""
    metrics, limits = svg.as_dict(r.get("metrics")), svg.as_dict(r.get("thresholds"))
    rows = [(m, v, t) for m in GPU_METRICS
            if (v := svg.num(metrics.get(m))) is not None
            and (t := svg.num(limits.get(m))) is not None]
    if not rows:
        return ""
    label_w, bar_w, row_h, top = 50.0, 400.0, 18.0, 4.0
    body = []
    for i, (m, v, t) in enumerate(rows):
        y = top + i * row_h
        above = OVERHEAD_ABOVE.get(m, True)
        over = v > t if above else v < t
        w = min(max(v, 0.0), 1.0) * bar_w
        body.append(svg.svg_text(label_w - 6, y + 12, m, "end"))
        body.append(svg.svg_rect(label_w, y + 2, max(w, 1.5), row_h - 5,
                          "#c62828" if over else "#1e88e5",
                          f"{who}: {m} = {v:.3f}, counts {'above' if above else 'below'} {t:g}"))
        tx = label_w + min(max(t, 0.0), 1.0) * bar_w
        body.append(svg.svg_line(tx, y, tx, y + row_h - 1, "median"))
        body.append(svg.svg_text(label_w + bar_w + 6, y + 12,
                          f"{v:.3f} (counts {'>' if above else '<'} {t:g})"))
    end = top + row_h * len(rows)
    return (f"<figure>{svg.svg_doc(label_w + bar_w + 160, end + 4, f'M1-M5 of {who}', body)}"
            "</figure>\n")


