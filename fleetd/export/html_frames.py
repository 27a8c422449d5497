"""The on-CPU chains' top frames and flame graph in ``explain --format html``.

``host_cpu_bound`` names the frames the feeding thread ran (``detail.top_frames``: frame,
samples, share of its on-CPU samples); this draws them one bar each, widest first, so
the page shows where the host time went without a separate profile. Beside them, the
thread's stacks (``detail.flame``: outermost frame first, with their samples) are drawn
as an icicle graph: the root at the top, each frame a box as wide as the samples of the
stacks that pass through it, its callees below it. Frames are traced text: every one is
escaped, and shown shortened with the full text as its tooltip.
"""

from __future__ import annotations

import html
import zlib
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


FLAME_W, FLAME_ROW = 960.0, 16.0
FLAME_ROWS = 65  # the root and FLAME_DEPTH frames
CHAR_W = 6.2  # of the 11 px font, for how much of a label fits


class _Node:
    __slots__ = ("children", "samples")

    def __init__(self) -> None:
        self.samples = 0
        self.children: dict[str, _Node] = {}


def flame_graph(detail: Mapping[str, Any]) -> str:
    """An ``<h4>`` and an SVG icicle graph of ``detail.flame``; "" without stacks."""
    flame = detail.get("flame")
    root = _Node()
    for st in (flame.get("stacks") if isinstance(flame, Mapping) else None) or []:
        if not isinstance(st, Mapping):
            continue
        n, frames = st.get("samples"), st.get("frames")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(
                frames, list):
            continue
        root.samples += n
        node = root
        for f in frames[:FLAME_ROWS - 1]:
            node = node.children.setdefault(str(f), _Node())
            node.samples += n
    if root.samples == 0:
        return ""
    body: list[str] = []
    depth = _draw(body, "all", root, 0.0, 0, root.samples)
    height = FLAME_ROW * (depth + 1) + 2
    svg = (f"<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"flame\" "
           f"width=\"{FLAME_W:.0f}\" height=\"{height:.0f}\" role=\"img\" "
           f"aria-label=\"flame graph of the thread's on-CPU samples\">\n"
           + "\n".join(body) + "\n</svg>")
    return (f"<h4>Flame graph ({root.samples} on-CPU samples of the thread; callers above "
            f"callees, width = share of the samples)</h4>\n<figure>{svg}</figure>\n")


def _draw(body: list[str], name: str, node: _Node, x: float, depth: int, total: int) -> int:
    """Draw ``node`` at ``x`` and its callees below it, by name; the deepest row used."""
    width = FLAME_W * node.samples / total
    y = 1 + depth * FLAME_ROW
    chars = int((width - 4) / CHAR_W)
    label = "" if chars < 3 else name if len(name) <= chars else name[:chars - 1] + "…"
    body.append(f"<g><title>{_e(name)}: {node.samples} samples, "
                f"{node.samples / total:.1%}</title><rect x=\"{x:.3f}\" y=\"{y:.0f}\" "
                f"width=\"{width:.3f}\" height=\"{FLAME_ROW - 1:.0f}\" "
                f"fill=\"{_colour(name)}\" data-depth=\"{depth}\" "
                f"data-samples=\"{node.samples}\"/>"
                + (f"<text x=\"{x + 2:.1f}\" y=\"{y + 11:.0f}\">{_e(label)}</text>"
                   if label else "") + "</g>")
    deepest, at = depth, x
    for child_name in sorted(node.children):
        child = node.children[child_name]
        deepest = max(deepest, _draw(body, child_name, child, at, depth + 1, total))
        at += FLAME_W * child.samples / total
    return deepest


def _colour(name: str) -> str:
    """Warm for Python frames, blue for the kernel, grey for the collector and the root,
    orange-red for other native code; the shade from the name, so it is stable."""
    v = zlib.crc32(name.encode()) % 60
    if name == "all" or name.startswith("[garbage"):
        return "#bdbdbd"
    if name.endswith(" (kernel)"):
        return f"rgb({120 + v // 2},{160 + v // 2},230)"
    if ".py:" in name:
        return f"rgb(240,{150 + v},{60 + v // 2})"
    return f"rgb(230,{90 + v},{60 + v // 3})"


def _share(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return min(1.0, max(0.0, float(value))) if ok else 0.0


def _e(text: str) -> str:
    return html.escape(text, quote=True)
