"""The Parquet lake: fleetd's rows as Hive-partitioned Parquet files, for DuckDB, Spark
and Trino.

Layout (docs/schema.md, "The Parquet lake")::

    DIR/_fleetd_lake.json                                  marker: format and version
    DIR/table=events/node=NAME/date=YYYY-MM-DD/part-*.parquet
    DIR/table=sessions/node=NAME/date=YYYY-MM-DD/part-*.parquet
    DIR/table=processes/node=NAME/part-*.parquet           (no date: one snapshot per node)

``node`` and ``date`` live only in the path (Hive partitions), never inside a file, so
every engine reads them the same way and prunes on them. A file is written under a
hidden temporary name in its final directory and renamed into place: readers (and a
crash) see a whole file or none. File names are deterministic per session and segment,
so writing the same rows again replaces a file instead of adding a second copy.

The files themselves (the marker, listing only what is really the lake's, writing
without following a link) are :mod:`fleetd.store.lakefs`.

Ids (``node:seq``) are not stored: they are ``node || ':' || (rowkey & 2^40-1)``,
computed by the views (lakesql.py, docs/scale-out.md), which saves a third of a file.
"""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetd.errors import StoreError
from fleetd.store import lakefs
from fleetd.store.clockinfo import SESSION_CLOCK_COLUMNS, SessionClock, session_clock
from fleetd.store.lakefs import LAKE_FORMAT as LAKE_FORMAT
from fleetd.store.lakefs import LAKE_VERSION as LAKE_VERSION
from fleetd.store.lakefs import MARKER as MARKER
from fleetd.store.lakefs import LakeFile as LakeFile
from fleetd.store.lakefs import escape_value as escape_value
from fleetd.store.lakefs import init_lake as init_lake
from fleetd.store.lakefs import partition_dir as partition_dir
from fleetd.store.lakefs import partition_parts
from fleetd.store.lakefs import read_marker as read_marker
from fleetd.store.lakefs import unescape_value as unescape_value
from fleetd.store.lakefs import write_bytes as write_bytes
from fleetd.store.schema import PLACEMENT_COLUMNS

log = logging.getLogger("fleetd.store.lake")

SEQ_MASK = (1 << 40) - 1
# A clock that stepped more than this between two samples is left as recorded, as the
# timeline export does (fleetd/export/clockfix.py): a step is not drift.
MAX_INTERPOLATED_JUMP_NS = 100_000_000
COMPRESSION = "zstd"

I64, STR, F64 = "int64", "string", "double"


@dataclass(frozen=True, slots=True)
class LakeTable:
    """One table of the lake: its stored columns (name, type), in the SQLite view's order
    less ``node`` and ``id``; where its rows come from; how its files are dated."""

    name: str
    view: str  # the SQLite view it is read from
    columns: tuple[tuple[str, str], ...]
    date_column: str | None  # wall-clock ns column that picks the date partition
    key: str | None  # integer column for incremental segments (the agent's lake)
    id_of: str | None = None  # the view computes id = node || ':' || (this & SEQ_MASK)
    # Columns a later lake version added: an older file lacks them and they read as
    # NULL there, where a file lacking any other column is left out as damaged.
    optional: frozenset[str] = frozenset()


def _cols(spec: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in spec.split():
        name, _, kind = item.partition(":")
        out.append((name, {"i": I64, "s": STR, "f": F64}[kind]))
    return tuple(out)


TABLES: dict[str, LakeTable] = {t.name: t for t in (
    LakeTable("events", "events", _cols(
        "ts_ns:i dur_ns:i pid:i tid:i comm:s thread:s source:s op:s ret:i bytes:i peer:i "
        "peer_pid:i peer_comm:s a0:i a1:i stack:i args:s rank:i op_code:i rowkey:i "
        "ts_recorded_ns:i session:i"), "ts_ns", "rowkey", id_of="rowkey"),
    LakeTable("sessions", "sessions", _cols(
        "seq:i host:s kernel:s boot_id:s started_ns:i ended_ns:i mono_offset_ns:i "
        "clock_error_ns:i clock_samples:s rank:i local_rank:i world_size:i tool_version:s "
        "schema_version:i lost_events:i dropped_stacks:i sampled_out:i drops:s targets:s "
        "headers_route:s command:s end_reason:s updated_ns:i emitted_events:i "
        "accounted_events:i"), "started_ns", None, id_of="seq"),
    LakeTable("processes", "processes", _cols(
        "pid:i ppid:i comm:s exe:s cmdline:s rank:i local_rank:i world_size:i start_ns:i "
        "exit_ns:i exit_code:i job:s cgroup:s runtime:s container:s container_name:s pod:s "
        "namespace:s pod_uid:s"), None, None, optional=frozenset(PLACEMENT_COLUMNS)),
    LakeTable("threads", "threads", _cols("tid:i pid:i comm:s"), None, None),
    LakeTable("stacks", "stacks", _cols("hash:i frames:s"), None, None),
    LakeTable("chain_history", "chain_history", _cols(
        "seq:i key:s version:i created_ns:i ts_ns:i dur_ns:i severity:s root_cause:s "
        "summary:s op:s victim_pid:i victim_tid:i victim_comm:s culprit_pid:i "
        "culprit_comm:s explained:f impact:f evidence:s fixes:s"), "ts_ns", None,
        id_of="seq"),
    LakeTable("gpu_activity", "gpu_activity", _cols(
        "session:i ts_ns:i dur_ns:i pid:i rank:i device:i stream:i kind:s name:s "
        "correlation:i launch_id:s bytes:i collective:s grid_x:i grid_y:i grid_z:i "
        "block_x:i block_y:i block_z:i rowkey:i"), "ts_ns", "rowkey", id_of="rowkey"),
    LakeTable("annotations", "annotations", _cols(
        "session:i ts_ns:i dur_ns:i pid:i tid:i rank:i kind:s name:s rowkey:i"),
        "ts_ns", "rowkey", id_of="rowkey"),
)}


def arrow_schema(table: LakeTable) -> Any:
    import pyarrow as pa

    types = {I64: pa.int64(), STR: pa.string(), F64: pa.float64()}
    return pa.schema([(n, types[k]) for n, k in table.columns])


# --- layout and files (fleetd/store/lakefs.py) ----------------------------------------

DATED = {name: t.date_column is not None for name, t in TABLES.items()}


def day_of(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%d")


def lake_files(root: Path, tables: Sequence[str] | None = None,
               warnings: list[str] | None = None) -> list[LakeFile]:
    """Every closed Parquet file of the lake (temporary files are never listed); a
    link, a FIFO, a bad partition is left out and named in ``warnings`` (logged when
    None)."""
    return lakefs.list_files(root, DATED, tables, warnings)


def clean_temporaries(root: Path, node: str | None = None, older_than_s: float = 3600.0
                      ) -> int:
    """Remove temporary files a crashed writer left (of one node, or all)."""
    return lakefs.clean_temporaries(root, DATED, node, older_than_s)


def write_parquet(root: Path, parts: Sequence[str], name: str, table: Any) -> int:
    """Write ``table`` to ``root/parts.../name`` atomically (a new temporary name,
    fsync, rename; never through a link); its size."""
    import pyarrow.parquet as pq

    # Monotonic integers (row keys, start times) shrink to a byte or two with delta
    # encoding; everything else dictionary + zstd.
    delta = [c for c in ("rowkey", "ts_ns", "ts_recorded_ns") if c in table.column_names]

    def write(fh: Any) -> None:
        pq.write_table(table, fh, compression=COMPRESSION, use_dictionary=[
            c for c in table.column_names if c not in delta],
            column_encoding=dict.fromkeys(delta, "DELTA_BINARY_PACKED"),
            write_statistics=True)

    return lakefs.write_file(root, parts, name, write)


# --- reading a node database --------------------------------------------------------

def node_names(conn: sqlite3.Connection) -> list[str]:
    return [str(r[0]) for r in conn.execute("SELECT name FROM nodes ORDER BY name")]


def _view_columns(conn: sqlite3.Connection, view: str) -> set[str]:
    return {str(r[1]) for r in conn.execute(f"PRAGMA table_info({view})")}


def select_sql(conn: sqlite3.Connection | None, table: LakeTable,
               have: set[str] | None = None) -> str | None:
    """The SELECT of ``table``'s stored columns from its SQLite view, NULL for a column
    an older schema lacks; None when the file has no such view (schema 1 and GPU).
    Without ``conn`` (a live node), ``have`` names the view's columns there."""
    if conn is not None:
        have = _view_columns(conn, table.view)
    if not have:
        return None
    extra = {("events", "ts_recorded_ns"): "ts_ns", ("events", "session"): "0",
             ("chain_history", "seq"): "CAST(substr(id, instr(id, ':') + 1) AS INTEGER)"}
    parts = []
    for name, _ in table.columns:
        if (table.name, name) in extra and name not in have:
            parts.append(f"{extra[(table.name, name)]} AS {name}")
        elif name in have:
            parts.append(name)
        else:
            parts.append(f"NULL AS {name}")
    return f"SELECT {', '.join(parts)} FROM {table.view}"


def to_arrow(table: LakeTable, rows: Sequence[Sequence[Any]], node: str) -> Any:
    """Rows of ``table``'s stored columns as an Arrow table of its types; StoreError
    naming the column when a value has another type (a peer's rows are not trusted)."""
    import pyarrow as pa

    schema = arrow_schema(table)
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in schema]
    if len(cols) != len(schema):
        raise StoreError(f"rows of {table.name} from node {node!r} have {len(cols)} columns, "
                         f"not {len(schema)}", "check that node's fleetd version")
    arrays = []
    for (name, _), fld, values in zip(table.columns, schema, cols, strict=True):
        try:
            arrays.append(pa.array(values, type=fld.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise StoreError(f"{table.view}.{name} of node {node!r} holds a value that is "
                             f"not {fld.type} ({str(exc)[:200]})",
                             "check the database with fleetd check --db") from None
    return pa.Table.from_arrays(arrays, schema=schema)


def _narrow(where: list[str], params: list[Any],
            bounds: Iterable[tuple[str, int | None]]) -> None:
    """Add each bound that is given (not None) to ``where``, a condition with one ``?``,
    and its value to ``params``: how both readers narrow rows to a key or time range."""
    for cond, value in bounds:
        if value is not None:
            where.append(cond)
            params.append(value)


def read_rows(conn: sqlite3.Connection, table: LakeTable, node: str,
              after: int | None = None, upto: int | None = None,
              since_ns: int | None = None, until_ns: int | None = None) -> Any:
    """``table``'s rows of ``node`` as an Arrow table (None when the file lacks it);
    ``after``/``upto`` bound ``table.key``, ``since_ns``/``until_ns`` its date column."""

    if table.name == "events":
        return read_events(conn, node, after, upto, since_ns, until_ns)
    sql = select_sql(conn, table)
    if sql is None:
        return None
    where: list[str] = ["node = ?"]
    params: list[Any] = [node]
    if table.name == "stacks":
        # Stacks have no node: in a merged file a node's are those its events use.
        where, params = [], []
        if len(node_names(conn)) > 1:
            sql += (" WHERE hash IN (SELECT DISTINCT stack FROM event_data WHERE id >> 40 = "
                    "(SELECT id FROM nodes WHERE name = ?) AND stack != 0)")
            params = [node]
    bounds: list[tuple[str, int | None]] = []
    if table.key:
        bounds += [(f"{table.key} > ?", after), (f"{table.key} <= ?", upto)]
    if table.date_column:
        bounds += [(f"{table.date_column} >= ?", since_ns),
                   (f"{table.date_column} <= ?", until_ns)]
    _narrow(where, params, bounds)
    if where:
        sql += (" AND " if "WHERE" in sql else " WHERE ") + " AND ".join(where)
    return to_arrow(table, conn.execute(sql, params).fetchall(), node)


def read_events(conn: sqlite3.Connection, node: str, after: int | None = None,
                upto: int | None = None, since_ns: int | None = None,
                until_ns: int | None = None) -> Any:
    """A node's events with the ``events`` view's columns, sorted by row key.

    Fetched as the raw integer rows (and the few JSON args), with names joined in by
    Arrow from the small lookup tables: what the view does row by row in SQLite, but
    without making four Python strings per event, which is most of a naive export's time.
    Like the view, an event whose op is not in ``ops`` is left out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    row = conn.execute("SELECT id FROM nodes WHERE name = ?", (node,)).fetchone()
    if row is None:
        return to_arrow(TABLES["events"], [], node)
    key = int(row[0])
    where, params = ["e.id BETWEEN ? AND ?"], [key << 40, ((key + 1) << 40) - 1]
    _narrow(where, params, (("e.id > ?", after), ("e.id <= ?", upto),
                            ("e.ts_ns >= ?", since_ns), ("e.ts_ns <= ?", until_ns)))
    raw_cols = ("rowkey", "ts_ns", "dur_ns", "pid", "tid", "op_code", "ret", "bytes", "peer",
                "a0", "a1", "stack", "args")
    rows = conn.execute(
        "SELECT e.id, e.ts_ns, e.dur_ns, e.pid, e.tid, e.op, e.ret, e.bytes, e.peer, e.a0, "
        "e.a1, e.stack, x.args FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
        f"WHERE {' AND '.join(where)}", params).fetchall()
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in raw_cols]
    try:
        ev = pa.table({n: pa.array(c, type=pa.string() if n == "args" else pa.int64())
                       for n, c in zip(raw_cols, cols, strict=True)})
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"event_data of node {node!r} holds a value of the wrong type "
                         f"({str(exc)[:200]})", "check the database with fleetd check --db"
                         ) from None

    def lookup(sql: str, names: tuple[str, ...], types: tuple[Any, ...]) -> Any:
        found = conn.execute(sql, (key,)).fetchall()
        data = list(zip(*found, strict=True)) if found else [() for _ in names]
        return pa.table({n: pa.array(c, type=t) for n, c, t in zip(names, data, types,
                                                                   strict=True)})

    i64, st = pa.int64(), pa.string()
    ops = lookup("SELECT code, name, source FROM ops WHERE ? IS NOT NULL", ("op_code", "op",
                 "source"), (i64, st, st))
    procs = lookup("SELECT pid, comm, rank FROM process_data WHERE node = ?",
                   ("pid", "comm", "rank"), (i64, st, i64))
    tasks = lookup("SELECT tid, comm FROM task_data WHERE node = ?", ("tid", "thread"),
                   (i64, st))
    peers = lookup("SELECT tid, pid, comm FROM task_data WHERE node = ?",
                   ("peer", "peer_pid", "peer_comm"), (i64, i64, st))
    ev = ev.join(ops, "op_code", join_type="inner")
    ev = ev.join(procs, "pid", join_type="left outer")
    ev = ev.join(tasks, "tid", join_type="left outer")
    ev = ev.join(peers, "peer", join_type="left outer")
    # The view joins a peer only when there is one (peer != 0).
    no_peer = pc.equal(ev.column("peer"), 0)
    for name in ("peer_pid", "peer_comm"):
        col = ev.column(name)
        ev = ev.set_column(ev.schema.get_field_index(name), name,
                           pc.if_else(no_peer, pa.scalar(None, col.type), col))
    ev = ev.append_column("ts_recorded_ns", ev.column("ts_ns"))
    ev = ev.append_column("session", pa.repeat(pa.scalar(0, i64), ev.num_rows))
    ev = ev.sort_by("rowkey")
    return ev.select([n for n, _ in TABLES["events"].columns]).cast(
        arrow_schema(TABLES["events"]))


def session_clocks(conn: sqlite3.Connection, node: str) -> list[SessionClock]:
    rows = conn.execute(f"SELECT {SESSION_CLOCK_COLUMNS} FROM sessions WHERE node = ? "
                        "ORDER BY started_ns", (node,)).fetchall()
    out = []
    for r in rows:
        try:
            out.append(session_clock(r))
        except (TypeError, ValueError):
            log.warning("session %r of node %r has an unreadable clock record", r[0], node)
    return out


# --- clock correction and partitioning ---------------------------------------------

def clock_pieces(sessions: Sequence[SessionClock]) -> tuple[list[tuple[int, int, int]], str | None]:
    """(start, end, jump) stretches over which the correction grows linearly, from the
    sessions' offset samples: the same reading as the timeline export's
    (fleetd/export/clockfix.py), vectorized here for a whole segment at once."""
    pieces: list[tuple[int, int, int]] = []
    for s in sessions:
        for (m0, o0, _), (m1, o1, _) in zip(s.samples, s.samples[1:], strict=False):
            if o1 != o0 and m1 > m0:
                pieces.append((m0 + o0, m1 + o0, o1 - o0))
    if pieces and max(abs(p[2]) for p in pieces) > MAX_INTERPOLATED_JUMP_NS:
        worst = max(pieces, key=lambda p: abs(p[2]))
        return [], (f"the clock stepped {worst[2] / 1e6:.1f} ms between two samples; "
                    "events are stored with their recorded times")
    return sorted(pieces), None


def correct_times(events: Any, pieces: Sequence[tuple[int, int, int]]) -> Any:
    """Events with ``ts_ns`` interpolated between clock samples (``ts_recorded_ns`` keeps
    the stamped value)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pieces or events.num_rows == 0:
        return events
    ts = events.column("ts_recorded_ns")
    delta = pa.repeat(pa.scalar(0.0), len(ts))
    for start, end, jump in pieces:
        inside = pc.and_(pc.greater_equal(ts, start), pc.less(ts, end))
        frac = pc.divide(pc.cast(pc.subtract(ts, start), pa.float64()), float(end - start))
        delta = pc.if_else(inside, pc.multiply(frac, float(jump)), delta)
    fixed = pc.add(ts, pc.cast(pc.floor(delta), pa.int64()))
    return events.set_column(events.schema.get_field_index("ts_ns"), "ts_ns", fixed)


def assign_sessions(events: Any, sessions: Sequence[SessionClock]) -> Any:
    """The ``session`` column: the latest session of the node started at or before the
    event (0 before the first)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ts = events.column("ts_recorded_ns")
    seq = pa.repeat(pa.scalar(0, pa.int64()), len(ts))
    for s in sorted(sessions, key=lambda s: s.started_ns):
        seq = pc.if_else(pc.greater_equal(ts, s.started_ns), s.seq, seq)
    return events.set_column(events.schema.get_field_index("session"), "session", seq)


def split_by_day(rows: Any, column: str) -> Iterator[tuple[str, Any]]:
    """``rows`` cut into one table per UTC date of ``column``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if rows.num_rows == 0:
        return
    days = pc.cast(pc.divide(rows.column(column).fill_null(0), 86_400_000_000_000), pa.int64())
    lo, hi = pc.min_max(days).values()
    for day in range(lo.as_py(), hi.as_py() + 1):
        part = rows.filter(pc.equal(days, day)) if lo != hi else rows
        if part.num_rows:
            yield (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat(), part


# --- retention ----------------------------------------------------------------------

@dataclass(slots=True)
class Retention:
    keep_days: float | None = None
    max_bytes: int | None = None


def apply_retention(root: Path, rule: Retention, now: float | None = None) -> list[Path]:
    """Remove dated files past ``keep_days`` (by their partition date), then the oldest
    dated files until the lake fits ``max_bytes``; the removed paths, oldest first.
    Snapshot tables (no date) are never removed: they are replaced in place."""
    files = [f for f in lake_files(root) if f.date is not None]
    # Oldest first: by partition date, then by when the file was closed.
    files.sort(key=lambda f: (f.date or "", f.mtime, str(f.path)))
    removed: list[Path] = []
    if rule.keep_days is not None:
        cutoff = (dt.datetime.fromtimestamp(now if now is not None else time.time(), dt.UTC)
                  - dt.timedelta(days=rule.keep_days)).strftime("%Y-%m-%d")
        for f in list(files):
            if (f.date or "") < cutoff:
                removed.append(f.path)
                files.remove(f)
    if rule.max_bytes is not None:
        total = sum(f.size for f in lake_files(root) if f.path not in removed)
        for f in list(files):
            if total <= rule.max_bytes:
                break
            removed.append(f.path)
            total -= f.size
            files.remove(f)
    for p in removed:
        p.unlink(missing_ok=True)
        _remove_empty_dirs(p.parent, root)
    return removed


def _remove_empty_dirs(d: Path, root: Path) -> None:
    while d != root and d.is_relative_to(root):
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


# --- a node's rows, whole or one segment --------------------------------------------

@dataclass(slots=True)
class NodeRows:
    node: str
    tables: dict[str, Any]  # table name -> Arrow table of its stored columns
    warnings: list[str]


KEYED = tuple(name for name, t in TABLES.items() if t.key)
CHUNK_ROWS = 1 << 20  # keyed rows read and written at a time: bounds an export's memory


def chunks(after: int, upto: int, size: int | None = None) -> Iterator[tuple[int, int, int]]:
    """``(after, upto]`` cut into key ranges of at most ``size`` (default
    :data:`CHUNK_ROWS`), aligned to multiples of it so that the same rows always fall
    into the same chunk (and file): ``(after, upto, chunk number)``."""
    size = size or CHUNK_ROWS
    lo = after
    while lo < upto:
        seq = lo & SEQ_MASK  # aligned on the seq, not on the node key above it
        hi = min(upto, lo - seq + (seq // size + 1) * size)
        yield lo, hi, seq // size
        lo = hi


def key_span(conn: sqlite3.Connection, node: str, table: str) -> tuple[int, int] | None:
    """(smallest key - 1, largest key) of a keyed table's rows of ``node``; None if none."""
    raw = {"events": "event_data", "gpu_activity": "gpu_data",
           "annotations": "annotation_data"}[table]
    row = conn.execute("SELECT id FROM nodes WHERE name = ?", (node,)).fetchone()
    if row is None or not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                       "AND name = ?", (raw,)).fetchone():
        return None
    key = int(row[0])
    lo, hi = conn.execute(f"SELECT min(id), max(id) FROM {raw} WHERE id BETWEEN ? AND ?",
                          (key << 40, ((key + 1) << 40) - 1)).fetchone()
    return None if lo is None else (int(lo) - 1, int(hi))


def read_node(conn: sqlite3.Connection, node: str, *, after: dict[str, int] | None = None,
              upto: dict[str, int] | None = None, since_ns: int | None = None,
              until_ns: int | None = None, correct: bool = True,
              only: Sequence[str] | None = None) -> NodeRows:
    """The lake tables' rows of ``node`` (``only`` those named) from an open node
    database (``after``/``upto`` bound each keyed table: a chunk, an agent's segment),
    events with their session and clock-corrected ``ts_ns``."""
    clocks = session_clocks(conn, node)
    pieces, warning = clock_pieces(clocks) if correct else ([], None)
    out: dict[str, Any] = {}
    for name, t in TABLES.items():
        if only is not None and name not in only:
            continue
        rows = read_rows(conn, t, node, (after or {}).get(name), (upto or {}).get(name),
                         since_ns, until_ns)
        if rows is None:
            continue
        if name == "events":
            rows = finish_events(rows, clocks, pieces)
        out[name] = rows
    return NodeRows(node, out, [f"node {node!r}: {warning}"] if warning else [])


def finish_events(events: Any, clocks: Sequence[SessionClock],
                  pieces: Sequence[tuple[int, int, int]], offset_ns: int = 0) -> Any:
    """Events with their session, ``ts_ns`` interpolated between clock samples and moved
    by ``offset_ns`` (a fleet client's measured skew: node clock minus ours)."""
    import pyarrow.compute as pc

    events = correct_times(assign_sessions(events, clocks), pieces)
    if offset_ns:
        i = events.schema.get_field_index("ts_ns")
        events = events.set_column(i, "ts_ns", pc.subtract(events.column(i), offset_ns))
    return events


def _session_column(table: LakeTable) -> str | None:
    names = {n for n, _ in table.columns}
    if "session" in names:
        return "session"
    return "seq" if table.name == "sessions" else None


def write_node(root: Path, rows: NodeRows, tags: dict[str, str] | None = None
               ) -> dict[str, int]:
    """Write a node's rows into the lake; rows written per table.

    Files are named by what they hold, so the same rows written again replace them:
    ``part-s<session>[tag].parquet`` per date for session tables (``tags``: a suffix
    per table, the agent's segment), ``part-all.parquet``
    for chain history (per date) and the snapshot tables (processes, threads, stacks).
    """
    import pyarrow.compute as pc

    counts: dict[str, int] = {}
    for name, data in rows.tables.items():
        t = TABLES[name]
        if data.num_rows == 0:
            continue
        counts[name] = data.num_rows
        if t.date_column is None:
            write_parquet(root, partition_parts(name, rows.node, None), "part-all.parquet",
                          data)
            continue
        scol = _session_column(t)
        for date, part in split_by_day(data, t.date_column):
            d = partition_parts(name, rows.node, date)
            if scol is None:
                write_parquet(root, d, "part-all.parquet", part)
                continue
            for seq in sorted(x or 0 for x in pc.unique(part.column(scol)).to_pylist()):
                sub = part.filter(pc.equal(part.column(scol), seq)) if pc.count_distinct(
                    part.column(scol)).as_py() > 1 else part
                tag = (tags or {}).get(name, "")
                write_parquet(root, d, f"part-s{seq:06d}{tag}.parquet", sub)
    return counts
