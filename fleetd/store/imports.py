"""Writing one imported profiler file (nsys, Kineto) into a node database, all or nothing.

The batch writer is made for a tracer: a queue, many small commits, rows dropped and
counted when the disk cannot keep up. An import is the opposite case: the whole file is
parsed before the database is touched, and its rows must land in one transaction or not
at all, so that a failed import leaves nothing behind and a repeated one adds nothing.
This module is that one transaction. It shares the row layouts (event fields, process
and thread upserts) with :mod:`fleetd.store.writer`.

Identity of an import: the sha256 of the source file, kept in the session's ``targets``
JSON (``{"import": {"sha256": ...}}``) and seen through the ``imports`` view. A file whose
hash is already in the database is not imported again, under any node.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fleetd.errors import StoreError, UsageError
from fleetd.store.db import ensure_node, open_writer
from fleetd.store.schema import SCHEMA_VERSION, SEQ_BITS, SEQ_MASK, EventRow
from fleetd.store.writer import _EVENT_SQL, _PROCESS_COLS, _PROCESS_SQL, _TASK_SQL

GPU_KINDS: dict[str, int] = {"kernel": 1, "memcpy": 2, "memset": 3, "sync": 4}
ANNOTATION_KINDS: dict[str, int] = {"step": 1, "nvtx": 2, "user_annotation": 3, "cpu_op": 4}
# Set in an imported off_cpu event's a0 (prev_state) beside the state bits when the source
# did not record why the thread left the CPU: the low byte then holds an assumed sleep (S).
# Far above the kernel's own report bits (0x01..0x100), so ``a0 & 255`` reads are unchanged.
STATE_NOT_RECORDED = 1 << 16

# (ts_ns, dur_ns, pid, device, stream, kind, name, correlation, launch, bytes, collective,
#  grid_x, grid_y, grid_z, block_x, block_y, block_z); launch is an index into the
# batch's events (-1: none), turned into that event's seq when written.
GpuRow = tuple[int, int, int, int, int, int, int, int, int, int, int,
               int, int, int, int, int, int]
# (ts_ns, dur_ns, pid, tid, kind, name)
AnnotationRow = tuple[int, int, int, int, int, int]

_GPU_SQL = (
    "INSERT INTO gpu_data(id, session, ts_ns, dur_ns, pid, device, stream, kind, name, "
    "correlation, launch, bytes, collective, grid_x, grid_y, grid_z, block_x, block_y, "
    "block_z) VALUES (" + ", ".join("?" * 19) + ")"
)
_ANNOTATION_SQL = (
    "INSERT INTO annotation_data(id, session, ts_ns, dur_ns, pid, tid, kind, name) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_SESSION_SQL = (
    "INSERT INTO session_data(node, seq, host, started_ns, ended_ns, mono_offset_ns, "
    "clock_error_ns, rank, local_rank, world_size, tool_version, schema_version, targets, "
    "command) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@dataclass(slots=True)
class ImportBatch:
    """Everything one file holds, parsed and checked, ready to be written."""

    node: str
    host: str | None
    started_ns: int  # wall clock of the first event (or the profiler session's start)
    ended_ns: int
    offset_ns: int  # wall = the file's own timestamp + offset
    clock_error_ns: int | None
    source: dict[str, Any]  # format, path, sha256, ... (the session's targets.import)
    tool_version: str
    command: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    events: list[EventRow] = field(default_factory=list)
    event_args: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)
    annotations: list[AnnotationRow] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # hash -> name
    processes: list[dict[str, Any]] = field(default_factory=list)
    tasks: list[tuple[int, int | None, str | None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ImportOutcome:
    node: str
    session: int  # the import's session seq (the earlier one for a repeated file)
    added: dict[str, int]  # table -> rows written; all zero for a repeated file
    already: bool  # the file was imported before


def write_import(path: Path, batch: ImportBatch) -> ImportOutcome:
    """Write ``batch`` into the database at ``path`` in one transaction; a database this
    call created is removed again when the write fails."""
    created = not path.exists()
    if not created:
        _check_before_opening(path, batch.node)
    done = False
    conn = open_writer(path)
    try:
        outcome = _write(conn, batch)
        done = True
        return outcome
    except sqlite3.Error as exc:
        raise StoreError(f"writing the import into {path} failed: {exc}",
                         "check the free space and that no other writer holds the file") from exc
    finally:
        conn.close()
        if created and not done:
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                p.unlink(missing_ok=True)


def _write(conn: sqlite3.Connection, batch: ImportBatch) -> ImportOutcome:
    conn.execute("BEGIN IMMEDIATE")
    try:
        seen = _find(conn, str(batch.source.get("sha256", "")))
        if seen is not None:
            conn.execute("ROLLBACK")
            return ImportOutcome(seen[0], seen[1], {}, True)
        _refuse_recorded_node(conn, batch.node)
        key = ensure_node(conn, batch.node, batch.host)
        session = _next(conn, "SELECT coalesce(max(seq), 0) FROM session_data WHERE node = ?",
                        key)
        conn.execute(_SESSION_SQL, (
            key, session, batch.host, batch.started_ns, batch.ended_ns, batch.offset_ns,
            batch.clock_error_ns, batch.rank, batch.local_rank, batch.world_size,
            batch.tool_version, SCHEMA_VERSION,
            orjson.dumps({"import": batch.source}).decode(), batch.command))
        added = _rows(conn, key, session, batch)
        conn.execute("COMMIT")
        return ImportOutcome(batch.node, session, added, False)
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _rows(conn: sqlite3.Connection, key: int, session: int, batch: ImportBatch
          ) -> dict[str, int]:
    lo = key << SEQ_BITS
    ev0 = lo + _max_seq(conn, "event_data", lo) + 1
    conn.executemany(_EVENT_SQL, ((ev0 + i, *r) for i, r in enumerate(batch.events)))
    conn.executemany("INSERT INTO event_args(id, args) VALUES (?, ?)",
                     ((ev0 + i, orjson.dumps(a).decode()) for i, a in batch.event_args))
    conn.executemany("INSERT OR IGNORE INTO gpu_names(hash, name) VALUES (?, ?)",
                     batch.names.items())
    first_ev = ev0 & SEQ_MASK
    g0 = lo + _max_seq(conn, "gpu_data", lo) + 1
    conn.executemany(_GPU_SQL, (
        (g0 + i, session, *r[:8], first_ev + r[8] if r[8] >= 0 else 0, *r[9:])
        for i, r in enumerate(batch.gpu)))
    a0 = lo + _max_seq(conn, "annotation_data", lo) + 1
    conn.executemany(_ANNOTATION_SQL, ((a0 + i, session, *r)
                                       for i, r in enumerate(batch.annotations)))
    conn.executemany(_PROCESS_SQL, ((key, *(p.get(c) for c in _PROCESS_COLS))
                                    for p in batch.processes))
    conn.executemany(_TASK_SQL, ((key, *t) for t in batch.tasks))
    return {"events": len(batch.events), "gpu": len(batch.gpu),
            "annotations": len(batch.annotations), "processes": len(batch.processes),
            "threads": len(batch.tasks)}


def _check_before_opening(path: Path, node: str) -> None:
    """The recorder check on a read-only connection: opening the writer may already
    change the file (journal mode, a schema migration), and a refusal writes nothing."""
    try:
        conn = sqlite3.connect(f"file:{path.absolute()}?mode=ro", uri=True)
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


__all__: Sequence[str] = ("ANNOTATION_KINDS", "GPU_KINDS", "STATE_NOT_RECORDED", "ImportBatch",
                          "ImportOutcome",
                          "write_import", "imported_sessions")
