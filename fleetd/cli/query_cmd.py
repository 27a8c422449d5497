"""``fleetd query``: read-only SQL over a node database (and, later, a whole fleet)."""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.cli.output import FORMATS, check_format, write_rows
from fleetd.errors import UsageError
from fleetd.store.catalog import BY_NAME
from fleetd.store.db import default_db_path
from fleetd.store.guard import Limits, QueryResult, SafeDB
from fleetd.store.timeparse import format_ns, parse_duration, parse_timestamp

SHORTCUT_COLUMNS = "id, node, ts_ns, dur_ns, pid, tid, comm, op, ret, bytes"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "query",
        help="run read-only SQL over a node database",
        description="Run one read-only SQL statement over a fleetd database, or use the "
        "--op/--since shortcuts. Main view: events (node, ts_ns, dur_ns, pid, tid, comm, "
        "source, op, ret, bytes, ...).",
    )
    p.add_argument("sql", nargs="?", help="one SELECT statement (omit to use the shortcuts)")
    p.add_argument(
        "--db", type=Path, help="database file (default: $FLEETD_DB, else a per-user path)"
    )
    p.add_argument("--param", action="append", default=[], metavar="VALUE",
                   help="bind a value to the next ? in the SQL (repeatable)")
    p.add_argument("--op", help="shortcut: events of this op, e.g. cudaLaunchKernel")
    p.add_argument("--pid", type=int, help="shortcut: events of this process")
    p.add_argument("--since", help="shortcut: events of the last 30s, 5m, 2h, 1d")
    p.add_argument("--from", dest="from_", metavar="TIME", help="shortcut: events from TIME")
    p.add_argument("--to", metavar="TIME", help="shortcut: events up to TIME")
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    p.add_argument("--limit", type=int, help="at most this many rows (default 10000)")
    p.add_argument("--timeout", default="5s", help="time limit for the query, e.g. 5s (default)")
    p.set_defaults(func=run)


def _timeout_s(text: str) -> float:
    try:
        return float(text)  # a bare number means seconds
    except ValueError:
        return parse_duration(text) / 1e9


def _shortcut(args: argparse.Namespace) -> tuple[str, list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if args.op:
        if args.op not in BY_NAME:
            close = difflib.get_close_matches(args.op, BY_NAME, n=3)
            raise UsageError(
                f"unknown op {args.op!r}",
                f"did you mean {', '.join(close)}?" if close
                else "list ops with: fleetd query \"SELECT name, source FROM ops\"",
            )
        where.append("op = ?")
        params.append(args.op)
    if args.pid is not None:
        where.append("pid = ?")
        params.append(args.pid)
    if args.since:
        where.append("ts_ns >= ?")
        params.append(time.time_ns() - parse_duration(args.since))
    if args.from_:
        where.append("ts_ns >= ?")
        params.append(parse_timestamp(args.from_))
    if args.to:
        where.append("ts_ns <= ?")
        params.append(parse_timestamp(args.to))
    sql = f"SELECT {SHORTCUT_COLUMNS} FROM events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + " ORDER BY ts_ns", params


def build_sql(args: argparse.Namespace) -> tuple[str, list[Any]]:
    uses_shortcut = any(x is not None for x in (args.op, args.pid, args.since, args.from_, args.to))
    if args.sql and uses_shortcut:
        raise UsageError(
            "give either SQL or the --op/--pid/--since/--from/--to shortcuts, not both",
            "put the condition in your SQL's WHERE clause",
        )
    if args.sql:
        return args.sql, list(args.param)
    if not uses_shortcut:
        raise UsageError(
            "nothing to query",
            "pass SQL, e.g. fleetd query \"SELECT op, count(*) FROM events GROUP BY op\", "
            "or a shortcut such as --op cudaLaunchKernel --since 5m",
        )
    return _shortcut(args)


def run(args: argparse.Namespace) -> int:
    fmt = check_format(args.format)
    sql, params = build_sql(args)
    limits = Limits().lowered(timeout_s=_timeout_s(args.timeout), max_rows=args.limit)
    path: Path = args.db or default_db_path()
    with SafeDB(path) as db:
        result = db.query(sql, params, limits)
        hint = _empty_hint(db, args) if not result.rows and args.since else None
    _print(result, fmt, hint)
    return 0


def _print(result: QueryResult, fmt: str, hint: str | None) -> None:
    warnings = list(result.warnings)
    if result.truncated:
        warnings.append(
            f"result truncated at {len(result.rows)} rows (limit on {result.truncated_reason}); "
            "narrow the query or raise --limit"
        )
    if hint:
        warnings.append(hint)
    extra = {"truncated": result.truncated, "warnings": warnings, "skew": {}}
    write_rows(result.columns, result.rows, fmt, sys.stdout, extra)
    if fmt != "json":
        for w in warnings:
            print(f"fleetd: warning: {w}", file=sys.stderr)


def _empty_hint(db: SafeDB, args: argparse.Namespace) -> str | None:
    """--since counts back from now; a recorded file may simply be older than that."""
    latest = db.conn.execute("SELECT max(ts_ns) FROM event_data").fetchone()[0]
    if latest is None:
        return "the database holds no events yet"
    age_s = (time.time_ns() - latest) / 1e9
    if age_s * 1e9 > parse_duration(args.since):
        return (
            f"no events in the last {args.since}: the newest event is from {format_ns(latest)} "
            f"({age_s / 3600:.1f} h ago); use a longer --since or --from"
        )
    return None
