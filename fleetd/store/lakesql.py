"""SQL over a Parquet lake on DuckDB, with the SQLite store's view names and columns.

``events``, ``sessions``, ``processes``, ``threads``, ``stacks``, ``chain_history``,
``chains``, ``gpu_activity``, ``gpu_kernels``, ``gpu_copies``, ``gpu_launches``,
``annotations``, ``ops``, ``sources`` and ``nodes`` are views over the lake's files, so a
statement written for one node's database runs unchanged here. Each view has the SQLite
view's columns in the same order, then the lake's own (``date``, the partition; on
``events`` also ``ts_recorded_ns`` and ``session``).

Only the lake's own regular files are read: listing never follows a link and leaves out,
with a warning, what is not a part file of a valid partition (fleetd/store/lakefs.py);
each file's footer is read through a descriptor that refuses a link or a FIFO.

The guard mirrors :class:`fleetd.store.guard.SafeDB`: exactly one SELECT statement; no
file access outside the lake (DuckDB's ``enable_external_access`` off, the lake the one
allowed directory, the configuration locked); a deadline that interrupts the query; a
row and byte cap with a ``truncated`` flag. Files are pruned before DuckDB sees them:
by node and by date partition, from the caller's window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetd.errors import QueryError, StoreError
from fleetd.security.private_dir import UnsafePathError, open_regular
from fleetd.store.catalog import OPS, SOURCES
from fleetd.store.guard import Limits, Params, QueryDB, QueryResult, wire_bytes
from fleetd.store.lake import (
    F64,
    I64,
    STR,
    TABLES,
    LakeFile,
    LakeTable,
    day_of,
    lake_files,
    read_marker,
)

_DUCK_TYPES = {I64: "BIGINT", STR: "VARCHAR", F64: "DOUBLE"}
_FETCH = 1024

# The views' column lists, in the SQLite views' order (fleetd/store/schema.py); ``id`` is
# computed from the stored key, ``node`` and ``date`` come from the partition path.
_ID = "node || ':' || CAST({k} & 1099511627775 AS VARCHAR) AS id"
_VIEWS: dict[str, str] = {
    "events": f"SELECT {_ID.format(k='rowkey')}, node, ts_ns, dur_ns, pid, tid, comm, "
    "thread, source, op, ret, bytes, peer, peer_pid, peer_comm, a0, a1, stack, args, rank, "
    "op_code, rowkey, ts_recorded_ns, session, date FROM raw_events",
    "sessions": f"SELECT {_ID.format(k='seq')}, node, seq, host, kernel, boot_id, "
    "started_ns, ended_ns, mono_offset_ns, clock_error_ns, clock_samples, rank, local_rank, "
    "world_size, tool_version, schema_version, lost_events, dropped_stacks, sampled_out, "
    "drops, targets, headers_route, command, end_reason, updated_ns, emitted_events, "
    "accounted_events, date FROM raw_sessions",
    "processes": "SELECT node, pid, ppid, comm, exe, cmdline, rank, local_rank, world_size, "
    "start_ns, exit_ns, exit_code, job, cgroup, runtime, container, container_name, pod, "
    "namespace, pod_uid FROM raw_processes",
    "threads": "SELECT node, tid, pid, comm FROM raw_threads",
    "stacks": "SELECT hash, any_value(frames) AS frames FROM raw_stacks GROUP BY hash",
    "chain_history": f"SELECT {_ID.format(k='seq')}, node, key, version, created_ns, ts_ns, "
    "dur_ns, severity, root_cause, summary, op, victim_pid, victim_tid, victim_comm, "
    "culprit_pid, culprit_comm, explained, impact, evidence, fixes, date FROM "
    "raw_chain_history",
    "chains": "SELECT h.* FROM chain_history h WHERE h.version = (SELECT max(c2.version) "
    "FROM chain_history c2 WHERE c2.node = h.node AND c2.key = h.key)",
    "gpu_activity": f"SELECT {_ID.format(k='rowkey')}, node, session, ts_ns, dur_ns, pid, "
    "rank, device, stream, kind, name, correlation, launch_id, bytes, collective, grid_x, "
    "grid_y, grid_z, block_x, block_y, block_z, rowkey, date FROM raw_gpu_activity",
    "gpu_kernels": "SELECT id, node, session, ts_ns, dur_ns, pid, rank, device, stream, "
    "name AS kernel, collective, correlation, launch_id, grid_x, grid_y, grid_z, block_x, "
    "block_y, block_z, rowkey FROM gpu_activity WHERE kind = 'kernel'",
    "gpu_copies": "SELECT id, node, session, ts_ns, dur_ns, pid, rank, device, stream, kind, "
    "name, bytes, correlation, launch_id, rowkey FROM gpu_activity "
    "WHERE kind IN ('memcpy', 'memset')",
    "gpu_launches": "SELECT g.id, g.node, g.pid, g.rank, g.device, g.stream, g.kind, g.name, "
    "g.correlation, g.launch_id, e.tid, e.op AS launch_op, e.ts_ns AS launch_ts_ns, "
    "e.dur_ns AS launch_dur_ns, g.ts_ns, g.dur_ns, g.ts_ns - e.ts_ns AS launch_delay_ns, "
    "greatest(0, g.ts_ns - e.ts_ns - e.dur_ns) AS queue_delay_ns FROM gpu_activity g "
    "JOIN events e ON e.node = g.node AND e.id = g.launch_id",
    "annotations": f"SELECT {_ID.format(k='rowkey')}, node, session, ts_ns, dur_ns, pid, "
    "tid, rank, kind, name, rowkey, date FROM raw_annotations",
}


@dataclass(frozen=True, slots=True)
class Pruning:
    """Which partitions a query needs: nodes (None: all) and a wall-clock window."""

    nodes: frozenset[str] | None = None
    since_ns: int | None = None
    until_ns: int | None = None

    def keeps(self, f: LakeFile) -> bool:
        if self.nodes is not None and f.node not in self.nodes:
            return False
        if f.date is None:
            return True
        # A day partition holds its UTC day; clock correction moves an event by at most
        # 100 ms, so a neighbouring day is kept too when the window ends near midnight.
        if self.since_ns is not None and f.date < day_of(self.since_ns - 10**9):
            return False
        return not (self.until_ns is not None and f.date > day_of(self.until_ns + 10**9))


def check_files(files: Sequence[LakeFile], present: dict[str, set[str]] | None = None
                ) -> tuple[list[LakeFile], list[str]]:
    """The files whose Parquet footer reads and whose columns are the table's (a column
    a later lake version added may be missing: ``present`` collects, per table, those
    some file has); a warning naming each other file (left out: the rest of the lake
    still answers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good: list[LakeFile] = []
    warnings: list[str] = []
    for f in files:
        try:
            fd, _ = open_regular(f.path)  # still a regular file, not a link or a FIFO
            with open(fd, "rb") as fh:
                schema = pq.read_schema(fh)
        except UnsafePathError as exc:
            warnings.append(f"{exc.message} and was left out; remove it")
            continue
        except (OSError, pa.ArrowException) as exc:
            why = (exc.strerror if isinstance(exc, OSError) and exc.strerror
                   else str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            warnings.append(f"{f.path} is not a readable Parquet file and was left out "
                            f"({why}); remove it or re-export that segment")
            continue
        table = TABLES[f.table]
        missing = [n for n, _ in table.columns
                   if n not in schema.names and n not in table.optional]
        if missing:
            warnings.append(f"{f.path} lacks column(s) {', '.join(missing)} of table "
                            f"{f.table!r} and was left out; re-export that segment")
            continue
        if present is not None:
            present.setdefault(f.table, set()).update(
                n for n in table.optional if n in schema.names)
        good.append(f)
    return good, warnings


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _raw_relation(table: LakeTable, files: Sequence[LakeFile],
                  present: set[str] | frozenset[str] = frozenset()) -> str:
    # A column of a later lake version that none of these files has (an older lake's):
    # NULL. Where some have it, union_by_name fills NULL for the others.
    cols = ", ".join(n if n not in table.optional or n in present
                     else f"CAST(NULL AS {_DUCK_TYPES[k]}) AS {n}" for n, k in table.columns)
    if not files:
        typed = ", ".join(f"CAST(NULL AS {_DUCK_TYPES[k]}) AS {n}" for n, k in table.columns)
        date = ", CAST(NULL AS DATE) AS date" if table.date_column else ""
        return f"SELECT {typed}, CAST(NULL AS VARCHAR) AS node{date} WHERE false"
    paths = ", ".join(_lit(str(f.path)) for f in files)
    hive = "{'node': 'VARCHAR', 'date': 'DATE'}" if table.date_column else "{'node': 'VARCHAR'}"
    date = ", date" if table.date_column else ""
    # Only the table's own columns: a file of a later minor version may carry more.
    return (f"SELECT {cols}, node{date} FROM read_parquet([{paths}], hive_partitioning = true, "
            f"hive_types = {hive}, union_by_name = true)")


class LakeDB(QueryDB):
    """A read-only, guarded DuckDB view of one lake. Use from one thread at a time."""

    def __init__(self, root: Path, limits: Limits | None = None,
                 pruning: Pruning | None = None, threads: int | None = None) -> None:
        import duckdb

        # The real path: DuckDB's allowed directory and every file listed under it.
        self.root = root.resolve()
        self.limits = limits or Limits()
        self.version = read_marker(self.root)
        prune = pruning or Pruning()
        skipped: list[str] = []
        listed = [f for f in lake_files(self.root, warnings=skipped) if prune.keeps(f)]
        self.present: dict[str, set[str]] = {}
        self.files, unreadable = check_files(listed, self.present)
        self.warnings = skipped + unreadable
        self.nodes = sorted({f.node for f in self.files})
        self.conn = duckdb.connect(":memory:")
        try:
            if threads:
                self.conn.execute(f"SET threads = {int(threads)}")
            self._create_views()
            self._lock()
        except BaseException:
            self.conn.close()
            raise

    def _create_views(self) -> None:
        for name, table in TABLES.items():
            files = [f for f in self.files if f.table == name]
            rel = _raw_relation(table, files, self.present.get(name, set()))
            self.conn.execute(f"CREATE VIEW raw_{name} AS {rel}")
        for name, sql in _VIEWS.items():
            self.conn.execute(f"CREATE VIEW {name} AS {sql}")
        self.conn.execute("CREATE TABLE ops (code BIGINT, name VARCHAR, source VARCHAR, "
                          "kind VARCHAR, a0 VARCHAR, a1 VARCHAR)")
        self.conn.executemany("INSERT INTO ops VALUES (?, ?, ?, ?, ?, ?)",
                              [(o.code, o.name, o.source, o.kind, o.a0, o.a1) for o in OPS])
        self.conn.execute("CREATE TABLE sources (name VARCHAR, description VARCHAR)")
        self.conn.executemany("INSERT INTO sources VALUES (?, ?)", list(SOURCES.items()))
        self.conn.execute("CREATE TABLE nodes (name VARCHAR)")
        if self.nodes:
            self.conn.executemany("INSERT INTO nodes VALUES (?)", [(n,) for n in self.nodes])

    def _lock(self) -> None:
        # After this, SQL can read the lake's files only, and cannot undo the setting.
        root = str(self.root).rstrip("/") + "/"
        self.conn.execute(f"SET allowed_directories = [{_lit(root)}]")
        self.conn.execute("SET enable_external_access = false")
        self.conn.execute("SET lock_configuration = true")

    def close(self) -> None:
        self.conn.close()

    def query(self, sql: str, params: Params = (), limits: Limits | None = None) -> QueryResult:
        """Run one read-only SELECT under ``limits`` (default: the ceilings)."""
        import duckdb

        lim = limits or self.limits
        self._check(sql, lim)
        timer = None
        timed_out = threading.Event()
        if lim.timeout_s != float("inf"):
            def stop() -> None:
                timed_out.set()
                self.conn.interrupt()

            timer = threading.Timer(lim.timeout_s, stop)
            timer.daemon = True
            timer.start()
        started = time.perf_counter()
        try:
            cur = self.conn.execute(sql, list(params) if not isinstance(params, dict)
                                    else params)
            result = _collect(cur, lim)
        except duckdb.Error as exc:
            raise self._explain(exc, lim, timed_out.is_set()) from None
        finally:
            if timer is not None:
                timer.cancel()
        result.elapsed_ms = (time.perf_counter() - started) * 1000
        result.warnings = list(self.warnings) + result.warnings
        return result

    def _check(self, sql: str, lim: Limits) -> None:
        import duckdb

        if not isinstance(sql, str) or not sql.strip():
            raise QueryError("empty query", "pass one SELECT statement", code="bad_query")
        if len(sql) > lim.max_sql_chars:
            raise QueryError(f"query is {len(sql)} characters, over the limit of "
                             f"{lim.max_sql_chars}", "shorten it", code="too_large")
        try:
            stmts = self.conn.extract_statements(sql)
        except duckdb.Error as exc:
            raise QueryError(f"SQL error: {exc}", "check the query (DuckDB's SQL dialect)",
                             code="bad_query") from None
        if len(stmts) != 1:
            raise QueryError(f"refused: {len(stmts)} statements in the query",
                             "send exactly one SELECT", code="forbidden")
        kind = stmts[0].type
        if kind != duckdb.StatementType.SELECT:
            raise QueryError(f"refused: a {kind.name} statement is not allowed; the lake is "
                             "read-only", "use one SELECT (WITH ... SELECT is fine)",
                             code="forbidden")

    def _explain(self, exc: Exception, lim: Limits, timed_out: bool) -> QueryError:
        text = str(exc)
        if timed_out or "INTERRUPT" in text.upper():
            return QueryError(f"query stopped after its {lim.timeout_s:g} s time limit",
                              "narrow it with --since/--from/--to, WHERE node = ..., or "
                              "LIMIT, or raise --timeout", code="timeout")
        if "Permission Error" in text or "external access" in text:
            return QueryError(f"refused: {text.splitlines()[0]}",
                              "query the lake's views; files outside the lake are off limits",
                              code="forbidden")
        for f in self.files:
            if str(f.path) in text:
                return QueryError(f"the lake file {f.path} could not be read ({text[:300]})",
                                  "remove that file or re-export its segment; the other "
                                  "files still answer", code="bad_file")
        hint = "list the views with: SELECT table_name FROM information_schema.tables"
        return QueryError(f"SQL error: {text[:500]}", hint, code="bad_query")


def _collect(cur: Any, lim: Limits) -> QueryResult:
    if cur.description is None:
        raise QueryError("the query holds no SELECT statement", "pass one SELECT statement",
                         code="bad_query")
    columns = [str(d[0]) for d in cur.description]
    rows: list[tuple[Any, ...]] = []
    size = sum(wire_bytes(c) for c in columns)
    while True:
        batch = cur.fetchmany(_FETCH)
        if not batch:
            return QueryResult(columns, rows)
        for row in batch:
            if len(rows) >= lim.max_rows:
                return QueryResult(columns, rows, True, "rows")
            size += sum(wire_bytes(v) for v in row) + len(row) + 2
            if size > lim.max_bytes:
                return QueryResult(columns, rows, True, "bytes")
            rows.append(tuple(_plain(v) for v in row))


def _plain(v: Any) -> Any:
    """DuckDB hands dates and decimals as Python objects; JSON and CSV want text."""
    if v is None or isinstance(v, int | float | str | bytes):
        return v
    return str(v)


def open_lake(root: Path, limits: Limits | None = None, pruning: Pruning | None = None
              ) -> LakeDB:
    """Open a lake for SQL; StoreError for a directory that is not a lake."""
    try:
        return LakeDB(root, limits, pruning)
    except ImportError as exc:
        raise StoreError(f"the lake needs DuckDB ({exc})", "pip install duckdb") from None


# ---- analysis over a lake: a temporary node database --------------------------------

_GPU_KINDS = {"kernel": 1, "memcpy": 2, "memset": 3, "sync": 4}
_ANNOTATION_KINDS = {"step": 1, "nvtx": 2, "user_annotation": 3, "cpu_op": 4}
_BATCH = 50_000
_MATERIALIZED = (
    ("processes", "SELECT node, pid, ppid, comm, exe, cmdline, rank, local_rank, world_size, "
     "start_ns, exit_ns, exit_code, job, cgroup, runtime, container, container_name, pod, "
     "namespace, pod_uid FROM processes",
     "INSERT OR REPLACE INTO process_data(node, pid, ppid, comm, exe, cmdline, rank, "
     "local_rank, world_size, start_ns, exit_ns, exit_code, job, cgroup, runtime, container, "
     "container_name, pod, namespace, pod_uid) "
     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"),
    ("threads", "SELECT node, tid, pid, comm FROM threads",
     "INSERT OR REPLACE INTO task_data(node, tid, pid, comm) VALUES (?,?,?,?)"),
    ("sessions", "SELECT node, seq, host, kernel, boot_id, coalesce(started_ns, 0), ended_ns, "
     "coalesce(mono_offset_ns, 0), clock_error_ns, clock_samples, rank, local_rank, "
     "world_size, coalesce(tool_version, ''), coalesce(schema_version, 0), "
     "coalesce(lost_events, 0), coalesce(dropped_stacks, 0), coalesce(sampled_out, 0), drops, "
     "targets, headers_route, command, end_reason, updated_ns, emitted_events, "
     "accounted_events FROM sessions",
     "INSERT OR REPLACE INTO session_data(node, seq, host, kernel, boot_id, started_ns, "
     "ended_ns, mono_offset_ns, clock_error_ns, clock_samples, rank, local_rank, world_size, "
     "tool_version, schema_version, lost_events, dropped_stacks, sampled_out, drops, targets, "
     "headers_route, command, end_reason, updated_ns, emitted_events, accounted_events) "
     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"),
    ("chain_history", "SELECT node, CAST(split_part(id, ':', -1) AS BIGINT), key, version, "
     "created_ns, ts_ns, dur_ns, severity, root_cause, summary, op, victim_pid, victim_tid, "
     "victim_comm, culprit_pid, culprit_comm, explained, impact, evidence, fixes "
     "FROM chain_history",
     "INSERT OR REPLACE INTO chain_data(node, seq, key, version, created_ns, ts_ns, dur_ns, "
     "severity, root_cause, summary, op, victim_pid, victim_tid, victim_comm, culprit_pid, "
     "culprit_comm, explained, impact, evidence, fixes) "
     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"),
)


def _name_hash(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest()) >> 1


def materialize(root: Path, dest: Path, pruning: Pruning | None = None) -> list[str]:
    """Copy the pruned partitions of a lake into a new node database at ``dest``, for the
    analyzers (explain, ops, overview, gpu), which run on SQLite; the lake's warnings.
    Events keep their lake (clock-corrected) times."""
    from fleetd.store.db import ensure_node, open_writer

    with LakeDB(root, Limits.local(timeout_s=None, max_rows=None), pruning) as lake:
        conn = open_writer(dest)
        try:
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute("BEGIN")
            keys = {n: ensure_node(conn, n) for n in lake.nodes}
            _copy_events(lake, conn, keys)
            for _, select, insert in _MATERIALIZED:
                _copy(lake, conn, select, insert, keys)
            _copy(lake, conn, "SELECT hash, frames FROM stacks",
                  "INSERT OR IGNORE INTO stacks(hash, frames) VALUES (?, ?)", None)
            _copy_gpu(lake, conn, keys)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return list(lake.warnings)


def _batches(lake: LakeDB, sql: str) -> Any:
    cur = lake.conn.execute(sql)
    while True:
        rows = cur.fetchmany(_BATCH)
        if not rows:
            return
        yield rows


def _copy(lake: LakeDB, conn: Any, select: str, insert: str,
          keys: dict[str, int] | None) -> None:
    for rows in _batches(lake, select):
        if keys is not None:
            rows = [(keys[r[0]], *r[1:]) for r in rows]
        conn.executemany(insert, rows)


def _copy_events(lake: LakeDB, conn: Any, keys: dict[str, int]) -> None:
    sql = ("SELECT node, rowkey & 1099511627775, ts_ns, dur_ns, pid, tid, op_code, ret, bytes, "
           "peer, a0, a1, stack, args FROM events")
    for rows in _batches(lake, sql):
        data = [((keys[r[0]] << 40) | r[1], *(v or 0 for v in r[2:13])) for r in rows]
        conn.executemany("INSERT OR REPLACE INTO event_data(id, ts_ns, dur_ns, pid, tid, op, "
                         "ret, bytes, peer, a0, a1, stack) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                         data)
        conn.executemany("INSERT OR REPLACE INTO event_args(id, args) VALUES (?, ?)",
                         [(d[0], r[13]) for d, r in zip(data, rows, strict=True) if r[13]])


def _copy_gpu(lake: LakeDB, conn: Any, keys: dict[str, int]) -> None:
    names: dict[str, int] = {}

    def h(name: str | None) -> int:
        if not name:
            return 0
        if name not in names:
            names[name] = _name_hash(name)
        return names[name]

    gpu = ("SELECT node, rowkey & 1099511627775, session, ts_ns, dur_ns, pid, device, stream, "
           "kind, name, correlation, launch_id, bytes, collective, grid_x, grid_y, grid_z, "
           "block_x, block_y, block_z FROM gpu_activity")
    for rows in _batches(lake, gpu):
        conn.executemany(
            "INSERT OR REPLACE INTO gpu_data(id, session, ts_ns, dur_ns, pid, device, stream, "
            "kind, name, correlation, launch, bytes, collective, grid_x, grid_y, grid_z, "
            "block_x, block_y, block_z) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [((keys[r[0]] << 40) | r[1], r[2] or 0, r[3], r[4], r[5] or 0, r[6] or 0,
              r[7] or 0, _GPU_KINDS.get(r[8], 1), h(r[9]), r[10] or 0,
              int(r[11].rpartition(":")[2]) if r[11] else 0, r[12] or 0, h(r[13]),
              *(v or 0 for v in r[14:20])) for r in rows])
    ann = ("SELECT node, rowkey & 1099511627775, session, ts_ns, dur_ns, pid, tid, kind, name "
           "FROM annotations")
    for rows in _batches(lake, ann):
        conn.executemany(
            "INSERT OR REPLACE INTO annotation_data(id, session, ts_ns, dur_ns, pid, tid, kind, "
            "name) VALUES (?,?,?,?,?,?,?,?)",
            [((keys[r[0]] << 40) | r[1], r[2] or 0, r[3], r[4], r[5] or 0, r[6] or 0,
              _ANNOTATION_KINDS.get(r[7], 2), h(r[8])) for r in rows])
    conn.executemany("INSERT OR IGNORE INTO gpu_names(hash, name) VALUES (?, ?)",
                     [(v, k) for k, v in names.items()])
