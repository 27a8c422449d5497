"""A local database (one node, or a merged file of many) as exporter input.

Each node's events are read lazily in time order with one query on the timestamp index;
nodes are read one after another, so a merged file of any size streams in constant
memory. Clock correction comes from each node's recorded sessions (see
:mod:`fleetd.export.clockfix`), plus any offset given by hand.
"""

from __future__ import annotations

import logging
import sqlite3
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetd.analyze.reading import pods
from fleetd.analyze.reading.data import CALL_CODES, Node, in_list, nodes
from fleetd.analyze.reading.window import Window
from fleetd.export.clockfix import recorded_fix
from fleetd.export.model import AnnotationRow, ChainMark, ClockFix, EventRow, GpuRow, NodeTrace
from fleetd.store.chainrow import STORED_CHAIN_COLUMNS, STORED_CHAIN_WINDOW, stored_chain
from fleetd.store.clockinfo import SESSION_CLOCK_COLUMNS, session_clock
from fleetd.store.db import present_tables

log = logging.getLogger("fleetd.export.local")

CHAIN_MODES = ("auto", "stored", "computed", "none")
_EVENTS_SQL = (
    "SELECT e.id, e.ts_ns, e.dur_ns, e.pid, e.tid, e.op, e.ret, e.bytes, e.peer, e.a0, e.a1, "
    "e.stack, x.args FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
    "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ?"
)
# The frames of the stacks the window's events carry (at most MAX_STACKS of them).
_STACKS_WHERE = ("FROM event_data e WHERE e.stack != 0 AND e.ts_ns >= ? AND e.ts_ns < ? "
                 "AND e.id BETWEEN ? AND ?")
MAX_STACKS = 20_000
# Imported GPU work (kernels, copies, sets; synchronizations have no slice of their own)
# and annotated ranges, in the same window, time order and filters as the events.
GPU_TABLES = ("gpu_data", "annotation_data")  # both come with schema 2
_GPU_WHERE = ("FROM gpu_data g WHERE g.kind IN (1, 2, 3) AND g.ts_ns >= ? AND g.ts_ns < ? "
              "AND g.id BETWEEN ? AND ?")
_GPU_SQL = (
    "SELECT g.id, g.ts_ns, g.dur_ns, g.pid, g.device, g.stream, g.kind, "
    "coalesce((SELECT name FROM gpu_names WHERE hash = g.name), ''), g.correlation, g.launch, "
    "g.bytes, (SELECT name FROM gpu_names WHERE hash = g.collective AND g.collective != 0), "
    "g.grid_x, g.grid_y, g.grid_z, g.block_x, g.block_y, g.block_z "
)
_ANNOTATIONS_SQL = (
    "SELECT a.id, a.ts_ns, a.dur_ns, a.pid, a.tid, a.kind, "
    "coalesce((SELECT name FROM gpu_names WHERE hash = a.name), '') FROM annotation_data a "
    "WHERE a.ts_ns >= ? AND a.ts_ns < ? AND a.id BETWEEN ? AND ?"
)


@dataclass(frozen=True, slots=True)
class LocalOptions:
    window: Window
    pid: int | None = None
    limit_per_node: int | None = None
    chains: str = "auto"  # stored chains, else computed by explain; or only one of them
    correct_clock: bool = True
    offsets: Mapping[str, int] = field(default_factory=dict)  # node -> ns, given by hand


def local_traces(conn: sqlite3.Connection,
                 opts: LocalOptions) -> tuple[list[NodeTrace], int, list[str]]:
    """Exporter input for every node of the file, the trace origin, and warnings."""
    warnings = list(opts.window.warnings)
    unknown = set(opts.offsets) - {n.name for n in nodes(conn)}
    if unknown:
        warnings.append(f"--offset names node(s) not in the file: {', '.join(sorted(unknown))}")
    traces: list[NodeTrace] = []
    starts: list[int] = []
    # Schema 1 files (before imports) have no GPU tables; they export as they always did.
    has_gpu = len(present_tables(conn, GPU_TABLES)) == len(GPU_TABLES)
    for node in nodes(conn):
        fix, notes = _clock(conn, node, opts)
        warnings += [f"node {node.name!r}: {n}" for n in notes]
        gpu = has_gpu and _gpu_first_ts(conn, node, opts)
        first = min((t for t in (_first_ts(conn, node, opts), gpu or None) if t is not None),
                    default=None)
        if first is None:
            continue
        starts.append(fix.apply(first))
        trace = NodeTrace(
            name=node.name, events=_events(conn, node, opts), ranks=_ranks(conn, node),
            processes=_processes(conn, node), threads=_threads(conn, node),
            chains=_chains(conn, node, opts), rates=_rates(conn, node, opts), clock=fix,
            stacks=_stacks(conn, node, opts))
        if has_gpu:
            trace.gpu = _gpu(conn, node, opts)
            trace.annotations = _annotations(conn, node, opts)
            trace.launches = _launches(conn, node, opts)
        traces.append(trace)
    if not traces and not warnings:
        warnings.append("no events to export in the window")
    return traces, min(starts, default=opts.window.start_ns), warnings


def _clock(conn: sqlite3.Connection, node: Node,
           opts: LocalOptions) -> tuple[ClockFix, list[str]]:
    offset = opts.offsets.get(node.name, 0)
    manual = "manual" if node.name in opts.offsets else ""
    if not opts.correct_clock:
        return ClockFix(offset, manual or "none"), []
    sessions = [session_clock(r) for r in conn.execute(
        f"SELECT {SESSION_CLOCK_COLUMNS} FROM session_data WHERE node = ? ORDER BY seq",
        (node.key,))]
    return recorded_fix(sessions, offset, manual)


def _where(node: Node, opts: LocalOptions, sql: str = "", alias: str = "e"
           ) -> tuple[str, list[int]]:
    """``sql`` (the events query by default) with the window, node and pid filters."""
    sql = sql or _EVENTS_SQL
    params = [opts.window.start_ns, opts.window.end_ns, node.lo, node.hi]
    if opts.pid is not None:
        sql += f" AND {alias}.pid = ?"
        params.append(opts.pid)
    return sql, params


def _first_ts(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> int | None:
    sql, params = _where(node, opts)
    row = conn.execute(sql + " ORDER BY e.ts_ns LIMIT 1", params).fetchone()
    return None if row is None else int(row[1])


def _events(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> Iterator[EventRow]:
    sql, params = _where(node, opts)
    sql += " ORDER BY e.ts_ns, e.id"
    if opts.limit_per_node is not None:
        sql += " LIMIT ?"
        params.append(opts.limit_per_node)
    # A cursor of its own, read as the exporter writes: nothing is held in memory.
    yield from conn.execute(sql, params)


def _stacks(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> dict[int, list[str]]:
    where, params = _where(node, opts, _STACKS_WHERE)
    out: dict[int, list[str]] = {}
    for h, text in conn.execute(
            f"SELECT hash, frames FROM stacks WHERE hash IN (SELECT DISTINCT e.stack {where} "
            f"LIMIT {MAX_STACKS})", params):
        try:
            frames = orjson.loads(text)
        except (orjson.JSONDecodeError, TypeError):
            continue  # a frames value from a foreign writer: the hash alone still shows
        if isinstance(frames, list):
            out[int(h)] = [str(f) for f in frames]
    return out


def _gpu_first_ts(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> int | None:
    where, params = _where(node, opts, _GPU_WHERE, "g")
    row = conn.execute(f"SELECT min(g.ts_ns) {where}", params).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _gpu_limited(node: Node, opts: LocalOptions, select: str) -> tuple[str, list[int]]:
    where, params = _where(node, opts, _GPU_WHERE, "g")
    sql = f"{select} {where} ORDER BY g.ts_ns, g.id"
    if opts.limit_per_node is not None:
        sql += " LIMIT ?"
        params.append(opts.limit_per_node)
    return sql, params


def _gpu(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> Iterator[GpuRow]:
    sql, params = _gpu_limited(node, opts, _GPU_SQL)
    yield from conn.execute(sql, params)


def _launches(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> array[int]:
    """The launch seqs of exactly the rows :func:`_gpu` yields, ascending (with repeats)."""
    sql, params = _gpu_limited(node, opts, "SELECT g.launch")
    seqs = array("q", (int(s) for (s,) in conn.execute(
        f"SELECT launch FROM ({sql}) WHERE launch != 0 ORDER BY launch", params)))
    return seqs


def _annotations(conn: sqlite3.Connection, node: Node,
                 opts: LocalOptions) -> Iterator[AnnotationRow]:
    sql = _ANNOTATIONS_SQL
    params = [opts.window.start_ns, opts.window.end_ns, node.lo, node.hi]
    if opts.pid is not None:
        sql += " AND a.pid = ?"
        params.append(opts.pid)
    sql += " ORDER BY a.ts_ns, a.id"
    if opts.limit_per_node is not None:
        sql += " LIMIT ?"
        params.append(opts.limit_per_node)
    yield from conn.execute(sql, params)


def _ranks(conn: sqlite3.Connection, node: Node) -> tuple[int, ...]:
    rows = conn.execute(
        "SELECT rank FROM process_data WHERE node = ? AND rank IS NOT NULL UNION "
        "SELECT rank FROM session_data WHERE node = ? AND rank IS NOT NULL",
        (node.key, node.key)).fetchall()
    return tuple(sorted(int(r) for (r,) in rows))


def _processes(conn: sqlite3.Connection, node: Node) -> dict[int, str]:
    """Process names for the timeline: the comm, and the pod and container it ran in
    where the tracer recorded them (``python (pod ml/trainer-0, container trainer)``)."""
    placed = pods.placements(conn, node.key)
    return {int(pid): str(comm) + pods.label(pods.fields(placed.get((node.key, int(pid)))))
            for pid, comm in conn.execute(
                "SELECT pid, comm FROM process_data WHERE node = ? AND comm IS NOT NULL",
                (node.key,))}


def _threads(conn: sqlite3.Connection, node: Node) -> dict[int, tuple[int | None, str | None]]:
    return {int(tid): (None if pid is None else int(pid), comm) for tid, pid, comm in
            conn.execute("SELECT tid, pid, comm FROM task_data WHERE node = ?", (node.key,))}


def _rates(conn: sqlite3.Connection, node: Node,
           opts: LocalOptions) -> Iterator[tuple[int, int, int]]:
    """Calls per histogram window: totals where the tracer wrote them, else the buckets."""
    sql = (
        "SELECT ts_ns, dur_ns, coalesce(sum(count) FILTER (WHERE bucket = -1), sum(count)) "
        f"FROM aggregate_data WHERE node = ? AND op IN {in_list(CALL_CODES)} "
        "AND ts_ns >= ? AND ts_ns < ?"
    )
    params: list[int] = [node.key, opts.window.start_ns, opts.window.end_ns]
    if opts.pid is not None:
        sql += " AND pid = ?"
        params.append(opts.pid)
    for ts, dur, calls in conn.execute(sql + " GROUP BY ts_ns, dur_ns ORDER BY ts_ns", params):
        yield int(ts), int(dur), int(calls or 0)


def _chains(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> list[ChainMark]:
    if opts.chains == "none":
        return []
    stored = [] if opts.chains == "computed" else _stored_chains(conn, node, opts)
    if stored or opts.chains == "stored":
        return stored
    from fleetd.analyze.explain import explain_node
    from fleetd.analyze.pernode.model import NodeSlice

    report = explain_node(NodeSlice(conn, node, opts.window), opts.pid)
    return [ChainMark.from_report(c) for c in report["chains"]]


def _stored_chains(conn: sqlite3.Connection, node: Node, opts: LocalOptions) -> list[ChainMark]:
    sql = f"SELECT {STORED_CHAIN_COLUMNS} FROM chains WHERE node = ? AND {STORED_CHAIN_WINDOW}"
    params: list[Any] = [node.name, opts.window.end_ns, opts.window.start_ns]
    if opts.pid is not None:
        sql += " AND victim_pid = ?"
        params.append(opts.pid)
    return [chain_from_row(r) for r in conn.execute(sql + " ORDER BY ts_ns, id", params)]


def chain_from_row(row: Sequence[Any]) -> ChainMark:
    """One row of :data:`~fleetd.store.chainrow.STORED_CHAIN_COLUMNS` (from the file or a
    node's chains view); TypeError/ValueError when a value has the wrong type."""
    c = stored_chain(row)
    culprit = ({"pid": c["culprit_pid"], "comm": c["culprit_comm"]}
               if c["culprit_pid"] is not None else None)
    return ChainMark(str(c["id"]), str(c["severity"]), str(c["root_cause"]), str(c["summary"]),
                     int(c["ts_ns"]), int(c["dur_ns"]), c["op"],
                     {"pid": c["victim_pid"], "tid": c["victim_tid"], "comm": c["victim_comm"]},
                     culprit, c["fixes"], c["evidence"], c["explained"], c["impact"])
