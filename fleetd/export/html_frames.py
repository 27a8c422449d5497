"""The on-CPU chains' top frames as a bar chart in ``explain --format html``.

``host_cpu_bound`` names the frames the feeding thread ran (``detail.top_frames``: frame,
samples, share of its on-CPU samples); this draws them one bar each, widest first, so
the page shows where the host time went without a separate profile. Frames are traced
text: every one is escaped, and shown shortened with the full text as its tooltip.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

BAR_W, ROW_H, LABEL_W = 360.0, 18.0, 330.0
LABEL_CHARS = 52
FILL = "#4c78a8"


def top_frames_chart(detail: Mapping[str, Any]) -> str:
    """An ``<h4>`` and an SVG of the chain's top frames; "" for a chain without them."""
    frames = [f for f in detail.get("top_frames") or [] if isinstance(f, Mapping)]
    rows = [(str(f.get("frame") or "?"), _share(f.get("share"))) for f in frames][:10]
    if not rows:
        return ""
    width, height = LABEL_W + BAR_W + 60, ROW_H * len(rows) + 6
    body = []
    for i, (frame, share) in enumerate(rows):
        y = 3 + i * ROW_H
        label = frame if len(frame) <= LABEL_CHARS else frame[:LABEL_CHARS - 1] + "…"
        body.append(f"<text x=\"{LABEL_W - 6:.0f}\" y=\"{y + 13:.0f}\" text-anchor=\"end\">"
                    f"<title>{_e(frame)}</title>{_e(label)}</text>")
        body.append(f"<rect x=\"{LABEL_W:.0f}\" y=\"{y + 2:.0f}\" width=\"{BAR_W * share:.1f}\""
                    f" height=\"{ROW_H - 4:.0f}\" fill=\"{FILL}\"><title>{_e(frame)}: "
                    f"{share:.1%} of the samples</title></rect>")
        body.append(f"<text x=\"{LABEL_W + BAR_W * share + 4:.1f}\" y=\"{y + 13:.0f}\">"
                    f"{share:.0%}</text>")
    svg = (f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0f}\" "
           f"height=\"{height:.0f}\" role=\"img\" aria-label=\"top frames on the CPU\">\n"
           + "\n".join(body) + "\n</svg>")
    return f"<h4>Top frames (share of the thread's on-CPU samples)</h4>\n{svg}\n"


def _share(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return min(1.0, max(0.0, float(value))) if ok else 0.0


def _e(text: str) -> str:
    return html.escape(text, quote=True)
