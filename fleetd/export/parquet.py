"""Export a node database (one node's, or a merged one) into the Parquet lake.

A function over the database's rows: each node's tables are read through the store's
views (names resolved, events with their session and clock-corrected ``ts_ns``), cut
by UTC date and session, and written as Hive-partitioned, zstd-compressed Parquet
through :mod:`fleetd.store.lake` (atomic renames, deterministic names: exporting the
same sessions again replaces their files). docs/schema.md describes the layout.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fleetd.errors import StoreError, UsageError
from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer, FleetOptions, fan_out_work
from fleetd.fleet.result import raise_if_user_error
from fleetd.fleet.targets import Target
from fleetd.runner import run_loop
from fleetd.store.clockinfo import session_clock
from fleetd.store.lake import (
    KEYED,
    TABLES,
    LakeTable,
    NodeRows,
    chunks,
    clock_pieces,
    finish_events,
    init_lake,
    key_span,
    node_names,
    read_node,
    select_sql,
    to_arrow,
    write_node,
)
from fleetd.wire import paths
from fleetd.wire.failure import NodeFailed
from fleetd.wire.query import check_rows


@dataclass(slots=True)
class LakeExport:
    root: Path
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> table -> rows
    warnings: list[str] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(t.get("events", 0) for t in self.rows.values())


def export_lake(conn: sqlite3.Connection, root: Path, *, nodes: list[str] | None = None,
                since_ns: int | None = None, until_ns: int | None = None,
                correct: bool = True,
                progress: Callable[[str, int], None] | None = None) -> LakeExport:
    """Write every node of ``conn`` (or those named) into the lake at ``root``."""
    have = node_names(conn)
    wanted = have if nodes is None else nodes
    unknown = [n for n in wanted if n not in have]
    if unknown:
        raise UsageError(f"node(s) {', '.join(map(repr, unknown))} not in the database",
                         f"it holds: {', '.join(have) or 'none'}")
    init_lake(root)
    out = LakeExport(root)
    small = [t for t in TABLES if t not in KEYED]
    for node in wanted:
        rows = read_node(conn, node, since_ns=since_ns, until_ns=until_ns, correct=correct,
                         only=small)
        counts = out.rows[node] = write_node(root, rows)
        out.warnings += rows.warnings
        # The big tables a chunk of row keys at a time, a file per chunk, date and
        # session: memory stays bounded, and the same rows land in the same file.
        for name in KEYED:
            span = key_span(conn, node, name)
            for lo, hi, number in chunks(*span) if span else ():
                part = read_node(conn, node, after={name: lo}, upto={name: hi},
                                 since_ns=since_ns, until_ns=until_ns, correct=correct,
                                 only=[name])
                tag = f"-c{number:06d}"
                for k, v in write_node(root, part, {name: tag}).items():
                    counts[k] = counts.get(k, 0) + v
                if progress is not None:
                    progress(node, out.events)
    return out


# ---- live nodes ---------------------------------------------------------------------

PAGE_ROWS = 10_000  # the agent's own row ceiling per query
MAX_NODE_ROWS = 5_000_000  # rows of one table held per node: bounds the client's memory


def export_fleet_lake(opts: FleetOptions, root: Path, *, since_ns: int | None = None,
                      until_ns: int | None = None, correct: bool = True
                      ) -> tuple[LakeExport, FleetAnswer]:
    """Page every node's tables through its query API into the lake at ``root``.

    Each node's rows are untrusted: the client checks every page (row widths, cell
    types, sizes), the lake's types check every value, and a node whose rows do not fit
    becomes a warning, not a failed export. Events get the node's recorded clock
    interpolation and, unless ``correct`` is off, its measured skew."""
    result: tuple[LakeExport, FleetAnswer] = run_loop(
        _fleet_lake(opts, root, since_ns, until_ns, correct))
    return result


async def _fleet_lake(opts: FleetOptions, root: Path, since_ns: int | None,
                      until_ns: int | None, correct: bool) -> tuple[LakeExport, FleetAnswer]:
    init_lake(root)

    async def work(client: FleetClient, t: Target, offset: int) -> list[dict[str, Any]]:
        window = (None if since_ns is None else since_ns + offset,
                  None if until_ns is None else until_ns + offset)
        tables, cut = {}, []
        for name, table in TABLES.items():
            tables[name] = await _pull_table(client, t, table, window)
            if tables[name] is not None and len(tables[name] or []) >= MAX_NODE_ROWS:
                cut.append(name)
        return [{"tables": tables, "cut": cut}]

    async with FleetClient(opts.client) as client:
        answer = await fan_out_work(opts, work, needs_offset=True, client=client)
    raise_if_user_error(answer)
    out = LakeExport(root)
    for o in answer.answered:
        assert o.replies is not None
        # What work() above returned for the node (the fan-out holds it as a JSON object).
        pulled = cast(dict[str, list[list[Any]] | None], o.replies[0]["tables"])
        for name in cast(list[str], o.replies[0]["cut"]):
            out.warnings.append(f"node {o.name!r}: only the first {MAX_NODE_ROWS:,} rows of "
                                f"{name} were exported; narrow the window (--from/--to) or "
                                "let the agent keep its own lake (--parquet-dir)")
        try:
            rows = _node_rows(o.name, pulled, answer.offset_ns(o) if correct else 0, correct)
        except (StoreError, ValueError, TypeError) as exc:
            out.warnings.append(f"node {o.name!r} was left out of the lake: {exc}")
            continue
        out.rows[o.name] = write_node(root, rows)
        out.warnings += rows.warnings
    return out, answer


async def _pull_table(client: FleetClient, t: Target, table: LakeTable,
                      window: tuple[int | None, int | None]) -> list[list[Any]] | None:
    """All rows of one table of one node, page by page (None: the node has no such view,
    an older schema)."""
    # The node's own columns first: an agent serving an older file has fewer.
    try:
        probe = await client.post(t, paths.QUERY, {"sql": f"SELECT * FROM {table.view} "
                                                       "LIMIT 0", "params": []})
    except NodeFailed as exc:
        if "no such table" in str(exc):
            return None
        raise
    base = select_sql(None, table, set(check_rows(probe, 0)["columns"]))
    if base is None:
        return None
    cond: list[str] = []
    params: list[Any] = []
    if table.date_column is not None:
        for op, value in ((">=", window[0]), ("<=", window[1])):
            if value is not None:
                cond.append(f"{table.date_column} {op} ?")
                params.append(value)
    order = table.key or "1"
    rows: list[list[Any]] = []
    last: int | None = None
    while len(rows) < MAX_NODE_ROWS:
        where = list(cond)
        page_params = list(params)
        if table.key and last is not None:
            where.append(f"{table.key} > ?")
            page_params.append(last)
        sql = base + (" WHERE " + " AND ".join(where) if where else "") + f" ORDER BY {order}"
        sql += f" LIMIT {PAGE_ROWS}" + ("" if table.key else f" OFFSET {len(rows)}")
        reply = await client.post(t, paths.QUERY, {"sql": sql, "params": page_params,
                                                       "max_rows": PAGE_ROWS})
        check_rows(reply, PAGE_ROWS)
        page = reply["rows"]
        assert isinstance(page, list)  # check_rows: a list of rows, each a list of cells
        rows += page
        if len(page) < PAGE_ROWS and not reply.get("truncated"):
            return rows
        if not page:
            return rows
        if table.key:
            last = page[-1][[n for n, _ in table.columns].index(table.key)]
    return rows


def _node_rows(node: str, pulled: dict[str, list[list[Any]] | None], offset_ns: int,
               correct: bool) -> NodeRows:
    tables: dict[str, Any] = {}
    for name, rows in pulled.items():
        if rows is not None and name in TABLES:
            tables[name] = to_arrow(TABLES[name], rows, node)
    clocks = []
    sessions = tables.get("sessions")
    if sessions is not None:
        for r in sessions.select(["seq", "boot_id", "started_ns", "ended_ns", "mono_offset_ns",
                                  "clock_error_ns", "clock_samples"]).to_pylist():
            clocks.append(session_clock(list(r.values())))
    pieces, warning = clock_pieces(clocks) if correct else ([], None)
    if "events" in tables:
        tables["events"] = finish_events(tables["events"], clocks, pieces, offset_ns)
    return NodeRows(node, tables, [f"node {node!r}: {warning}"] if warning else [])
