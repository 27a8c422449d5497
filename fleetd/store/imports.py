"""Writing imported profiler files (nsys, Kineto) into a node database, all or nothing.

The batch writer is made for a tracer: a queue, many small commits, rows dropped and
counted when the disk cannot keep up. An import is the opposite case: every file is
parsed before the database is touched, and their rows must land in one transaction or
not at all, so that a failed import leaves nothing behind and a repeated one adds
nothing. This module is that one transaction (one session per file). It shares the row
layouts (event fields, process and thread upserts) with :mod:`fleetd.store.writer`.

Speed: the rows go to ``executemany`` as the readers built them, many rows to one
statement, flattened in C: ids are left to SQLite, which numbers a row one past the
table's largest id, after the first row of a table is given its id (that takes ids
``first, first + 1, ...`` exactly when no other node's rows have larger ids, checked
before and after; otherwise each row gets its id from Python); constants of the import
(session, the seq of the first launch call) are written into the statement. Into a file
this import creates (nothing else reads it yet, and a failed import removes it), the
``ts_ns`` indexes are built once after the rows are in rather than kept up row by row,
and the transaction uses the rollback journal rather than the WAL, which would write
every page twice (pages a transaction adds to a file need no journal; fsyncs as usual);
the file is switched back to WAL afterwards, as every writer opens it.

Identity of an import: the sha256 of the source file, kept in the session's ``targets``
JSON (``{"import": {"sha256": ...}}``) and seen through the ``imports`` view. A file whose
hash is already in the database is not imported again, under any node.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import orjson

from fleetd.errors import StoreError, UsageError
from fleetd.store import files, foreign
from fleetd.store.db import connect, ensure_node, open_writer
from fleetd.store.schema import (
    EVENT_FIELDS,
    SCHEMA_VERSION,
    SEQ_BITS,
    SEQ_MASK,
    EventRow,
    ProcessFields,
)
from fleetd.store.writer import PROCESS_COLS, PROCESS_SQL, TASK_SQL

GPU_KINDS: dict[str, int] = {"kernel": 1, "memcpy": 2, "memset": 3, "sync": 4}
ANNOTATION_KINDS: dict[str, int] = {"step": 1, "nvtx": 2, "user_annotation": 3, "cpu_op": 4}
# Set in an imported off_cpu event's a0 (prev_state) beside the state bits when the source
# did not record why the thread left the CPU: the low byte then holds an assumed sleep (S).
# Far above the kernel's own report bits (0x01..0x100), so ``a0 & 255`` reads are unchanged.
STATE_NOT_RECORDED = 1 << 16

# (ts_ns, dur_ns, device, stream, kind, name, correlation, bytes, collective, grid_x,
#  grid_y, grid_z, block_x, block_y, block_z, pid, launch); launch is an index into the
# batch's events (-1: none), turned into that event's seq when written. pid and launch
# come last: a reader knows them only once every launch call is read and ordered, and
# then adds them to the rest of the row in one tuple concatenation.
GpuRow = tuple[int, int, int, int, int, int, int, int, int, int, int,
               int, int, int, int, int, int]
GPU_KIND, GPU_PID, GPU_LAUNCH = 4, 15, 16  # positions in a GpuRow
# (ts_ns, dur_ns, pid, tid, kind, name)
AnnotationRow = tuple[int, int, int, int, int, int]

_GPU_COLS = (
    "ts_ns, dur_ns, pid, device, stream, kind, name, correlation, launch, bytes, collective, "
    "grid_x, grid_y, grid_z, block_x, block_y, block_z")
_ANNOTATION_COLS = "ts_ns, dur_ns, pid, tid, kind, name"
# The tables whose indexes a bulk load into a new file builds at the end.
_BULK_TABLES = ("event_data", "gpu_data", "annotation_data")
# Rows per INSERT statement (fewer when SQLite allows fewer parameters): 16 to 256 took
# 40-50% less time than one row per statement (executemany and SQLite pay per statement).
ROWS_PER_INSERT = 64
_PARAM = re.compile(r"\?(\d+)")
_SESSION_SQL = (
    "INSERT INTO session_data(node, seq, host, started_ns, ended_ns, mono_offset_ns, "
    "clock_error_ns, rank, local_rank, world_size, tool_version, schema_version, targets, "
    "command) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class ImportSource(TypedDict):
    """The file an import read: the session's ``targets.import``."""

    format: str
    path: str
    sha256: str
    bytes: int
    rank: NotRequired[int | None]  # Kineto: the distributedInfo it names
    world_size: NotRequired[int | None]
    nsys_version: NotRequired[str | None]
    sched_states: NotRequired[dict[str, int]]  # nsys: switch-outs by thread state


class ImportArgs(TypedDict):
    """An imported event's args: the CUDA call's own name, when it is stored under
    another op (``cuda_api``), and its correlation id with the GPU work it launched."""

    name: str
    correlation: NotRequired[int]


@dataclass(slots=True)
class ImportBatch:
    """Everything one file holds, parsed and checked, ready to be written."""

    node: str
    host: str | None
    started_ns: int  # wall clock of the first event (or the profiler session's start)
    ended_ns: int
    offset_ns: int  # wall = the file's own timestamp + offset
    clock_error_ns: int | None
    source: ImportSource
    tool_version: str
    command: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    events: list[EventRow] = field(default_factory=list)
    event_args: list[tuple[int, ImportArgs]] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)
    annotations: list[AnnotationRow] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # hash -> name
    processes: list[ProcessFields] = field(default_factory=list)
    tasks: list[tuple[int, int | None, str | None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ImportOutcome:
    node: str
    session: int  # the import's session seq (the earlier one for a repeated file)
    added: dict[str, int]  # table -> rows written; all zero for a repeated file
    already: bool  # the file was imported before
    timings: dict[str, float] = field(default_factory=dict)  # insert, index: seconds


def write_import(path: Path, batch: ImportBatch) -> ImportOutcome:
    """Write one batch: :func:`write_imports` of one."""
    return write_imports(path, [batch])[0]


def write_imports(path: Path, batches: Sequence[ImportBatch]) -> list[ImportOutcome]:
    """Write every batch, each as its own session, in one transaction: all of them or
    nothing (a database this call created is removed again when the write fails).

    A value no SQLite integer holds (a damaged file: a time or an id past 2^63) is
    refused here, where binding it fails, for nothing in the transaction is kept then;
    checking every value beforehand would cost a pass over every row."""
    if not batches:
        return []
    files.refuse_link(path, "database")  # before anything reads or removes it
    created = not path.exists()
    if not created:
        for node in dict.fromkeys(batch.node for batch in batches):
            _check_before_opening(path, node)
    done = False
    t0 = time.perf_counter()
    conn = open_writer(path)
    try:
        if created:
            conn.execute("PRAGMA journal_mode=DELETE")
        outcomes = _write(conn, batches, created, t0)
        if created:
            t1 = time.perf_counter()
            conn.execute("PRAGMA journal_mode=WAL")
            _add_time(outcomes[-1], "insert", time.perf_counter() - t1)
        done = True
        return outcomes
    except sqlite3.Error as exc:
        raise StoreError(f"writing the import into {path} failed: {exc}",
                         "check the free space and that no other writer holds the file") from exc
    finally:
        conn.close()
        if created and not done:
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"),
                      Path(f"{path}-journal")):
                p.unlink(missing_ok=True)


def _write(conn: sqlite3.Connection, batches: Sequence[ImportBatch], fresh: bool,
           t0: float) -> list[ImportOutcome]:
    """The one transaction. Timings: each batch's rows under its own "insert" (the first
    batch's with opening the file, the last one's with the commit); "index", of the last
    batch, the indexes built after a bulk load into a new file."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        indexes = _drop_indexes(conn) if fresh else []
        outcomes = [_write_one(conn, batch) for batch in batches]
        outcomes[0].timings["insert"] += time.perf_counter() - t0 - sum(
            o.timings["insert"] for o in outcomes)
        t1 = time.perf_counter()
        for sql in indexes:
            conn.execute(sql)
        t2 = time.perf_counter()
        conn.execute("COMMIT")
        _add_time(outcomes[-1], "index", t2 - t1)
        _add_time(outcomes[-1], "insert", time.perf_counter() - t2)
        return outcomes
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _write_one(conn: sqlite3.Connection, batch: ImportBatch) -> ImportOutcome:
    t0 = time.perf_counter()
    seen = _find(conn, str(batch.source.get("sha256", "")))
    if seen is not None:
        return ImportOutcome(seen[0], seen[1], {}, True,
                             {"insert": time.perf_counter() - t0})
    _refuse_recorded_node(conn, batch.node)
    key = ensure_node(conn, batch.node, batch.host)
    session = _next(conn, "SELECT coalesce(max(seq), 0) FROM session_data WHERE node = ?",
                    key)
    try:
        conn.execute(_SESSION_SQL, (
            key, session, batch.host, batch.started_ns, batch.ended_ns, batch.offset_ns,
            batch.clock_error_ns, batch.rank, batch.local_rank, batch.world_size,
            batch.tool_version, SCHEMA_VERSION,
            orjson.dumps({"import": batch.source}).decode(), batch.command))
        added = _rows(conn, key, session, batch)
    except OverflowError as exc:  # sqlite3: "Python int too large to convert to SQLite"
        raise UsageError(f"{batch.source.get('path')}: holds a value (a time, an id or a "
                         "size) beyond the 64-bit integers fleetd stores, so the file is "
                         "damaged or not a trace; nothing was imported",
                         "profile again, or export the report again") from exc
    return ImportOutcome(batch.node, session, added, False,
                         {"insert": time.perf_counter() - t0})


def _add_time(outcome: ImportOutcome, stage: str, seconds: float) -> None:
    outcome.timings[stage] = outcome.timings.get(stage, 0.0) + seconds


def _rows(conn: sqlite3.Connection, key: int, session: int, batch: ImportBatch
          ) -> dict[str, int]:
    lo = key << SEQ_BITS
    ev0 = lo + _max_seq(conn, "event_data", lo) + 1
    _bulk(conn, "event_data", ", ".join(EVENT_FIELDS),
          [f"?{i}" for i in range(1, len(EVENT_FIELDS) + 1)], ev0, batch.events)
    conn.executemany("INSERT INTO event_args(id, args) VALUES (?, ?)",
                     ((ev0 + i, orjson.dumps(a).decode()) for i, a in batch.event_args))
    conn.executemany("INSERT OR IGNORE INTO gpu_names(hash, name) VALUES (?, ?)",
                     batch.names.items())
    first_ev = int(ev0 & SEQ_MASK)
    # the columns of gpu_data (_GPU_COLS) from a GpuRow; launch: an index into the batch's
    # events (-1: none) -> that event's seq (0: none)
    pid, launch = f"?{GPU_PID + 1}", f"?{GPU_LAUNCH + 1}"
    gpu_values = ["?1", "?2", pid, "?3", "?4", "?5", "?6", "?7",
                  f"CASE WHEN {launch} >= 0 THEN {launch} + {first_ev} ELSE 0 END",
                  *(f"?{i}" for i in range(8, GPU_PID + 1))]
    _bulk(conn, "gpu_data", f"session, {_GPU_COLS}", [str(int(session)), *gpu_values],
          lo + _max_seq(conn, "gpu_data", lo) + 1, batch.gpu)
    _bulk(conn, "annotation_data", f"session, {_ANNOTATION_COLS}",
          [str(int(session)), *(f"?{i}" for i in range(1, 7))],
          lo + _max_seq(conn, "annotation_data", lo) + 1, batch.annotations)
    conn.executemany(PROCESS_SQL, ((key, *(p.get(c) for c in PROCESS_COLS))
                                    for p in batch.processes))
    conn.executemany(TASK_SQL, ((key, *t) for t in batch.tasks))
    return {"events": len(batch.events), "gpu": len(batch.gpu),
            "annotations": len(batch.annotations), "processes": len(batch.processes),
            "threads": len(batch.tasks)}


def _bulk(conn: sqlite3.Connection, table: str, cols: str, values: list[str], first: int,
          rows: Sequence[tuple[int, ...]]) -> None:
    """Insert ``rows`` (bound as ?1.. in ``values``) with ids first, first + 1, ...

    When no row of the table has a larger id than ``first`` (a file of one node, or this
    node the last one added), the first row gets its id and SQLite numbers the others
    (one past the largest id), ROWS_PER_INSERT rows to a statement: the rows' values are
    bound from one flat tuple per statement, and the per-statement cost of executemany
    and SQLite (the larger part of a row's cost, one row at a time) is paid once per
    ROWS_PER_INSERT rows. Otherwise every row is given its id here, a row at a time.

    ``rows`` is iterated once, front to back (besides ``len``, ``rows[0]`` and
    ``rows[-1]``): a reader may hand rows it reads from a scratch file as they are
    written, so that a large import never holds them all."""
    if not rows:
        return
    width = len(rows[0])
    insert = f"INSERT INTO {table}(id, {cols}) VALUES "
    one = ", ".join(values)
    explicit = f"{insert}(?{width + 1}, {one})"  # the id bound after the row's values
    top = conn.execute(f"SELECT max(id) FROM {table}").fetchone()[0]
    them = iter(rows)
    if top is not None and top >= first:
        conn.executemany(explicit, ((*r, first + i) for i, r in enumerate(them)))
        return
    conn.execute(explicit, (*next(them), first))
    per = max(1, min(ROWS_PER_INSERT,
                     conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // width))
    whole = 1 + (len(rows) - 1) // per * per  # rows[1:whole] go per rows at a time
    if whole > 1:
        many = insert + ", ".join(f"(NULL, {_renumbered(one, j * width)})" for j in range(per))
        conn.executemany(many, _flat(them, whole - 1, per * width))
    conn.executemany(f"{insert}(NULL, {one})", them)
    last = conn.execute(f"SELECT id, ts_ns FROM {table} WHERE id = (SELECT max(id) FROM "
                        f"{table})").fetchone()
    if tuple(last) != (first + len(rows) - 1, rows[-1][0]):  # never seen: see above
        raise StoreError(f"{table}: row ids {first}.. did not come out in order ({last})",
                         "report this as a fleetd bug")


def _renumbered(sql: str, offset: int) -> str:
    """``sql`` with every parameter ?N as ?(N + offset)."""
    return _PARAM.sub(lambda m: f"?{int(m.group(1)) + offset}", sql)


def _flat(rows: Iterator[tuple[int, ...]], count: int, size: int
          ) -> Iterator[tuple[int, ...]]:
    """The values of the next ``count`` rows in tuples of ``size`` (whole rows), made in
    C; the rows after them are left in ``rows``."""
    values = chain.from_iterable(islice(rows, count))
    while block := tuple(islice(values, size)):
        yield block


def _drop_indexes(conn: sqlite3.Connection) -> list[str]:
    """Drop the bulk-loaded tables' own indexes, returning the SQL that makes them again
    (as the schema wrote it): built once at the end, an index costs a sort of its keys
    instead of a B-tree descent per row."""
    found = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL AND "
        f"tbl_name IN ({', '.join('?' * len(_BULK_TABLES))}) ORDER BY rowid",
        _BULK_TABLES).fetchall()
    for name, _ in found:
        conn.execute(f'DROP INDEX "{name}"')
    return [str(sql) for _, sql in found]


def _check_before_opening(path: Path, node: str) -> None:
    """The recorder check on a read-only connection: opening the writer may already
    change the file (journal mode, a schema migration), and a refusal writes nothing."""
    try:
        conn = connect(f"file:{foreign.uri_path(path)}?mode=ro", uri=True, path=path)
    except sqlite3.Error:
        return  # not openable: the writer reports it
    try:
        _refuse_recorded_node(conn, node)
    except sqlite3.Error:
        pass  # not a fleetd file (or an old one): the writer decides
    finally:
        conn.close()


def _refuse_recorded_node(conn: sqlite3.Connection, node: str) -> None:
    """Refuse to add rows under a node that ``fleetd trace`` or an agent records into.

    A recorder keeps its next event seq in memory (it reads the largest stored one once,
    at start), so rows an import slips in under its node take ids the recorder will hand
    out again: the next batch fails or, worse, lands beside foreign rows. Whether that
    recorder runs at this moment cannot be told reliably from outside (a lock on the file
    is held only during a write, and the agent may be restarted later on the same file),
    but a session it recorded under this name can: any session of the node that is not an
    import. Imports add their own sessions, so imports into one node stay possible."""
    row = conn.execute(
        "SELECT count(*) FROM session_data s JOIN nodes n ON n.id = s.node WHERE n.name = ? "
        "AND (s.targets IS NULL OR json_extract(s.targets, '$.import') IS NULL)",
        (node,)).fetchone()
    if row and int(row[0]):
        raise UsageError(
            f"node {node!r} in this database holds {int(row[0])} session(s) recorded by "
            "fleetd trace or an agent; an import under the same name would take ids its "
            "recorder hands out",
            "import into a separate file and fleetd merge it, or give another --node")


def _find(conn: sqlite3.Connection, sha256: str) -> tuple[str, int] | None:
    """The node and session of an earlier import of the same file, if any."""
    if not sha256:
        return None
    row = conn.execute("SELECT node, session FROM imports WHERE sha256 = ? LIMIT 1",
                       (sha256,)).fetchone()
    return (str(row[0]), int(row[1])) if row else None


def _max_seq(conn: sqlite3.Connection, table: str, lo: int) -> int:
    top = conn.execute(f"SELECT max(id) FROM {table} WHERE id BETWEEN ? AND ?",
                       (lo, lo + SEQ_MASK)).fetchone()[0]
    return int(top) & SEQ_MASK if top is not None else 0


def _next(conn: sqlite3.Connection, sql: str, *params: Any) -> int:
    return int(conn.execute(sql, params).fetchone()[0]) + 1


def imported_sessions(conn: sqlite3.Connection) -> list[Mapping[str, Any]]:
    """The imports a database holds (node, session, format, path, sha256)."""
    cur = conn.execute("SELECT node, session, format, path, sha256 FROM imports "
                       "ORDER BY node, session")
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur]


__all__: Sequence[str] = ("ANNOTATION_KINDS", "GPU_KIND", "GPU_KINDS", "GPU_LAUNCH", "GPU_PID",
                          "STATE_NOT_RECORDED", "ImportBatch",
                          "ImportOutcome",
                          "write_import", "write_imports", "imported_sessions")
