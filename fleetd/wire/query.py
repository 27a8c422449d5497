"""A node's query answer (``POST /api/v1/query``), read and checked once, where it is read.

As one JSON document (:func:`check_rows`) or streamed as NDJSON (:class:`QueryStream`):
a header object, one JSON array per row and a trailer object. A stream is read
incrementally, so the answer never exists twice in memory (the raw body and its
objects), and each line is checked as it comes, under the same bounds as a JSON answer:
the byte cap per answer (counted as the bytes arrive, a line without its newline
included), a row cap, and values SQLite can hold. The result has the JSON answer's
shape, :class:`~fleetd.wire.shapes.QueryReply`.

An answer is untrusted: no header, a row that is not an array of the header's width, a
value beyond 64 bits, a line after the trailer, or a stream that ends without a trailer
(cut off, or a hostile node) each raise :class:`~fleetd.wire.failure.BadReply` with a named
reason, never an exception of another kind.
"""

from __future__ import annotations

from typing import Any

import orjson

from fleetd.wire.failure import BadReply
from fleetd.wire.limits import COLUMN_CHARS, MAX_COLUMNS, MAX_ROWS
from fleetd.wire.shapes import ErrorDetail, QueryReply, StreamTrailer
from fleetd.wire.values import is_cell, is_number, printable, valid_int

TRUNCATED_REASONS = ("rows", "bytes")


def check_rows(reply: dict[str, object], max_rows: int | None) -> QueryReply:
    """A node's JSON query answer (as parsed: untrusted, so its values are ``object``
    until read here), made safe to merge, in place (and returned as its shape): at most
    ``max_rows`` rows (a node that ignores the limit is cut, and its answer marked
    truncated), every row as wide as the columns, every cell a value SQLite can hold,
    column names printable."""
    columns, rows = reply.get("columns"), reply.get("rows")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise _bad_json("columns that are not a list of names")
    if not isinstance(rows, list):
        raise _bad_json("rows that are not a list")
    truncated = bool(reply.get("truncated"))
    reason = reply.get("truncated_reason")
    if max_rows is not None and len(rows) > max_rows:
        del rows[max_rows:]
        truncated, reason = True, "rows"
    for row in rows:
        if not isinstance(row, list) or len(row) != len(columns):
            raise _bad_json(f"a row that is not a list of {len(columns)} values")
        _check_cells(row, lambda what: _bad_json(what))
    node, elapsed = reply.get("node"), reply.get("elapsed_ms")
    checked: QueryReply = {
        "node": node if isinstance(node, str) else None,
        "columns": [printable(c, 200) for c in columns], "rows": rows,
        "truncated": truncated,
        "truncated_reason": reason if reason in TRUNCATED_REASONS else None,
        "elapsed_ms": elapsed if isinstance(elapsed, int | float) and is_number(elapsed)
        else None}
    reply.update(checked)
    return checked


def _bad_json(what: str) -> BadReply:
    return BadReply(f"query answer: {what}")


def _bad_stream(what: str) -> BadReply:
    return BadReply(f"streamed answer: {what}")


def _check_cells(row: list[Any], bad: Any) -> None:
    for cell in row:
        if not is_cell(cell):
            raise bad(f"a value SQLite cannot hold ({printable(cell, 40)})")


def error_detail(err: object) -> ErrorDetail:
    """A node's ``error`` object, its strings made printable; missing parts empty."""
    got = err if isinstance(err, dict) else {}
    detail: ErrorDetail = {
        "code": printable(got.get("code") or "", 40),
        "message": printable(got.get("message") or "", 500)}
    if got.get("hint"):
        detail["hint"] = printable(got["hint"], 500)
    return detail


class QueryStream:
    """Feed it the body's pieces (:meth:`feed`), then :meth:`finish` for the answer."""

    def __init__(self, cap: int, max_rows: int = MAX_ROWS) -> None:
        self.cap = cap
        self.max_rows = max_rows
        self.got = 0  # bytes received
        self.columns: list[str] | None = None  # the header's, once read (printable)
        self.node: str | None = None  # the header's node, when it names one
        self.width = 0
        self.rows: list[list[Any]] = []
        self.trailer: StreamTrailer | None = None
        self.cut = False  # more rows than we keep: the rest is not read
        self._pending: list[bytes] = []  # the last line so far, not yet ended

    def feed(self, piece: bytes) -> bool:
        """Take one piece of the body; False once nothing more need be read."""
        self.got += len(piece)
        if self.got > self.cap:
            raise BadReply(f"answer of {self.got}+ bytes is over the client's {self.cap} "
                           "byte limit for one answer", "lower --limit or narrow the query",
                           kind="too_large")
        self._pending.append(piece)
        if b"\n" not in piece:
            # Part of a long line: kept as pieces, joined once its newline comes (joining
            # at every piece would copy a 30 MB line hundreds of times).
            return True
        lines = b"".join(self._pending).split(b"\n")
        self._pending = [lines.pop()]
        return all(self._line(line) for line in lines if line)

    def _line(self, line: bytes) -> bool:
        if self.trailer is not None:
            raise _bad_stream("a line after the trailer")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            shown = printable(line[:60].decode("utf-8", "replace"))
            raise _bad_stream(f"a line that is not JSON: {shown!r}") from None
        if self.columns is None:
            self._take_header(obj)
        elif isinstance(obj, list):
            self._take_row(obj)
        elif isinstance(obj, dict):
            self._take_trailer(obj)
        else:
            raise _bad_stream(f"a line that is a JSON {type(obj).__name__}")
        return not self.cut

    def _take_header(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            raise _bad_stream("no header object first")
        cols = obj.get("columns")
        if (not isinstance(cols, list) or len(cols) > MAX_COLUMNS
                or not all(isinstance(c, str) for c in cols)):
            raise _bad_stream("a header whose columns are not a list of names")
        limits = obj.get("limits")
        claimed = valid_int(limits.get("max_rows"), 1) if isinstance(limits, dict) else None
        if claimed is not None:
            self.max_rows = min(self.max_rows, claimed)  # may lower ours, never raise it
        node = obj.get("node")
        self.node = node if isinstance(node, str) else None
        self.columns, self.width = [printable(c, COLUMN_CHARS) for c in cols], len(cols)

    def _take_row(self, row: list[Any]) -> None:
        if len(row) != self.width:
            raise _bad_stream(f"a row that is not a list of {self.width} values")
        _check_cells(row, _bad_stream)
        if len(self.rows) >= self.max_rows:
            self.cut = True  # a node past the limit: keep what the limit allows
            return
        self.rows.append(row)

    def _take_trailer(self, obj: dict[str, object]) -> None:
        """The last line (a JSON object as parsed: untrusted until read here)."""
        if obj.get("error") is not None:
            err = error_detail(obj["error"])
            code = err["code"]
            raise BadReply(f"failed after {len(self.rows)} rows{f' ({code})' if code else ''}: "
                           f"{err['message'] or 'no error message'}", err.get("hint"),
                           kind="http", code=code or None)
        raw_n = obj.get("rows")
        n = valid_int(raw_n, 0)
        if obj.get("end") is not True or n is None:
            raise _bad_stream("a trailer without end and a row count")
        if n != len(self.rows):
            raise _bad_stream(f"a trailer that counts {printable(raw_n, 30)} rows, "
                              f"after {len(self.rows)}")
        elapsed, reason = obj.get("elapsed_ms"), obj.get("truncated_reason")
        self.trailer = {"end": True, "rows": n, "truncated": obj.get("truncated") is True,
                        "truncated_reason": reason if reason in TRUNCATED_REASONS else None}
        if isinstance(elapsed, int | float) and is_number(elapsed):
            self.trailer["elapsed_ms"] = elapsed

    def finish(self) -> QueryReply:
        """The answer, shaped as the JSON one; fails when the stream was incomplete."""
        last = b"".join(self._pending).strip()
        self._pending = []
        if last and not self.cut:
            self._line(last)  # a last line without its newline
        if self.columns is None:
            raise _bad_stream("no header (the answer is empty)")
        if self.cut:
            return self._answer(True, "rows", None)
        if self.trailer is None:
            raise BadReply(f"the answer broke off after {len(self.rows)} rows "
                           f"({self.got} bytes), without its trailer",
                           "did the agent restart or crash? see its log", kind="disconnected")
        t = self.trailer
        return self._answer(t["truncated"], t["truncated_reason"], t.get("elapsed_ms"))

    def _answer(self, truncated: bool, reason: object, elapsed_ms: float | None
                ) -> QueryReply:
        assert self.columns is not None
        kept = reason if truncated and reason in TRUNCATED_REASONS else None
        return {"node": self.node, "columns": self.columns, "rows": self.rows,
                "truncated": truncated, "truncated_reason": kept,
                "elapsed_ms": elapsed_ms}
