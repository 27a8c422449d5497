"""``fleetd query``: read-only SQL over a node database, or over every node of a fleet.

With ``--nodes``/``--config`` the statement runs on every agent in parallel; rows come
back merged with a leading ``node`` column, node timestamps (``*ts_ns`` columns)
corrected into this machine's clock, and ``--reduce`` runs a second statement over the
merged rows (table ``merged``) so that fleet-wide aggregates are computed correctly.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report, seconds
from fleetd.cli.output import FORMATS, check_format, warn, write_rows
from fleetd.errors import UsageError
from fleetd.store.bounds import Bounds
from fleetd.store.catalog import BY_NAME
from fleetd.store.db import default_db_path
from fleetd.store.guard import Limits, QueryResult, SafeDB
from fleetd.store.timeparse import format_ns, parse_duration

SHORTCUT_COLUMNS = "id, node, ts_ns, dur_ns, pid, tid, comm, op, ret, bytes"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "query",
        help="run read-only SQL over a node database, or every node of a fleet",
        description="Run one read-only SQL statement over a fleetd database, or use the "
        "--op/--since shortcuts. Main view: events (node, ts_ns, dur_ns, pid, tid, comm, "
        "source, op, ret, bytes, ...). With --nodes/--config, on every agent at once: rows "
        "merged with a leading node column, timestamps corrected for clock skew.",
    )
    p.add_argument("sql", nargs="?", help="one SELECT statement (omit to use the shortcuts)")
    p.add_argument(
        "--db", type=Path, help="database file (default: $FLEETD_DB, else a per-user path)"
    )
    p.add_argument("--lake", type=Path, metavar="DIR",
                   help="run on DuckDB over a Parquet lake (fleetd export --format parquet, "
                   "fleetd agent --parquet-dir) instead of a database: the same views and "
                   "columns; --since/--from/--to also prune its date partitions when SQL is "
                   "given (docs/scale-out.md)")
    p.add_argument("--param", action="append", default=[], metavar="VALUE",
                   help="bind a value to the next ? in the SQL (repeatable)")
    p.add_argument("--op", help="shortcut: events of this op, e.g. cudaLaunchKernel")
    p.add_argument("--pid", type=int, help="shortcut: events of this process")
    p.add_argument("--since", help="shortcut: events of the last 30s, 5m, 2h, 1d")
    p.add_argument("--from", dest="from_", metavar="TIME", help="shortcut: events from TIME")
    p.add_argument("--to", metavar="TIME", help="shortcut: events up to TIME")
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    p.add_argument("--limit", type=int,
                   help="at most this many rows; on a local file none by default (0: no "
                   "limit); per node in a fleet query, where the agent caps it (10000)")
    p.add_argument("--timeout", metavar="DURATION",
                   help="time limit: on a local file, for the query (default none; 0: "
                   "none); for a fleet query, for the whole fan-out (default: the config's, "
                   "else 10s; the agent stops a query at its own ceiling, 5s)")
    p.add_argument("--reduce", metavar="SQL",
                   help="fleet: run this SELECT over the merged rows (table merged, with a "
                   "node column), e.g. \"SELECT op, sum(n) FROM merged GROUP BY op\"")
    add_fleet_args(p, timeout=False)
    p.set_defaults(func=run)


def _timeout_s(text: str) -> float:
    return seconds(text, "--timeout")  # a bare number means seconds


def _local_timeout(text: str | None) -> float | None:
    """A local file has no time limit unless asked for one; ``--timeout 0`` is none too."""
    if text is None or text.strip() in ("0", "0s"):
        return None
    return _timeout_s(text)


def _local_rows(limit: int | None) -> int | None:
    if limit is not None and limit < 0:
        raise UsageError(f"--limit {limit} must not be negative",
                         "give a number of rows, or 0 for no limit")
    return limit or None


def _shortcut(args: argparse.Namespace, bounds: Bounds | None
              ) -> tuple[str, list[Any], set[int]]:
    """SQL for the shortcuts; also the indexes of the params that are wall-clock times
    of this machine (a fleet query moves them into each node's clock)."""
    where: list[str] = []
    params: list[Any] = []
    times: set[int] = set()
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
    from fleetd.cli.window_args import window_of

    # The window as every command parses it (one set of errors), unless parsed already.
    first, last = (window_of(args) if bounds is None else bounds).inclusive()
    for cond, value in (("ts_ns >= ?", first), ("ts_ns <= ?", last)):
        if value is not None:
            where.append(cond)
            times.add(len(params))
            params.append(value)
    sql = f"SELECT {SHORTCUT_COLUMNS} FROM events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + " ORDER BY ts_ns", params, times


def build_sql(args: argparse.Namespace, bounds: Bounds | None = None
              ) -> tuple[str, list[Any]]:
    sql, params, _ = build_sql_times(args, bounds)
    return sql, params


def build_sql_times(args: argparse.Namespace, bounds: Bounds | None = None
                    ) -> tuple[str, list[Any], set[int]]:
    uses_shortcut = any(x is not None for x in (args.op, args.pid, args.since, args.from_, args.to))
    if args.sql and uses_shortcut:
        raise UsageError(
            "give either SQL or the --op/--pid/--since/--from/--to shortcuts, not both",
            "put the condition in your SQL's WHERE clause",
        )
    if args.sql:
        return args.sql, list(args.param), set()
    if not uses_shortcut:
        raise UsageError(
            "nothing to query",
            "pass SQL, e.g. fleetd query \"SELECT op, count(*) FROM events GROUP BY op\", "
            "or a shortcut such as --op cudaLaunchKernel --since 5m",
        )
    return _shortcut(args, bounds)


def run(args: argparse.Namespace) -> int:
    fmt = check_format(args.format)
    if args.lake is not None:
        return run_lake(args, fmt)
    if fleet_mode(args):
        return run_fleet(args, fmt)
    if args.reduce:
        raise UsageError("--reduce runs over the merged rows of a fleet query",
                         "add --nodes HOST:PORT,... (or --config), or put it in your SQL")
    sql, params = build_sql(args)
    limits = Limits.local(timeout_s=_local_timeout(args.timeout), max_rows=_local_rows(args.limit))
    path: Path = args.db or default_db_path()
    with SafeDB(path) as db:
        result = db.query(sql, params, limits)
        hint = _empty_hint(db, args) if not result.rows and args.since else None
    _print(result, fmt, hint, args.limit)
    return 0


def run_lake(args: argparse.Namespace, fmt: str) -> int:
    """``--lake DIR``: the statement on DuckDB over the lake's Parquet files."""
    from fleetd.store.lakesql import Pruning, open_lake

    for flag, given in (("--db", args.db is not None), ("--reduce", bool(args.reduce)),
                        ("--nodes/--config", fleet_mode(args))):
        if given:
            raise UsageError(f"--lake and {flag} do not go together",
                             "query the lake (--lake DIR) or a database/fleet, not both")
    from fleetd.cli.window_args import window_of

    bounds = window_of(args)
    since, until = bounds.inclusive()  # which date partitions DuckDB reads
    if args.sql:
        if args.op is not None or args.pid is not None:
            raise UsageError("give either SQL or the --op/--pid shortcuts, not both",
                             "put the condition in your SQL's WHERE clause")
        # With SQL, the time flags only choose which date partitions DuckDB reads.
        sql, params = args.sql, list(args.param)
    else:
        sql, params = build_sql(args, bounds)
    limits = Limits.local(timeout_s=_local_timeout(args.timeout), max_rows=_local_rows(args.limit))
    with open_lake(args.lake, limits, Pruning(None, since, until)) as db:
        result = db.query(sql, params, limits)
    _print(result, fmt, None, args.limit)
    return 0


def run_fleet(args: argparse.Namespace, fmt: str) -> int:
    from fleetd.fleet.queries import QuerySpec, query

    sql, params, times = build_sql_times(args)
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit} must be positive", "e.g. --limit 1000")
    opts = fleet_options(args)
    # The node stops the SQL a little before our deadline, so a slow query comes back
    # as the node's own timeout error rather than as a hung-up connection.
    node_limit = max(0.05, opts.client.timeout_s * 0.9)
    spec = QuerySpec(sql, params, frozenset(times), args.limit, node_limit, args.reduce)
    result = query(opts, spec)
    extra = {k: v for k, v in result.obj.items() if k not in ("columns", "rows")}
    write_rows(result.columns, result.rows, fmt, sys.stdout, extra)
    if fmt != "json" or args.show_skew:
        report(result.answer, args.show_skew)
    return result.exit_code


def _print(result: QueryResult, fmt: str, hint: str | None, asked: int | None) -> None:
    warnings = list(result.warnings)
    # Stopping at the --limit the user gave is what was asked for: no warning (JSON's
    # "truncated" still says more rows existed).
    theirs = bool(asked) and result.truncated_reason == "rows" and len(result.rows) == asked
    if result.truncated and not theirs:
        warnings.append(
            f"result truncated at {len(result.rows)} rows (limit on {result.truncated_reason}); "
            "narrow the query or raise --limit"
        )
    if hint:
        warnings.append(hint)
    extra = {"truncated": result.truncated, "warnings": warnings, "skew": {}}
    write_rows(result.columns, result.rows, fmt, sys.stdout, extra)
    if fmt != "json":
        warn(warnings)


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
