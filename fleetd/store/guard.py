"""Safe SQL for untrusted queries: the local CLI, the node API and the MCP server share it.

Layers, each of which alone would stop a write, so that one mistake is not enough:
1. the file is opened read-only (``mode=ro``) with ``PRAGMA query_only``;
2. an authorizer admits only reads, read-only pragmas and harmless functions;
3. SQLite's own limits cap string/blob sizes (``randomblob(1e9)`` fails early),
   SQL length and attached databases (none);
4. a progress handler stops any statement past its deadline (runaway recursive CTEs,
   cartesian products);
5. rows and bytes returned are capped, with a ``truncated`` flag instead of an error.
   The byte cap counts bytes as they will go on the wire (a blob as hex, a string with
   JSON escapes) and is checked row by row as SQLite produces them, and SQLite's own
   length limit is lowered to it per query, so no single value can outgrow it in
   memory first: one query holds at most about its byte limit, whatever it selects.

:meth:`SafeDB.in_memory` puts the same guard over a scratch database that fleetd fills
itself (``fleetd query --nodes ... --reduce`` runs over the merged rows that way), so
there is one sandbox for untrusted SQL, not one per caller.

Python's sqlite3 refuses more than one statement per ``execute``; parameters are
always bound, never formatted into the SQL.
"""

from __future__ import annotations

import contextlib
import math
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self, TypeVar

import orjson

from fleetd.errors import QueryError, UsageError, integer
from fleetd.store.db import connect, damage_error, open_reader

Params = Sequence[Any] | Mapping[str, Any]
T = TypeVar("T")

# Introspection pragmas whose argument names what to describe: read-only with any argument.
NAMED_PRAGMAS = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list",
})
# Pragmas that read a setting without a value, but would change it with one.
READ_PRAGMAS = frozenset({
    "database_list", "function_list", "pragma_list", "collation_list", "compile_options",
    "user_version", "application_id", "schema_version", "page_count", "page_size",
    "freelist_count", "encoding", "journal_mode",
})
# Functions that reach outside the database or change SQLite's state.
DENIED_FUNCTIONS = frozenset({
    "load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "zipfile",
    "sqlite_dbpage",
})
_PRIMABLE = NAMED_PRAGMAS | READ_PRAGMAS
_PRAGMA_FUNCTION = re.compile(r"pragma_(\w+)", re.IGNORECASE)
_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_PROGRESS_EVERY = 2_000  # VM instructions between deadline checks: ~tens of microseconds
_MAX_COLUMNS = 256  # result columns: bounds one row to this many values under the limit
_INT64 = (-(2**63), 2**63 - 1)
# JSON spells these characters with a backslash: two bytes, or six for \u00XX.
_SHORT_ESCAPES = '"\\\n\r\t\b\f'
_LONG_ESCAPES = tuple(chr(c) for c in range(0x20) if chr(c) not in _SHORT_ESCAPES)


@dataclass(frozen=True, slots=True)
class Limits:
    """Ceilings for one query. A request may lower any of them, never raise one."""

    timeout_s: float = 5.0
    max_rows: int = 10_000
    max_bytes: int = 16 * 1024 * 1024
    max_sql_chars: int = 64 * 1024
    max_value_bytes: int = 4 * 1024 * 1024  # SQLite's own cap on any one string or blob

    def lowered(
        self,
        *,
        timeout_s: object = None,
        max_rows: object = None,
        max_bytes: object = None,
    ) -> Limits:
        """These limits, lowered by a request's wishes; a wish above a ceiling is ignored.
        Each wish is checked here: it may come straight from a client's JSON."""
        out = self
        if timeout_s is not None:
            out = replace(out, timeout_s=min(out.timeout_s, _positive("timeout", timeout_s)))
        if max_rows is not None:
            rows = integer(max_rows, "max_rows", 1)  # 1e23 is not a row count
            out = replace(out, max_rows=min(out.max_rows, rows))
        if max_bytes is not None:
            size = integer(max_bytes, "max_bytes", 1)
            out = replace(out, max_bytes=min(out.max_bytes, size))
        return out


    @classmethod
    def local(cls, *, timeout_s: float | None, max_rows: int | None) -> Limits:
        """Limits for the user's own file, read on their own machine: the ceilings above
        protect an agent from its network clients, not a user from their data. None or 0
        means no limit; the SQLite length caps stay (they stop runaway values, not reads).
        """
        for what, value in (("timeout", timeout_s), ("row limit", max_rows)):
            if value is not None and value != 0:
                _positive(what, value)
        return cls(timeout_s=float(timeout_s) if timeout_s else math.inf,
                   max_rows=int(max_rows) if max_rows else sys.maxsize,
                   max_bytes=sys.maxsize)


def _positive(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise UsageError(f"{what} must be a positive number, got {value!r}")
    return float(value)


@dataclass(slots=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    truncated: bool = False
    truncated_reason: str | None = None  # "rows" | "bytes"
    elapsed_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


class _Authorizer:
    """Admits reads only, and remembers why it denied, for the error message."""

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(
        self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None
    ) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if arg2 and arg2.lower() in DENIED_FUNCTIONS:
                return self._deny(f"function {arg2}()")
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in NAMED_PRAGMAS or (name in READ_PRAGMAS and arg2 is None):
                return sqlite3.SQLITE_OK
            shown = f"PRAGMA {arg1}" + (f" = {arg2}" if arg2 is not None else "")
            return self._deny(shown)
        what = _ACTION_NAMES.get(action, f"action {action}")
        if action in _TABLE_ACTIONS and arg1:
            what += f" on {arg1}" if not arg1.startswith("sqlite_") else " (a schema change)"
        return self._deny(what)

    def _deny(self, what: str) -> int:
        if self.denied is None:
            self.denied = what
        return sqlite3.SQLITE_DENY


# Authorizer action codes only: the sqlite3 module also exports result codes (TOOBIG,
# INTERRUPT...) whose numbers overlap these, so the names are listed, not discovered.
_ACTION_NAMES = {
    getattr(sqlite3, f"SQLITE_{n}"): n.replace("_", " ")
    for n in (
        "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE",
        "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "DELETE",
        "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER",
        "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "INSERT", "TRANSACTION", "UPDATE",
        "ATTACH", "DETACH", "ALTER_TABLE", "REINDEX", "ANALYZE", "CREATE_VTABLE",
        "DROP_VTABLE", "SAVEPOINT",
    )
}


_TABLE_ACTIONS = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE})


STREAM_CHUNK_BYTES = 64 * 1024  # row lines handed on at once by SafeDB.stream
_NEWLINE = orjson.OPT_APPEND_NEWLINE


@dataclass(slots=True)
class StreamEnd:
    """How a :meth:`SafeDB.stream` ended: rows sent, whether and why it was cut."""

    rows: int = 0
    truncated: bool = False
    truncated_reason: str | None = None  # "rows" | "bytes"
    elapsed_ms: float = 0.0


class _Run:
    """One guarded statement: its deadline, checked by SQLite's progress handler."""

    __slots__ = ("conn", "sql", "params", "deadline", "timed_out")

    def __init__(self, conn: sqlite3.Connection, sql: str, params: Params,
                 deadline: float) -> None:
        self.conn, self.sql, self.params = conn, sql, params
        self.deadline = deadline
        self.timed_out = False

    def progress(self) -> int:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return 1
        return 0

    def execute(self) -> sqlite3.Cursor:
        return self.conn.execute(self.sql, self.params)


class QueryDB:
    """What the two databases for untrusted SQL share, :class:`SafeDB` (SQLite) and
    :class:`fleetd.store.lakesql.LakeDB` (DuckDB): a ``with`` block closes them."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafeDB(QueryDB):
    """A read-only view of one database for untrusted SQL. Use from one thread at a time."""

    def __init__(self, path: Path, limits: Limits | None = None, *,
                 conn: sqlite3.Connection | None = None) -> None:
        """Guard the database at ``path``, or ``conn`` when given (already query-only)."""
        self.path = path
        self.limits = limits or Limits()
        self.conn = conn if conn is not None else open_reader(path)
        self._auth = _Authorizer()
        self._primed: set[str] = set()
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.limits.max_value_bytes)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, self.limits.max_sql_chars)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, _MAX_COLUMNS)
        self.conn.set_authorizer(self._auth)

    @classmethod
    def in_memory(cls, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                  limits: Limits | None = None) -> SafeDB:
        """A guarded scratch database holding one table of fleetd's own rows.

        fleetd creates ``table`` (untyped columns, values kept as given; ``columns`` must
        be unique) and fills it before the guard goes up; after that the connection is
        query-only, and untrusted SQL over it runs under the same authorizer, deadline
        and row/byte limits as over a file.
        """
        conn = connect(":memory:")
        try:
            _load_table(conn, table, columns, rows)
            conn.execute("PRAGMA query_only=1")
        except BaseException:
            conn.close()
            raise
        return cls(Path(":memory:"), limits, conn=conn)

    def close(self) -> None:
        self.conn.close()

    def query(self, sql: str, params: Params = (), limits: Limits | None = None) -> QueryResult:
        """Run one untrusted read-only statement under ``limits`` (default: the ceilings)."""
        lim = limits or self.limits
        started = time.perf_counter()
        with self._guarded(sql, params, lim) as run:
            result = _collect(run.execute(), lim)
        result.elapsed_ms = (time.perf_counter() - started) * 1000
        return result

    def stream(self, sql: str, params: Params = (), limits: Limits | None = None,
               chunk_bytes: int = STREAM_CHUNK_BYTES
               ) -> Generator[list[str] | bytes, None, StreamEnd]:
        """:meth:`query` as NDJSON, for answers too large to build whole: yields the
        column names first, then chunks of row lines (each ``row_json`` and a newline,
        a chunk about ``chunk_bytes``), and returns how it ended. Rows are fetched one
        at a time and a chunk is handed on before the next is begun, so what it holds
        is one chunk, whatever the query selects; the row and byte limits cut it as
        they cut :meth:`query`. A caller that stops early closes the generator, and
        the statement with it. Errors are :class:`QueryError`, before or after the
        columns."""
        lim = limits or self.limits
        started = time.perf_counter()
        with self._guarded(sql, params, lim) as run:
            cur = run.execute()
            columns = _columns(cur)
            yield columns
            end = StreamEnd()
            size = sum(wire_bytes(c) for c in columns)
            # Locals, not attributes, in the per-row loop: it runs once per row sent.
            fetch, dumps, max_rows, max_bytes = cur.fetchone, orjson.dumps, lim.max_rows, \
                lim.max_bytes
            chunk = bytearray()  # row lines, each with its newline
            n = 0
            try:
                while True:
                    try:
                        row = fetch()
                    except sqlite3.Error:
                        if chunk:  # the rows before a time limit or an error still go
                            yield bytes(chunk)
                            chunk = bytearray()
                        raise
                    if row is None:
                        break
                    if n >= max_rows:
                        end.truncated, end.truncated_reason = True, "rows"
                        break
                    line = dumps(row, default=_hex, option=_NEWLINE)
                    size += len(line)
                    if size > max_bytes:
                        end.truncated, end.truncated_reason = True, "bytes"
                        break
                    chunk += line
                    n += 1
                    if len(chunk) >= chunk_bytes:
                        yield bytes(chunk)
                        chunk = bytearray()
            finally:
                end.rows = n
                cur.close()
            if chunk:
                yield bytes(chunk)
        end.elapsed_ms = (time.perf_counter() - started) * 1000
        return end

    @contextlib.contextmanager
    def _guarded(self, sql: str, params: Params, lim: Limits) -> Iterator[_Run]:
        """The deadline and the value cap around one untrusted statement; SQLite's
        errors inside become :class:`QueryError` that say what to do."""
        _check_sql_text(sql, lim)
        _check_params(params)
        self._prime_pragmas(sql)
        self._auth.denied = None
        run = _Run(self.conn, sql, params, time.monotonic() + lim.timeout_s)
        self.conn.set_progress_handler(run.progress, _PROGRESS_EVERY)
        # No value may be longer than the whole answer may be: SQLite refuses to build
        # it, so a zeroblob(4e6) under a 1 MB limit never exists in memory.
        value_cap = max(1, min(lim.max_value_bytes, lim.max_bytes))
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, value_cap)
        try:
            yield run
        except sqlite3.Error as exc:
            raise self._explain(exc, sql, lim, run.timed_out) from exc
        finally:
            self.conn.set_progress_handler(None, 0)
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.limits.max_value_bytes)

    def _prime_pragmas(self, sql: str) -> None:
        """Let read-only pragma functions (``pragma_table_info('events')``) work as the
        PRAGMA statements do. SQLite builds a pragma function's table on its first use
        on a connection and authorizes that as an UPDATE of sqlite_master, which the
        authorizer refuses; so the allowed ones the SQL names are built here first, the
        authorizer off for that one empty SELECT. The authorizer then judges each call
        as it judges the PRAGMA (``pragma_journal_mode('wal')`` stays refused)."""
        names = {m.lower() for m in _PRAGMA_FUNCTION.findall(sql)} & _PRIMABLE
        new = names - self._primed
        if not new:
            return
        self.conn.set_authorizer(None)
        try:
            for name in sorted(new):
                self.conn.execute(f"SELECT * FROM pragma_{name} LIMIT 0").fetchall()
        finally:
            self.conn.set_authorizer(self._auth)
        self._primed |= new

    def analyze(self, fn: Callable[[sqlite3.Connection], T], timeout_s: float) -> T:
        """Run the project's own read-only analysis under a deadline, on this connection.

        The authorizer stays in place, so even analysis code cannot write.
        """
        deadline = time.monotonic() + timeout_s
        self.conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_EVERY)
        try:
            return fn(self.conn)
        except sqlite3.DatabaseError as exc:
            if "interrupted" in str(exc):
                raise QueryError(
                    f"analysis stopped after its {timeout_s:g} s time limit",
                    "narrow the window (since/from/to) or analyze a copy offline",
                    code="timeout",
                ) from None
            damaged = self._damaged(exc)
            if damaged is not None:
                raise damaged from None
            raise
        finally:
            self.conn.set_progress_handler(None, 0)

    def _damaged(self, exc: BaseException) -> QueryError | None:
        """A damaged page met by a statement: the query's answer is an error that says
        so (503: the node cannot answer from this file), never a crash of the server."""
        err = damage_error(exc, self.path)
        if err is None:
            return None
        return QueryError(err.message, err.hint, code="unavailable")

    def _explain(self, exc: sqlite3.Error, sql: str, lim: Limits, timed_out: bool) -> QueryError:
        text = str(exc)
        damaged = self._damaged(exc)
        if damaged is not None:
            return damaged
        if timed_out or "interrupted" in text:
            return QueryError(
                f"query stopped after its {lim.timeout_s:g} s time limit",
                "narrow it with WHERE ts_ns > ... or LIMIT, or raise --timeout (up to the "
                "server's ceiling)",
                code="timeout",
            )
        if self._auth.denied or "not authorized" in text:
            return QueryError(
                f"refused: {self._auth.denied or 'statement'} is not allowed; only read-only "
                "SELECT queries are accepted",
                "use SELECT (WITH ... SELECT, read-only PRAGMAs such as table_info are fine)",
                code="forbidden",
            )
        if "one statement at a time" in text:
            return QueryError(
                "refused: more than one statement in the query",
                "send one SELECT per request, without a second statement after ';'",
                code="forbidden",
            )
        if "too big" in text:
            return QueryError(
                f"refused: a value would exceed "
                f"{min(lim.max_value_bytes, lim.max_bytes)} bytes ({text})",
                "select smaller values (substr(), length()) instead of huge blobs or strings",
                code="too_large",
            )
        if "readonly" in text or "read-only" in text or "cannot modify" in text:
            return QueryError(f"refused: the database is read-only here ({text})",
                              "only SELECT queries are accepted", code="forbidden")
        return QueryError(f"SQL error: {text}", _sql_hint(text), code="bad_query")


def _load_table(conn: sqlite3.Connection, table: str, columns: Sequence[str],
                rows: Iterable[Sequence[Any]]) -> None:
    names = ", ".join(_quote(c) for c in columns)
    conn.execute(f"CREATE TABLE {_quote(table)} ({names})")
    marks = ", ".join("?" for _ in columns)
    conn.executemany(f"INSERT INTO {_quote(table)} VALUES ({marks})", rows)
    conn.commit()


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _check_sql_text(sql: str, lim: Limits) -> None:
    if not isinstance(sql, str) or not sql.strip():
        raise QueryError("empty query", "pass one SELECT statement", code="bad_query")
    if len(sql) > lim.max_sql_chars:
        raise QueryError(
            f"query is {len(sql)} characters, over the limit of {lim.max_sql_chars}",
            "shorten it; pass values as parameters", code="too_large",
        )
    if "\x00" in sql:
        raise QueryError("query contains a NUL character", "remove it", code="bad_query")


def _sql_hint(text: str) -> str:
    if "no such table" in text:
        return "list tables with: SELECT name, type FROM sqlite_master; events is the main view"
    if "no such column" in text:
        return "list columns with: PRAGMA table_info(events)"
    if "syntax error" in text or "incomplete input" in text:
        return "check the SQL near the quoted token; quote strings with single quotes"
    return "check the query"


def _check_params(params: Params) -> None:
    """Parameters a peer sent: SQLite binds 64-bit integers only, so a larger one is
    the request's mistake, told as such rather than an OverflowError."""
    values = params.values() if isinstance(params, Mapping) else params
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v <= _INT64[1]:
            raise QueryError(f"parameter {v} does not fit in a 64-bit integer",
                             "SQLite integers range over -2**63 .. 2**63-1",
                             code="bad_request")


def _collect(cur: sqlite3.Cursor, lim: Limits) -> QueryResult:
    columns = _columns(cur)
    rows: list[tuple[Any, ...]] = []
    size = sum(wire_bytes(c) for c in columns)
    fetch, dumps, max_rows, max_bytes = cur.fetchone, orjson.dumps, lim.max_rows, lim.max_bytes
    # One row at a time: a batch of rows fetched before the check is what let one
    # query hold hundreds of megabytes.
    row = fetch()
    while row is not None:
        if len(rows) >= max_rows:
            cur.close()
            return QueryResult(columns, rows, True, "rows")
        size += len(dumps(row, default=_hex)) + 1  # as row_json(row), and its comma
        if size > max_bytes:
            cur.close()
            return QueryResult(columns, rows, True, "bytes")
        rows.append(row)
        row = fetch()
    return QueryResult(columns, rows)


def _columns(cur: sqlite3.Cursor) -> list[str]:
    if cur.description is None:
        # Only comments, or a statement that returns nothing: not a query.
        raise QueryError("the query holds no SELECT statement",
                         "pass one SELECT statement", code="bad_query")
    return [d[0] for d in cur.description]


def _hex(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(f"cannot encode {type(value).__name__}")


def row_json(row: Sequence[Any]) -> bytes:
    """One row as it goes on the wire: a JSON array, blobs as hex. Its length is what
    the byte limit counts (exactly, and about 10x cheaper than summing per value)."""
    return orjson.dumps(row, default=_hex)


def wire_bytes(value: Any) -> int:
    """Bytes ``value`` takes in the JSON answer: a blob as quoted hex, a string UTF-8
    with JSON's escapes, a number or null at most 24 characters."""
    if isinstance(value, bytes | bytearray | memoryview):
        return 2 * len(value) + 2
    if isinstance(value, str):
        n = len(value) + 2 if value.isascii() else len(value.encode("utf-8", "replace")) + 2
        if value.isprintable() and '"' not in value and "\\" not in value:
            return n  # the common case: nothing to escape
        n += sum(value.count(c) for c in _SHORT_ESCAPES)
        return n + 5 * sum(value.count(c) for c in _LONG_ESCAPES)
    return 24
