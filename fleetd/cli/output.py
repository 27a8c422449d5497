"""Rows to the terminal or a pipe: ``--format table|json|csv|ndjson``.

JSON shapes are stable and documented in docs/json.md. Blobs are written as hex
strings; the table format shows ``*ts_ns`` columns as UTC times for reading, every
other format keeps the raw integers for machines.

A table on a terminal is drawn with ``rich``: it fits the terminal's width (long cells
wrap instead of being cut), severities are coloured and ``NO_COLOR`` turns colour off.
In a pipe or a file, and for results too large to lay out at once, the plain writer
prints every cell in full, aligned, without escape codes.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import orjson

from fleetd.errors import UsageError
from fleetd.store.catalog import BY_NAME
from fleetd.store.cuda_errors import runtime_error
from fleetd.store.timeparse import format_ns

FORMATS = ("table", "json", "csv", "ndjson")
RICH_MAX_ROWS = 2_000  # beyond this a terminal gets the plain writer: rich lays out all rows
SEVERITY_STYLE = {"HIGH": "bold red", "MEDIUM": "yellow", "LOW": "cyan"}


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
    elif len(rows) <= RICH_MAX_ROWS and _is_terminal(out):
        _rich_table(columns, rows, out)
    else:
        out.write(table(columns, rows))


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _rich_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Console reads the terminal's width and honours NO_COLOR and TERM=dumb itself.
    console = Console(file=out, highlight=False, soft_wrap=False)
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    cells = _cells(columns, rows)
    numeric = _numeric(columns, rows)
    for i, c in enumerate(columns):
        grid.add_column(c, justify="right" if numeric[i] else "left", overflow="fold")
    for r in cells:
        grid.add_row(*(Text(v, style=_severity_style(c, v)) for c, v in zip(columns, r,
                                                                             strict=True)))
    console.print(grid)
    console.print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})", style="dim")


def _severity_style(column: str, text: str) -> str:
    """The colour of a severity: a count under a ``high``/``medium``/``low`` header when
    it is not zero, and a cell that leads with one (``HIGH``, ``[HIGH] ...``, ``1 HIGH,
    ...``)."""
    if column.upper() in SEVERITY_STYLE:
        return SEVERITY_STYLE[column.upper()] if text not in ("", "0") else ""
    head = text.lstrip("[").split(" ", 2)
    for word in head[:2]:
        style = SEVERITY_STYLE.get(word.strip("],;"))
        if style and head[0] != "0":
            return style
    return ""


def _cell(col: str, value: Any) -> str:
    if value is None:
        return ""
    if col.endswith("ts_ns") and isinstance(value, int) and value > 10**17:
        return format_ns(value)
    if isinstance(value, float):
        return _float(value)
    text = str(_plain(value)).replace("\n", "\\n").replace("\t", " ")
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _float(value: float) -> str:
    """Six significant digits, never an exponent: 4065520.5, not 4.06552e+06."""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if abs(value) >= 1e5 or value == int(value):
        return f"{value:.1f}".removesuffix(".0")
    text = f"{value:.6g}"
    return f"{value:.{_decimals(value)}f}".rstrip("0") if "e" in text else text


def _decimals(value: float) -> int:
    # Enough decimals for six significant digits of a small number (1.5e-05: 0.000015).
    digits = 0
    while digits < 15 and abs(value) * 10 ** digits < 1e5:
        digits += 1
    return digits


def _cuda_errors(columns: Sequence[str], cells: list[list[str]],
                 rows: Sequence[Sequence[Any]]) -> None:
    """``ret`` of a CUDA runtime call with its name, where the row says which op it was."""
    if "ret" not in columns or "op" not in columns:
        return
    r_at, op_at = list(columns).index("ret"), list(columns).index("op")
    for cell, row in zip(cells, rows, strict=True):
        op = BY_NAME.get(str(row[op_at]))
        ret = row[r_at]
        if op is not None and op.source == "cuda" and isinstance(ret, int):
            name = runtime_error(ret)
            if name:
                cell[r_at] = f"{ret} {name}"


def _cells(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    cells = [[_cell(c, v) for c, v in zip(columns, r, strict=False)] for r in rows]
    _cuda_errors(columns, cells, rows)
    return cells


def _numeric(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[bool]:
    return [all(isinstance(r[i], int | float) or r[i] is None for r in rows) and bool(rows)
            for i in range(len(columns))]


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table; numbers right-aligned."""
    if not columns:
        return "(no columns)\n"
    cells = _cells(columns, rows)
    numeric = _numeric(columns, rows)
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
