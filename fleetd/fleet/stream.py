"""Reading a node's query answer as NDJSON (docs/api.md), line by line as it arrives.

The client asks ``POST /api/v1/query`` with ``Accept: application/x-ndjson``; an agent
that streams answers with a header object, one JSON array per row and a trailer object.
Read here incrementally, the answer never exists twice in memory (the raw body and its
objects), and each line is checked as it comes, under the same bounds as a JSON answer:
the byte cap per answer (counted as the bytes arrive, a line without its newline
included), a row cap, and values SQLite can hold. The time bound is the request's own
(aiohttp's total timeout covers the whole body). The result has the shape of the JSON
answer, so everything above the client is unchanged.

A node's stream is untrusted: no header, a row that is not an array of the header's
width, a value beyond 64 bits, a line after the trailer, or a body that ends without a
trailer (cut off, or a hostile node) each fail that node with a named reason
(:class:`fleetd.fleet.client.NodeFailed`), never an exception of another kind.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import orjson

# A module, not names: client.py imports this module, and this one needs client's
# classes only when a stream is read.
from fleetd.fleet import client as fc

NDJSON = "application/x-ndjson"
QUERY_PATH = "/api/v1/query"
# Rows one answer may hold, whatever limit the node's header claims: a row of one small
# value is about 100 bytes as Python objects, so this bounds the rows' memory to the
# order of the byte cap's.
MAX_ROWS = 1_000_000
NAME_CHARS = 1000  # a column name, as printed
MAX_COLUMNS = 256  # as the agent's guard allows


def is_ndjson(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == NDJSON


def _bad(what: str) -> fc.NodeFailed:
    return fc.NodeFailed(fc.Failure("bad_json", f"streamed answer: {what}",
                                    "is this a fleetd agent, and an unmodified one?"))


def _cell_ok(v: Any) -> bool:
    if v is None or isinstance(v, str | bool):
        return True
    if isinstance(v, int):
        return fc.INT64_MIN <= v <= fc.INT64_MAX
    return isinstance(v, float) and math.isfinite(v)


class QueryStream:
    """Feed it the body's pieces (:meth:`feed`), then :meth:`finish` for the answer."""

    def __init__(self, cap: int, max_rows: int = MAX_ROWS) -> None:
        self.cap = cap
        self.max_rows = max_rows
        self.got = 0  # bytes received
        self.header: dict[str, Any] | None = None
        self.width = 0
        self.rows: list[list[Any]] = []
        self.trailer: dict[str, Any] | None = None
        self.cut = False  # more rows than we keep: the rest is not read
        self._pending: list[bytes] = []  # the last line so far, not yet ended

    def feed(self, piece: bytes) -> bool:
        """Take one piece of the body; False once nothing more need be read."""
        self.got += len(piece)
        if self.got > self.cap:
            raise fc.NodeFailed(fc.Failure(
                "too_large", f"answer of {self.got}+ bytes is over the client's {self.cap} "
                "byte limit for one answer", "lower --limit or narrow the query"))
        if b"\n" not in piece:
            # Part of a long line: kept as pieces, joined once its newline comes (joining
            # at every piece would copy a 30 MB line hundreds of times).
            self._pending.append(piece)
            return True
        self._pending.append(piece)
        lines = b"".join(self._pending).split(b"\n")
        self._pending = [lines.pop()]
        return all(self._line(line) for line in lines if line)

    def _line(self, line: bytes) -> bool:
        if self.trailer is not None:
            raise _bad("a line after the trailer")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            shown = fc.printable(line[:60].decode("utf-8", "replace"))
            raise _bad(f"a line that is not JSON: {shown!r}") from None
        if self.header is None:
            self._take_header(obj)
        elif isinstance(obj, list):
            self._take_row(obj)
        elif isinstance(obj, dict):
            self._take_trailer(obj)
        else:
            raise _bad(f"a line that is a JSON {type(obj).__name__}")
        return not self.cut

    def _take_header(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            raise _bad("no header object first")
        cols = obj.get("columns")
        if (not isinstance(cols, list) or len(cols) > MAX_COLUMNS
                or not all(isinstance(c, str) for c in cols)):
            raise _bad("a header whose columns are not a list of names")
        limits = obj.get("limits")
        claimed = fc.valid_int(limits.get("max_rows"), 1) if isinstance(limits, dict) else None
        if claimed is not None:
            self.max_rows = min(self.max_rows, claimed)  # may lower ours, never raise it
        obj["columns"] = [fc.printable(c, NAME_CHARS) for c in cols]
        self.header, self.width = obj, len(cols)

    def _take_row(self, row: list[Any]) -> None:
        if len(row) != self.width:
            raise _bad(f"a row that is not a list of {self.width} values")
        for cell in row:
            if not _cell_ok(cell):
                raise _bad(f"a value SQLite cannot hold ({fc.printable(cell, 40)})")
        if len(self.rows) >= self.max_rows:
            self.cut = True  # a node past the limit: keep what the limit allows
            return
        self.rows.append(row)

    def _take_trailer(self, obj: dict[str, Any]) -> None:
        err = obj.get("error")
        if err is not None:
            if not isinstance(err, dict):
                err = {}
            code = fc.printable(err.get("code") or "", 40)
            message = fc.printable(err.get("message") or "no error message", 500)
            hint = fc.printable(err["hint"], 500) if err.get("hint") else None
            raise fc.NodeFailed(fc.Failure(
                "http", f"failed after {len(self.rows)} rows{f' ({code})' if code else ''}: "
                f"{message}", hint, code=code or None))
        n = obj.get("rows")
        if obj.get("end") is not True or fc.valid_int(n, 0) is None:
            raise _bad("a trailer without end and a row count")
        if n != len(self.rows):
            raise _bad(f"a trailer that counts {fc.printable(n, 30)} rows, "
                       f"after {len(self.rows)}")
        self.trailer = obj

    def finish(self) -> dict[str, Any]:
        """The answer, shaped as the JSON one; fails when the stream was incomplete."""
        last = b"".join(self._pending).strip()
        self._pending = []
        if last and not self.cut:
            self._line(last)  # a last line without its newline
        if self.header is None:
            raise _bad("no header (the answer is empty)")
        if self.cut:
            return self._answer(True, "rows", None)
        if self.trailer is None:
            raise fc.NodeFailed(fc.Failure(
                "disconnected", f"the answer broke off after {len(self.rows)} rows "
                f"({self.got} bytes), without its trailer",
                "did the agent restart or crash? see its log"))
        t = self.trailer
        reason = t.get("truncated_reason")
        reason = reason if reason in ("rows", "bytes") else None
        elapsed = t.get("elapsed_ms")
        ok = isinstance(elapsed, int | float) and not isinstance(elapsed, bool) \
            and math.isfinite(elapsed)
        return self._answer(t.get("truncated") is True, reason, elapsed if ok else None)

    def _answer(self, truncated: bool, reason: str | None,
                elapsed_ms: float | None) -> dict[str, Any]:
        assert self.header is not None
        node = self.header.get("node")
        return {"node": node if isinstance(node, str) else None,
                "columns": self.header["columns"], "rows": self.rows,
                "truncated": truncated, "truncated_reason": reason if truncated else None,
                "elapsed_ms": elapsed_ms}


async def read_answer(resp: aiohttp.ClientResponse, cap: int) -> dict[str, Any]:
    """Read a streamed query answer under ``cap`` bytes; see :class:`QueryStream`.
    A node that sends more rows than the limit is cut (its answer marked truncated)
    and the rest of its stream left unread."""
    reader = QueryStream(cap)
    async for piece in resp.content.iter_any():
        if not reader.feed(piece):
            resp.close()  # stop reading; the connection is not reused
            break
    return reader.finish()
