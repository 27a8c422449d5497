"""Rows to the terminal or a pipe: ``--format table|json|csv|ndjson``.

JSON shapes are stable and documented in docs/json.md. Blobs are written as hex
strings; the table format shows ``*ts_ns`` columns as UTC times for reading, every
other format keeps the raw integers for machines.

A table fits the output's width (``COLUMNS``, else the terminal's; a pipe or a file
without ``COLUMNS`` has no limit): numbers and identifiers are never cut or split, the
longest text columns are shortened with an ellipsis first, and when that is not enough
the rightmost columns are left out and a note says how many (``--wide`` shows every
cell in full, ``--format json`` too). Every command draws the same plain table: a
header, a rule of dashes, aligned cells; on a terminal severities are coloured
(``NO_COLOR`` or ``TERM=dumb`` turns colour off; a pipe or a file never gets a code).
Prose lines (explain, gpu, check) are wrapped to the same width at spaces, with a
hanging indent (:class:`Wrapped`).

Every cell, note and warning is :func:`fleetd.printable.printable`: a name a traced
process chose (a comm, a thread name, a Python function) shows its control characters
escaped (``\\x1b``, ``\\n``), never as a terminal command or a line of its own. JSON,
CSV and NDJSON keep the exact values.
"""

from __future__ import annotations

import csv
import io
import os
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import orjson

from fleetd.errors import UsageError
from fleetd.printable import printable, printable_cell
from fleetd.store.catalog import BY_NAME
from fleetd.store.cuda_errors import runtime_error
from fleetd.store.timeparse import format_ns

FORMATS = ("table", "json", "csv", "ndjson")
# Severities on a colour terminal (SGR parameters): bold red, yellow, cyan.
SEVERITY_STYLE = {"HIGH": "1;31", "MEDIUM": "33", "LOW": "36"}
ELLIPSIS = "…"
MIN_TEXT = 8  # a text column is never shortened below this (or its header)
# Columns that name things a user types back (a node, an op, a process): shortened only
# after every other text column.
_NAMES = ("node", "op", "comm", "thread", "name", "check", "metric")
# Left out first when a table cannot fit (before any column from the right): figures
# that restate others or say where a figure came from.
_DROP_FIRST = ("stats_from", "events", "calls_per_s", "source", "mean", "total",
               "lost_events", "sessions", "crashed", "thread", "other", "in_cuda")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SGR_SPLIT = re.compile(r"(\x1b\[[0-9;]*m)")
# A number and its unit, or a metric and its value, stay on one line when text wraps.
_GLUE = re.compile(r"(?<=\d) (?=(?:ns|us|ms|s|min|h|MB|GB|KiB|MiB|GiB|%)\b)|(?<=\bM\d) (?=\d)"
                   r"|(?<=\bM\d[abc]) (?=\d)")
_NBSP = "\u00a0"
_wide = False


def set_wide(wide: bool) -> None:
    """``--wide``: every cell in full, whatever the width (set once by the CLI)."""
    global _wide
    _wide = wide


def output_width(out: TextIO) -> int | None:
    """The width to fit: ``COLUMNS``, else the terminal's; None (no limit) for a pipe
    or a file without ``COLUMNS``, and with ``--wide``."""
    if _wide:
        return None
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if _is_terminal(out):
        try:
            return os.get_terminal_size(out.fileno()).columns
        except (OSError, ValueError, io.UnsupportedOperation):
            return None
    return None


def fit_columns(columns: Sequence[str], cells: list[list[str]], numeric: list[bool],
                width: int | None, gap: int = 2) -> tuple[list[int], list[int]]:
    """(indices of the columns shown, their widths) for a table ``width`` wide.

    Free text gives up width first, the widest column first; then the rightmost columns
    are left out (never the first); names (node, op, comm...) are shortened only when
    one column is left. Numbers, with or without a unit (``4.01 ms``, ``≥ 5.01 ms``,
    ``15.8%``), and identifiers (a chain id, a session, a hash) are never shortened."""
    natural = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    shown = list(range(len(columns)))
    widths = list(natural)
    if width is None:
        return shown, widths
    whole = [numeric[i] or _all_numbers(cells, i) or _identifiers(columns[i], cells, i)
             for i in range(len(columns))]
    while True:
        excess = sum(widths[i] for i in shown) + gap * (len(shown) - 1) - width
        if excess <= 0:
            break
        free = [i for i in shown if not whole[i] and columns[i] not in _NAMES
                and widths[i] > max(MIN_TEXT, len(columns[i]))]
        if free:
            i = max(free, key=lambda j: widths[j])
            widths[i] = max(MIN_TEXT, len(columns[i]), widths[i] - excess)
        elif len(shown) > 1:
            droppable = [i for i in shown[1:] if columns[i] in _DROP_FIRST]
            shown.remove(min(droppable, key=lambda j: _DROP_FIRST.index(columns[j]))
                         if droppable else shown[-1])
        else:
            widths[0] = max(MIN_TEXT, width) if not whole[0] else widths[0]
            break
    return shown, [widths[i] for i in shown]


_NUMBER = re.compile(r"^[≥≤<>~]?\s*[-+]?\d[\d.,:]*(\s*[a-zA-Zµ%/*]{0,4})?[*%]?$")


_ID_COLUMNS = ("id", "key", "session", "chain", "comm_hash", "fingerprint")
_ID_VALUE = re.compile(r"^[\w.-]+:[0-9a-f]{6,}$|^[0-9a-f]{12,}$")  # node:hash, a hash


def _identifiers(column: str, cells: list[list[str]], i: int) -> bool:
    """A column of identifiers a user copies back (a chain id ``rec-01:2ee284497fd6``,
    a session, a hash): never shortened, or the copy would not work."""
    if column in _ID_COLUMNS or column.endswith("_id"):
        return True
    values = [r[i] for r in cells if r[i]]
    return bool(values) and all(_ID_VALUE.match(v) for v in values)


def _all_numbers(cells: list[list[str]], i: int) -> bool:
    """A column of numbers written as text (human units, percentages, times)."""
    values = [r[i] for r in cells if r[i]]
    return bool(values) and all(_NUMBER.match(v) for v in values)


def human_ns(value: object) -> object:
    """A duration in nanoseconds as tables show it (``4.01 ms``); other values as they
    are. JSON, CSV and NDJSON keep the integers."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return value
    if value >= 1_000_000_000:
        return f"{value / 1e9:.2f} s"
    if value >= 1_000_000:
        return f"{value / 1e6:.2f} ms"
    return f"{value / 1e3:.1f} us"


def clip(text: str, width: int) -> str:
    """``text`` in ``width`` characters: cut at a space where one is near, so the
    ellipsis never stands for half a number or a name."""
    if len(text) <= width:
        return text
    cut = text[: max(0, width - 1)]
    space = cut.rfind(" ")
    if text[len(cut)] != " " and space >= len(cut) // 2:
        cut = cut[: space + 1]
    return cut + ELLIPSIS


def _hidden_note(hidden: int) -> str:
    return (f" ({hidden} column{'s' if hidden != 1 else ''} left out to fit: --wide or "
            "--format json for all)") if hidden else ""


class Wrapped(io.TextIOBase):
    """A text stream that wraps each line longer than ``width`` at spaces, with a
    hanging indent; a number or a word is never split, a line that fits passes as it is
    (tables drawn to fit pass untouched)."""

    def __init__(self, inner: TextIO, width: int) -> None:
        self.inner, self.width, self._pending = inner, width, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self.inner.write(self._wrap(line) + "\n")
        return len(text)

    def _wrap(self, line: str) -> str:
        # Values come escaped (fleetd.printable); a control character a writer let
        # through is escaped here too. Only our own colours (SGR) pass as they are.
        line = "".join(part if _ANSI.fullmatch(part) else printable(part)
                       for part in _SGR_SPLIT.split(line))
        if len(_ANSI.sub("", line)) <= self.width:
            return line
        plain = _GLUE.sub(_NBSP, _ANSI.sub("", line))
        lead = plain[: len(plain) - len(plain.lstrip(" "))]
        if plain.lstrip().startswith("- "):
            text = self._wrap_clauses(plain, lead + "  ")
        else:
            text = "\n".join(textwrap.wrap(plain, self.width, subsequent_indent=lead + "  ",
                                            break_long_words=False, break_on_hyphens=False))
        return text.replace(_NBSP, " ")

    def _wrap_clauses(self, line: str, indent: str) -> str:
        """A fix (``- ...``) holds commands to paste: it breaks after a clause's
        punctuation (``, `` ``; `` ``: ``) where it can, and never inside parentheses."""
        # The line's own indent stays in front (split into words, it would be lost).
        body = line.lstrip(" ")
        out = [line[: len(line) - len(body)]]
        for part in self._pieces(body, len(indent)):
            joined = f"{out[-1]} {part}" if out[-1].strip() else out[-1] + part
            if len(joined) <= self.width or not out[-1].strip():
                out[-1] = joined
            else:
                out.append(indent + part)
        return "\n".join(out)

    def _pieces(self, line: str, indent: int) -> list[str]:
        """Whole clauses where they fit a line, else words with parenthesised groups
        kept together."""
        pieces: list[str] = []
        for clause in re.split(r"(?<=[,;:]) ", line):
            if len(clause) + indent <= self.width:
                pieces.append(clause)
                continue
            depth = 0
            for word in clause.split(" "):
                if depth > 0:
                    pieces[-1] += " " + word
                else:
                    pieces.append(word)
                depth = max(0, depth + word.count("(") - word.count(")"))
        return pieces

    def flush(self) -> None:
        if self._pending:
            self.inner.write(self._wrap(self._pending))
            self._pending = ""
        self.inner.flush()

    def isatty(self) -> bool:
        return _is_terminal(self.inner)

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True


def print_notes(obj: Mapping[str, Any], found: bool, fmt: str) -> None:
    """After a table: the answer's note (when nothing was found) and its warnings, on
    stderr, so the table itself stays clean for ``| column`` and friends. JSON keeps
    both inside the object."""
    if fmt == "json":
        return
    if not found and obj.get("note"):
        print(f"fleetd: note: {printable(str(obj['note']))}", file=sys.stderr)
    warn(obj.get("warnings") or [])


def warn(warnings: Sequence[object], prefix: str = "", out: TextIO | None = None) -> None:
    """Each warning as one ``fleetd: warning:`` line on ``out`` (stderr), whatever it
    quotes (a comm, a file name, a node's error text: shown escaped, never a line of
    its own)."""
    for w in warnings:
        print(f"fleetd: warning: {printable(prefix + str(w))}",
              file=out if out is not None else sys.stderr)


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
        out.write(table(columns, rows, out))


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class Held(io.StringIO):
    """Text held back to be written whole later (after a live progress line is gone),
    that lays itself out for the stream it will reach: that stream's width and colour."""

    def __init__(self, dest: TextIO | None) -> None:
        super().__init__()
        self.dest = dest

    def isatty(self) -> bool:
        return self.dest is not None and _is_terminal(self.dest)

    def fileno(self) -> int:
        if self.dest is None:
            raise io.UnsupportedOperation("held text for a file")
        return self.dest.fileno()


def colour_wanted(out: TextIO) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set or ``TERM=dumb``."""
    return (_is_terminal(out) and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb")


def paint(text: str, style: str) -> str:
    """``text`` in an SGR style (our own codes: the printable stream lets them pass)."""
    return f"\x1b[{style}m{text}\x1b[0m" if style and text else text


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
    return printable_cell(str(_plain(value)))


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


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]],
          out: TextIO | None = None) -> str:
    """An aligned text table, numbers right-aligned, fitted to ``out``'s width
    (default: standard output's)."""
    if not columns:
        return "(no columns)\n"
    cells = _cells(columns, rows)
    numeric = _numeric(columns, rows)
    dest = out if out is not None else sys.stdout
    shown, widths = fit_columns(columns, cells, numeric, output_width(dest))
    colour = colour_wanted(dest)

    def line(vals: Sequence[str], styled: bool = False) -> str:
        parts = []
        for i, w in zip(shown, widths, strict=True):
            v = clip(vals[i], w)
            pad = " " * (w - len(v))
            if styled:  # the padding stays outside the colour, so columns still align
                v = paint(v, _severity_style(columns[i], v))
            parts.append(pad + v if numeric[i] else v + pad)
        return "  ".join(parts).rstrip() + "\n"
    out_lines = [line(list(columns)), "  ".join("-" * w for w in widths) + "\n"]
    out_lines += [line(r, colour) for r in cells]
    out_lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})"
                     + _hidden_note(len(columns) - len(shown)) + "\n")
    return "".join(out_lines)


# The op statistics' duration columns (fleetd.analyze.pernode.opstats), in ns.
NS_COLUMNS = ("total_ns", "mean_ns", "p50_ns", "p95_ns", "p99_ns", "max_ns")


def table_view(cols: list[str], rows: list[list[object]],
               fmt: str) -> tuple[list[str], list[list[object]]]:
    """Tables show durations for reading, under headers without ``_ns`` (the cells are
    not nanoseconds any more), and a histogram's max as ``≥`` its lower bound; every
    other format keeps the integers (ns) and the ``max_exact`` flag for machines."""
    if fmt != "table":
        return cols, rows
    exact = cols.index("max_exact") if "max_exact" in cols else None
    keep = [i for i, c in enumerate(cols) if i != exact]
    out = []
    for r in rows:
        cells = [_duration(v) if cols[i] in NS_COLUMNS else v for i, v in enumerate(r)]
        mx = cols.index("max_ns") if "max_ns" in cols else None
        if exact is not None and mx is not None and r[exact] is False and cells[mx]:
            cells[mx] = f"≥ {cells[mx]}"
        out.append([cells[i] for i in keep])
    return [cols[i].removesuffix("_ns") for i in keep], out


def _duration(value: object) -> object:
    return human_ns(value) if isinstance(value, int) else value
