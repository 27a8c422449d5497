"""The two value formats of every trace line: exact microseconds, and JSON text.

The tracks (:mod:`fleetd.export.perfetto`) and the chain arrows
(:mod:`fleetd.export.flows`) write lines of one trace and must format times the same
way, or arrows would miss the slices they bind to; this small module is what they share,
so that neither depends on the other's internals.
"""

from __future__ import annotations

from typing import Any

import orjson


def us(ns: int) -> str:
    """Nanoseconds as exact decimal microseconds."""
    if ns >= 0:
        return f"{ns // 1000}.{ns % 1000:03d}"
    return "-" + us(-ns)


def json_text(value: Any) -> str:
    """``value`` as compact JSON text."""
    return orjson.dumps(value).decode()
