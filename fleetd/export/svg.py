"""Drawing an explain page's charts: inline SVG elements and the values they show, from
an untrusted report (every string escaped, every number checked finite), the same bytes
for the same report on every machine."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

LABEL_CHARS = 44  # longest label drawn inside a chart (the full text is in its tooltip)


def esc(value: Any) -> str:
    """Any value as escaped text (quotes too: safe in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_dict(value: Any) -> dict[str, object]:
    """An object of the report, else empty. The page draws any report, whatever its
    shape (a node may send anything: tests/unit/test_explain_html.py), so its values
    stay unchecked ``object`` here: each is read through :func:`num`, :func:`esc`,
    :func:`as_list` or this, never trusted to have a type."""
    return value if isinstance(value, dict) else {}


def num(value: Any) -> float | None:
    """A finite number, or None (bools, strings and NaN are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def short(text: str, n: int = LABEL_CHARS) -> str:
    """Cut before escaping, so that an entity is never split."""
    return text if len(text) <= n else text[: n - 1] + "…"


def dur(ns: Any) -> str:
    v = num(ns)
    if v is None:
        return "-"
    if abs(v) >= 1e9:
        return f"{v / 1e9:.2f} s"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.2f} ms"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f} us"
    return f"{v:.0f} ns"


def pct(share: Any, digits: int = 1) -> str:
    v = num(share)
    return "-" if v is None else f"{v * 100:.{digits}f}%"



def coord(x: float) -> str:
    """An SVG coordinate: short and the same on every machine."""
    return f"{x:.1f}"


def svg_doc(width: float, height: float, label: str, body: Iterable[str]) -> str:
    w, h = coord(width), coord(height)
    return (f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" "
            f"viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"{esc(label)}\">\n"
            + "\n".join(body) + "\n</svg>")


def svg_text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return (f"<text x=\"{coord(x)}\" y=\"{coord(y)}\" text-anchor=\"{anchor}\"{extra}>"
            f"{esc(text)}</text>")


def svg_rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{esc(title)}</title>" if title else ""
    return (f"<rect x=\"{coord(x)}\" y=\"{coord(y)}\" width=\"{coord(max(w, 0.0))}\" "
            f"height=\"{coord(max(h, 0.0))}\" fill=\"{fill}\">{tip}</rect>")


def svg_line(x1: float, y1: float, x2: float, y2: float, cls: str) -> str:
    return (f"<line class=\"{cls}\" x1=\"{coord(x1)}\" y1=\"{coord(y1)}\" x2=\"{coord(x2)}\" "
            f"y2=\"{coord(y2)}\"/>")



CHAR_W = 6.2  # px per character of svg text at 11 px (a wide estimate: no overlap)


def extent(x: float, text: str, anchor: str) -> tuple[float, float]:
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
    last_left = extent(*ticks[-1])[0]
    kept = [ticks[0]]
    right = extent(*ticks[0])[1]
    for tick in ticks[1:-1]:
        left, end = extent(*tick)
        if left >= right + gap and end <= last_left - gap:
            kept.append(tick)
            right = end
    if extent(*ticks[-1])[0] >= right + gap or len(kept) > 1:
        kept.append(ticks[-1])
    return kept


def decade_label(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:g} {unit}"
    return f"{ns:g} ns"


