"""Offline merge: node databases copied off air-gapped machines, into one file.

The merged file has the current schema and one node key per node; every row keeps its
node-namespaced id (``node:seq``), so the analyzers and ``fleetd query`` work on it node
by node. What is carried: events and their args, stacks (once per content hash across
all inputs), trace sessions with their clock mappings and drop counters, processes,
threads, in-kernel histograms, causal chains with their whole history, and the ops
catalogue of each input.

Safety rules, each with a reason:

- Inputs are attached read-only (``mode=ro``); nothing is ever written to them. They
  are untrusted (:mod:`fleetd.store.foreign`): their tables must be plain tables, their
  schema runs no function SQLite does not mark harmless, every statement has a deadline
  and ends at once on Ctrl-C or SIGTERM, and SQLite's heap is capped while they are read.
- Node identity is the pair (name, uid). The same pair twice is the same node: its rows
  are inserted "or ignore" by id, so merging a file again adds nothing. The same name
  with another uid is another machine, refused, because its ids would collide.
- The output is built in a temporary file beside it and renamed over it only when
  every input is in. Ctrl-C, a full disk or a corrupt input leave the old output (or
  none) exactly as it was.
- Each input is copied inside one transaction, in batches of rows so that progress can
  be reported and an interrupt lands between two short statements.

Older inputs are converted on the fly: :data:`UPGRADES` maps a schema version to a step
that presents a version-``v`` file as version ``v + 1`` through TEMP views, so the file
itself stays untouched.

A merge is planned first (:mod:`fleetd.store.mergeplan`: reading the inputs, node
identities, clocks, conflicts), then copied here, into a temporary file beside the
output.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from fleetd.errors import StoreError
from fleetd.store import files, foreign
from fleetd.store.clockinfo import NodeClock
from fleetd.store.db import check_store_shape, connect, open_writer
from fleetd.store.mergeplan import (
    SEQ_BITS,
    Existing,
    Layout,
    Source,
    Upgrade,
    plan,
    source_layout,
)
from fleetd.store.schema import PLACEMENT_COLUMNS

log = logging.getLogger("fleetd.store.merge")

BATCH_IDS = 100_000  # id span copied per statement: short enough for a prompt Ctrl-C
BATCH_ROWS = 50_000  # rows per statement for tables batched by rowid or key
DEFAULT_CLOCK_THRESHOLD_NS = 10_000_000
MERGE_LOG_KEY = "merge_log"
# The merged file is temporary until renamed: no journal, no fsync per commit. A failed
# input discards the whole temporary file, so nothing ever needs rolling back.
_TEMP_PRAGMAS = ("PRAGMA journal_mode=OFF", "PRAGMA synchronous=OFF",
                 "PRAGMA cache_size=-32768", "PRAGMA temp_store=MEMORY")

# The tables version 2 added (imported GPU activity) and their columns; a version-1
# input has none of them.
_V2_TABLES: dict[str, tuple[str, ...]] = {
    "gpu_names": ("hash", "name"),
    "gpu_data": ("id", "session", "ts_ns", "dur_ns", "pid", "device", "stream", "kind",
                 "name", "correlation", "launch", "bytes", "collective", "grid_x",
                 "grid_y", "grid_z", "block_x", "block_y", "block_z"),
    "annotation_data": ("id", "session", "ts_ns", "dur_ns", "pid", "tid", "kind", "name"),
}


def _v1_to_v2(conn: sqlite3.Connection, schema_name: str, layout: Layout) -> Layout:
    """Present each table a version-1 file lacks as an empty view with its columns."""
    out = dict(layout)
    for table, cols in _V2_TABLES.items():
        view = f"{schema_name}_v2_{table}"
        conn.execute(f"CREATE TEMP VIEW IF NOT EXISTS {view} AS SELECT "
                     f"{', '.join(f'0 AS {c}' for c in cols)} WHERE 0")
        out[table] = f"temp.{view}"
    return out


_V3_COLUMNS: dict[str, tuple[str, ...]] = {
    "process_data": ("job",),
    "session_data": ("updated_ns", "emitted_events", "accounted_events", "end_reason"),
}


def _v2_to_v3(conn: sqlite3.Connection, schema_name: str, layout: Layout) -> Layout:
    """Present a version-2 file's processes and sessions with the columns version 3
    added (NULL)."""
    out = dict(layout)
    for table, cols in _V3_COLUMNS.items():
        view = f"{schema_name}_v3_{table}"
        nulls = ", ".join(f"NULL AS {c}" for c in cols)
        conn.execute(f"CREATE TEMP VIEW IF NOT EXISTS {view} AS SELECT *, {nulls} "
                     f"FROM {layout[table]}")
        out[table] = f"temp.{view}"
    return out


def _tables_unchanged(conn: sqlite3.Connection, schema_name: str, layout: Layout
                      ) -> Layout:
    """A step that changed no table a merge reads: the older file's tables read as they
    are. Version 4 changed a view, 6 added two indexes, 7 task_seen (the writer's own
    bookkeeping for pruning, which a merge does not copy), 8 an index (event_sparse), 9
    the per-second summaries (not copied: the merged file's seconds are read raw)."""
    return dict(layout)


def _v4_to_v5(conn: sqlite3.Connection, schema_name: str, layout: Layout) -> Layout:
    """Present a version-4 file's processes with the placement columns version 5 added
    (NULL: where they ran was not recorded)."""
    view = f"{schema_name}_v5_process_data"
    nulls = ", ".join(f"NULL AS {c}" for c in PLACEMENT_COLUMNS)
    conn.execute(f"CREATE TEMP VIEW IF NOT EXISTS {view} AS SELECT *, {nulls} "
                 f"FROM {layout['process_data']}")
    return {**layout, "process_data": f"temp.{view}"}


# UPGRADES[v] presents a version-v file as version v + 1; the next migration in
# schema.MIGRATIONS adds its step here.
UPGRADES: dict[int, Upgrade] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _tables_unchanged,
                                4: _v4_to_v5, 5: _tables_unchanged, 6: _tables_unchanged,
                                7: _tables_unchanged, 8: _tables_unchanged}


# ---- what a merge reports --------------------------------------------------------------


@dataclass(slots=True)
class InputReport:
    path: Path
    version: int
    nodes: list[str]
    forced: bool
    added: dict[str, int] = field(default_factory=dict)  # table -> rows new to the output


@dataclass(slots=True)
class MergeReport:
    output: Path
    inputs: list[InputReport]
    nodes: list[NodeClock]
    warnings: list[str]
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Progress:
    index: int  # 1-based input number
    inputs: int
    path: Path
    stage: str  # "events" while copying, "done" once the input is committed
    done: int
    total: int


ProgressFn = Callable[[Progress], None]


# ---- entry point ---------------------------------------------------------------------


def merge(
    inputs: Sequence[Path],
    output: Path,
    force_nodes: Sequence[str] = (),
    *,
    progress: ProgressFn | None = None,
    clock_threshold_ns: int = DEFAULT_CLOCK_THRESHOLD_NS,
) -> MergeReport:
    """Merge ``inputs`` into ``output`` (created, or extended if it exists)."""
    started = time.monotonic()
    todo = plan(inputs, output, force_nodes, UPGRADES, clock_threshold_ns)
    reports = _build(output, todo.existing, todo.sources, progress)
    return MergeReport(output, reports, todo.clocks, todo.warnings, time.monotonic() - started)


# ---- building the output -------------------------------------------------------------


def _temp_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.{os.getpid()}.merging")


def _build(output: Path, existing: Existing, sources: list[Source],
           progress: ProgressFn | None) -> list[InputReport]:
    tmp = _temp_path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    conn: sqlite3.Connection | None = None
    try:
        if not existing.fresh:
            _copy_existing(output, tmp)
        open_writer(tmp).close()  # creates the schema, or migrates an older output
        conn = _connect_temp(tmp)
        seen = {key for _, key in existing.names.values()}
        reports = []
        for i, src in enumerate(sources, 1):
            step = _Stepper(progress, i, len(sources), src)
            reports.append(_copy_source(conn, src, seen, step))
            seen.update(src.key_map.values())
        conn.close()
        conn = None
        _publish(tmp, output)
        return reports
    finally:
        if conn is not None:
            conn.close()
        for p in (tmp, Path(f"{tmp}-journal"), Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            with suppress(FileNotFoundError):
                p.unlink()


def _copy_existing(output: Path, tmp: Path) -> None:
    """Start from a consistent copy of the existing output (its WAL included)."""
    src = connect(f"file:{_uri_path(output)}?mode=ro", uri=True, path=output)
    os.close(files.create_private(tmp))  # 0600, and never through a link
    dst = connect(tmp)
    try:
        src.backup(dst)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot copy the existing output {output}: {exc}",
                         "is a tracer or agent still writing it? merge into a new file") from exc
    finally:
        dst.close()
        src.close()


def _connect_temp(tmp: Path) -> sqlite3.Connection:
    # A URI connection, so that inputs can be attached with mode=ro.
    conn = connect(f"file:{_uri_path(tmp)}", uri=True, isolation_level=None, path=tmp)
    for pragma in _TEMP_PRAGMAS:
        conn.execute(pragma)
    foreign.harden(conn, attach=1)  # an input is attached to it, one at a time
    return conn


def _publish(tmp: Path, output: Path) -> None:
    """Make the finished file durable, then swap it in atomically."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, output)
    # Sidecars of the old output belong to the old file; SQLite would apply a stale WAL
    # to the new one. Their content is already in the copy we started from.
    for side in ("-wal", "-shm"):
        with suppress(FileNotFoundError):
            Path(f"{output}{side}").unlink()
    dfd = os.open(output.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _uri_path(path: Path) -> str:
    # '?' and '#' would end the path part of a URI; '%' starts an escape.
    s = str(path.absolute())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


class _Stepper:
    """Progress of one input, throttled by the caller's callback."""

    def __init__(self, fn: ProgressFn | None, index: int, inputs: int, src: Source) -> None:
        self.fn, self.index, self.inputs, self.src = fn, index, inputs, src
        self.done = 0

    def __call__(self, stage: str, rows: int, total: int | None = None) -> None:
        self.done += rows
        if self.fn is not None:
            self.fn(Progress(self.index, self.inputs, self.src.path, stage, self.done,
                             max(self.done, total if total is not None else self.src.span_ids)))


@contextmanager
def _attached(conn: sqlite3.Connection, path: Path) -> Iterator[None]:
    uri = f"file:{_uri_path(path)}?mode=ro"
    try:
        conn.execute("ATTACH DATABASE ? AS src", (uri,))
    except sqlite3.Error:
        if os.access(path.parent, os.W_OK):
            raise
        # A WAL file on read-only media cannot get its -shm; nobody writes such a copy.
        conn.execute("ATTACH DATABASE ? AS src", (uri + "&immutable=1",))
    try:
        yield
    finally:
        if not conn.in_transaction:
            for (name,) in conn.execute(
                    "SELECT name FROM sqlite_temp_master WHERE type = 'view'").fetchall():
                conn.execute(f'DROP VIEW temp."{name}"')
            conn.execute("DETACH DATABASE src")


def _copy_source(conn: sqlite3.Connection, src: Source, seen: set[int],
                 step: _Stepper) -> InputReport:
    report = InputReport(src.path, src.version, [n.name for n in src.nodes], src.forced)
    try:
        with _attached(conn, src.path), foreign.Watch(src.path).guard(conn, explain_all=False):
            # Checked again as attached: the file may have changed since it was planned.
            check_store_shape(conn, src.path, src.version, schema="src")
            layout = source_layout(conn, "src", src.version, UPGRADES)
            conn.execute("BEGIN")
            add = report.added
            _copy_catalog(conn, layout)
            _copy_meta(conn, layout)
            add["nodes"] = _copy_nodes(conn, src, seen)
            add["stacks"] = _copy_stacks(conn, layout)
            add["gpu_names"] = conn.execute(
                "INSERT OR IGNORE INTO main.gpu_names(hash, name) SELECT hash, name "
                f"FROM {layout['gpu_names']}").rowcount
            for node in src.nodes:
                s, d = node.key, src.key_map[node.key]
                for table, n in _copy_node(conn, layout, s, d, d in seen, step).items():
                    add[table] = add.get(table, 0) + n
            _log_merge(conn, src, report)
            conn.execute("COMMIT")
        step("done", 0)
    except sqlite3.Error as exc:
        raise StoreError(
            f"merging {src.path} failed: {exc}",
            "if the input was copied off a node, copy it again (with its -wal file, or after "
            "the agent stopped); check the free space beside the output",
        ) from exc
    log.info("merged %s: %s", src.path, report.added)
    return report


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [str(r[1]) for r in conn.execute(f"PRAGMA main.table_info({table})")]


def _copy_catalog(conn: sqlite3.Connection, layout: Layout) -> None:
    # Op codes are stable forever: an op a newer writer added keeps its meaning here.
    for table in ("sources", "ops"):
        cols = ", ".join(_columns(conn, table))
        conn.execute(f"INSERT OR IGNORE INTO main.{table}({cols}) SELECT {cols} "
                     f"FROM {layout[table]}")


def _copy_meta(conn: sqlite3.Connection, layout: Layout) -> None:
    conn.execute(f"INSERT OR IGNORE INTO main.meta(key, value) SELECT key, value "
                 f"FROM {layout['meta']} WHERE key != ?", (MERGE_LOG_KEY,))


def _copy_nodes(conn: sqlite3.Connection, src: Source, seen: set[int]) -> int:
    """Register the input's nodes; a node merged before keeps its row (host filled in)."""
    for node in src.nodes:
        conn.execute(
            "INSERT INTO main.nodes(id, name, uid, machine_id, host, created_ns) "
            "VALUES (?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET "
            "machine_id = coalesce(machine_id, excluded.machine_id), "
            "host = coalesce(host, excluded.host)",
            (src.key_map[node.key], node.name, node.uid, node.machine_id, node.host,
             node.created_ns),
        )
    return sum(1 for n in src.nodes if src.key_map[n.key] not in seen)


def _copy_stacks(conn: sqlite3.Connection, layout: Layout) -> int:
    """Stacks are keyed by content hash: one copy, shared by every node that has it."""
    src = layout["stacks"]
    added, last = 0, None
    while True:
        bound = "" if last is None else "WHERE hash > ?"
        params: tuple[int, ...] = () if last is None else (last,)
        top = conn.execute(f"SELECT max(hash), count(*) FROM (SELECT hash FROM {src} {bound} "
                           f"ORDER BY hash LIMIT {BATCH_ROWS})", params).fetchone()
        if top[0] is None:
            return added
        where = "hash <= ?" if last is None else "hash > ? AND hash <= ?"
        cur = conn.execute(f"INSERT OR IGNORE INTO main.stacks(hash, frames) SELECT hash, frames "
                           f"FROM {src} WHERE {where}", (*params, top[0]))
        added += cur.rowcount
        last = int(top[0])


def _copy_node(conn: sqlite3.Connection, layout: Layout, s: int, d: int, existed: bool,
               step: _Stepper) -> dict[str, int]:
    """Every row of node key ``s`` of the input, as node key ``d`` of the output."""
    delta = (d - s) << SEQ_BITS
    return {
        "events": _copy_id_range(conn, layout, "event_data", s, delta, step),
        "event_args": _copy_id_range(conn, layout, "event_args", s, delta, None),
        "sessions": _upsert(conn, layout, "session_data", ("node", "seq"), s, d, _SESSION_SET),
        "processes": _upsert(conn, layout, "process_data", ("node", "pid"), s, d, None),
        "threads": _upsert(conn, layout, "task_data", ("node", "tid"), s, d, None),
        "chains": _copy_chains(conn, layout, s, d),
        "aggregates": _copy_aggregates(conn, layout, s, d, existed),
        "gpu": _copy_id_range(conn, layout, "gpu_data", s, delta, None),
        "annotations": _copy_id_range(conn, layout, "annotation_data", s, delta, None),
    }


def _copy_id_range(conn: sqlite3.Connection, layout: Layout, table: str, s: int, delta: int,
                   step: _Stepper | None) -> int:
    """Rows of one node key, in id order, ``BATCH_IDS`` ids per statement."""
    src = layout[table]
    cols = _columns(conn, table)
    select = ", ".join("id + ?" if c == "id" else c for c in cols)
    insert = (f"INSERT OR IGNORE INTO main.{table}({', '.join(cols)}) SELECT {select} "
              f"FROM {src} WHERE id >= ? AND id < ?")
    seek = f"SELECT min(id) FROM {src} WHERE id >= ? AND id < ?"
    end = (s + 1) << SEQ_BITS
    top = conn.execute(f"SELECT max(id) FROM {src} WHERE id < ?", (end,)).fetchone()[0]
    added = 0
    lo = conn.execute(seek, (s << SEQ_BITS, end)).fetchone()[0]
    while lo is not None:
        hi = min(int(lo) + BATCH_IDS, end)
        cur = conn.execute(insert, (delta, lo, hi))
        added += cur.rowcount
        if step is not None:
            step("events", min(hi, int(top) + 1) - int(lo))
        # Jump over gaps in the ids (pruned ranges) instead of walking them.
        lo = conn.execute(seek, (hi, end)).fetchone()[0]
    return added


# Sessions: the copy that got further (a later copy of a live node) wins; equal is a no-op.
_SESSION_SET = (
    "WHERE coalesce(excluded.ended_ns, excluded.started_ns) >= "
    "coalesce(session_data.ended_ns, session_data.started_ns)"
)


def _upsert(conn: sqlite3.Connection, layout: Layout, table: str, key: tuple[str, str],
            s: int, d: int, where: str | None) -> int:
    """Insert the node's rows; a row already there is updated (``where``) or filled in."""
    cols = [c for c in _columns(conn, table) if c not in key]
    if where is None:
        # Later facts fill in what earlier ones lacked, never blank out what is known.
        sets = ", ".join(f"{c} = coalesce({table}.{c}, excluded.{c})" for c in cols)
        where = ""
    else:
        sets = ", ".join(f"{c} = excluded.{c}" for c in cols)
    count = f"SELECT count(*) FROM main.{table} WHERE node = ?"
    before = conn.execute(count, (d,)).fetchone()[0]
    conn.execute(
        f"INSERT INTO main.{table}({', '.join(key)}, {', '.join(cols)}) "
        f"SELECT ?, {key[1]}, {', '.join(cols)} FROM {layout[table]} WHERE node = ? "
        f"ON CONFLICT({', '.join(key)}) DO UPDATE SET {sets} {where}",
        (d, s),
    )
    # Rows new to the output; updates of rows already there are not counted.
    return int(conn.execute(count, (d,)).fetchone()[0] - before)


def _copy_chains(conn: sqlite3.Connection, layout: Layout, s: int, d: int) -> int:
    # Every version of every chain: a chain version never changes once written.
    cols = [c for c in _columns(conn, "chain_data") if c != "node"]
    cur = conn.execute(
        f"INSERT OR IGNORE INTO main.chain_data(node, {', '.join(cols)}) "
        f"SELECT ?, {', '.join(cols)} FROM {layout['chain_data']} WHERE node = ?", (d, s))
    return cur.rowcount


_AGG_SAME = (
    "NOT EXISTS (SELECT 1 FROM main.aggregate_data b WHERE b.node = ? AND b.op = a.op "
    "AND b.ts_ns = a.ts_ns AND b.dur_ns = a.dur_ns AND b.bucket = a.bucket "
    "AND b.pid IS a.pid AND b.session IS a.session)"
)


def _copy_aggregates(conn: sqlite3.Connection, layout: Layout, s: int, d: int,
                     existed: bool) -> int:
    """Histogram rows have no id: for a node the output already has, a row whose window,
    process, op and bucket are there is the same row merged before, and is skipped."""
    src = layout["aggregate_data"]
    cols = [c for c in _columns(conn, "aggregate_data") if c != "node"]
    select = ", ".join(f"a.{c}" for c in cols)
    dedupe = f" AND {_AGG_SAME}" if existed else ""
    insert = (f"INSERT INTO main.aggregate_data(node, {', '.join(cols)}) SELECT ?, {select} "
              f"FROM {src} a WHERE a.node = ? AND a.rowid >= ? AND a.rowid < ?{dedupe}")
    seek = f"SELECT min(rowid) FROM {src} WHERE rowid >= ?"
    added = 0
    lo = conn.execute(seek, (-(2**63),)).fetchone()[0]
    while lo is not None:
        hi = int(lo) + BATCH_ROWS
        params = (d, s, lo, hi, d) if existed else (d, s, lo, hi)
        added += conn.execute(insert, params).rowcount
        lo = conn.execute(seek, (hi,)).fetchone()[0]
    return added


def _log_merge(conn: sqlite3.Connection, src: Source, report: InputReport) -> None:
    """Keep where each part of the merged file came from (appended, never rewritten)."""
    row = conn.execute("SELECT value FROM main.meta WHERE key = ?", (MERGE_LOG_KEY,)).fetchone()
    entries = orjson.loads(row[0]) if row else []
    entries.append({
        "merged_ns": time.time_ns(), "input": str(src.path.absolute()),
        "schema_version": src.version, "nodes": report.nodes, "forced_name": src.forced,
        "added": report.added,
    })
    conn.execute("INSERT OR REPLACE INTO main.meta(key, value) VALUES (?, ?)",
                 (MERGE_LOG_KEY, orjson.dumps(entries).decode()))
