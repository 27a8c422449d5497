"""Rows to the terminal or a pipe: ``--format table|json|csv|ndjson``.

JSON shapes are stable and documented in docs/json.md. Blobs are written as hex
strings; the table format shows ``*ts_ns`` columns as UTC times for reading, every
other format keeps the raw integers for machines.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import orjson

from fleetd.errors import UsageError
from fleetd.store.timeparse import format_ns

FORMATS = ("table", "json", "csv", "ndjson")
MAX_CELL = 60


def print_notes(obj: Mapping[str, Any], found: bool, fmt: str) -> None:
    """After a table: the answer's note (when nothing was found) and its warnings, on
    stderr, so the table itself stays clean for ``| column`` and friends. JSON keeps
    both inside the object."""
    if fmt == "json":
        return
    if not found and obj.get("note"):
        print(f"fleetd: note: {obj['note']}", file=sys.stderr)
    for w in obj.get("warnings") or []:
        print(f"fleetd: warning: {w}", file=sys.stderr)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}", f"use one of: {', '.join(FORMATS)}")
    return fmt


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return value


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=_plain, option=orjson.OPT_NON_STR_KEYS)


def write_rows(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    fmt: str,
    out: TextIO = sys.stdout,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write a result set; ``extra`` (truncated, warnings, skew...) joins the JSON object."""
    if fmt == "json":
        obj: dict[str, Any] = {
            "columns": list(columns),
            "rows": [list(map(_plain, r)) for r in rows],
        }
        obj.update(extra or {})
        out.write(dumps(obj).decode() + "\n")
    elif fmt == "ndjson":
        for r in rows:
            out.write(dumps(dict(zip(columns, map(_plain, r), strict=False))).decode() + "\n")
    elif fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if v is None else _plain(v) for v in r])
    else:
        out.write(table(columns, rows))


def _cell(col: str, value: Any) -> str:
    if value is None:
        return ""
    if col.endswith("ts_ns") and isinstance(value, int) and value > 10**17:
        return format_ns(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(_plain(value)).replace("\n", "\\n").replace("\t", " ")
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table; numbers right-aligned."""
    if not columns:
        return "(no columns)\n"
    cells = [[_cell(c, v) for c, v in zip(columns, r, strict=False)] for r in rows]
    numeric = [
        all(isinstance(r[i], int | float) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(columns))
    ]
    widths = [len(c) for c in columns]
    for r in cells:
        for i, v in enumerate(r):
            widths[i] = max(widths[i], len(v))
    def line(vals: Sequence[str]) -> str:
        parts = [
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(vals)
        ]
        return "  ".join(parts).rstrip() + "\n"
    out = [line(list(columns)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
    return "".join(out)
