"""Hostile SQLite files, built by code: nsys exports and node databases that run their
own SQL, are damaged, or carry values of the wrong type or range (issue 29 items 1 and
6, issue 28 item 3). Shared by the tests and by the before/after measurements.

:func:`measure` runs a fleetd command in a fresh process and reports its wall time and
peak RSS (``resource.getrusage(RUSAGE_CHILDREN)`` of a runner process that has no other
child), so a figure is the command's own.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NSYS = REPO / "tests" / "data" / "gpu" / "perlmutter-cloverleaf-cuda.sqlite"
INT64_MAX = 2**63 - 1
T0 = 1_750_000_000 * 10**9

# Rows without end, and a value of 200 characters each: a Python reader that builds a
# dict of them grows without bound, one that counts them spins forever.
ENDLESS = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c)"


def _rw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# ---- nsys exports ----------------------------------------------------------------------


def nsys_copy(tmp: Path, name: str = "copy.sqlite") -> Path:
    dst = tmp / name
    shutil.copy(NSYS, dst)
    dst.chmod(0o644)
    return dst


def nsys_with_endless_view(tmp: Path, table: str) -> Path:
    """The real export with ``table`` (StringIds or the kernel table) replaced by a view
    over an endless recursive CTE that has the table's columns."""
    dst = nsys_copy(tmp, f"view-{table}.sqlite")
    conn = _rw(dst)
    try:
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        conn.execute(f"DROP TABLE {table}")
        select = ", ".join(
            "printf('%.200c', 'x') AS value" if c == "value" else
            "i + 1 AS \"end\"" if c == "end" else f"i AS \"{c}\"" for c in cols)
        conn.execute(f"CREATE VIEW {table} AS {ENDLESS} SELECT {select} FROM c")
    finally:
        conn.close()
    return dst


def nsys_with_trigger(tmp: Path) -> Path:
    dst = nsys_copy(tmp, "trigger.sqlite")
    conn = _rw(dst)
    try:
        conn.execute("CREATE TABLE audit (x)")
        conn.execute("CREATE TRIGGER kernels_audit AFTER INSERT ON CUPTI_ACTIVITY_KIND_KERNEL "
                     "BEGIN INSERT INTO audit VALUES (1); END")
    finally:
        conn.close()
    return dst


def nsys_with_virtual_table(tmp: Path) -> Path:
    dst = nsys_copy(tmp, "virtual.sqlite")
    conn = _rw(dst)
    try:
        conn.execute("DROP TABLE StringIds")
        conn.execute("CREATE VIRTUAL TABLE StringIds USING fts5(id, value)")
    finally:
        conn.close()
    return dst


def nsys_with_computed_column(tmp: Path) -> Path:
    """StringIds whose value is computed on every read (a generated column)."""
    dst = nsys_copy(tmp, "generated.sqlite")
    conn = _rw(dst)
    try:
        conn.execute("ALTER TABLE StringIds RENAME TO old_strings")
        conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, raw TEXT, "
                     "value TEXT AS (raw || printf('%.9999c', '.')))")
        conn.execute("INSERT INTO StringIds(id, raw) SELECT id, value FROM old_strings")
        conn.execute("DROP TABLE old_strings")
    finally:
        conn.close()
    return dst


def page_of(path: Path, table: str) -> tuple[int, int]:
    """(root page number, page size) of ``table``."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                            (table,)).fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int(root), int(size)
    finally:
        conn.close()


def corrupt(path: Path, table: str, *, where: str, needle: bytes = b"Kernel") -> Path:
    """Damage a copy in place: ``header`` overwrites the b-tree header of ``table``'s root
    page (SQLite then reports a malformed image); ``text`` puts 0x99 bytes into stored
    strings wherever ``needle`` occurs (text that is no longer UTF-8, as a bad sector or a
    truncated transfer leaves it)."""
    raw = bytearray(path.read_bytes())
    if where == "header":
        root, size = page_of(path, table)
        off = (root - 1) * size + (100 if root == 1 else 0)
        raw[off:off + 12] = b"\xff" * 12
    else:
        at = raw.find(needle)
        assert at >= 0, needle
        while at >= 0:
            raw[at:at + 2] = b"\x99\x99"
            at = raw.find(needle, at + 1)
    path.write_bytes(bytes(raw))
    return path


def events_view_replaced(path: Path) -> Path:
    """A node database whose ``events`` view never ends (its tables are fine)."""
    node_db(path)
    conn = _rw(path)
    try:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(events)")]
        conn.execute("DROP VIEW events")
        conn.execute(f"CREATE VIEW events AS {ENDLESS} SELECT "
                     + ", ".join(f"i AS {c}" for c in cols) + " FROM c")
    finally:
        conn.close()
    return path


def nsys_bad_utf8(tmp: Path) -> Path:
    """Strings that are not UTF-8, as real exports carry (paths, command lines)."""
    dst = nsys_copy(tmp, "bad-utf8.sqlite")
    conn = _rw(dst)
    try:
        conn.execute("UPDATE StringIds SET value = CAST(value || X'99FE' AS TEXT) "
                     "WHERE id % 3 = 0")
        conn.execute("UPDATE TARGET_INFO_SYSTEM_ENV SET value = CAST(X'2F746D702F99' AS TEXT) "
                     "WHERE name = 'TargetInstallDir'")
        conn.execute("UPDATE PROCESSES SET name = CAST(name || X'C3' AS TEXT)")
    finally:
        conn.close()
    return dst


def nsys_without(tmp: Path, *tables: str) -> Path:
    dst = nsys_copy(tmp, "without-" + "-".join(tables) + ".sqlite")
    conn = _rw(dst)
    try:
        for t in tables:
            conn.execute(f"DROP TABLE {t}")
    finally:
        conn.close()
    return dst


def nsys_other_version(tmp: Path) -> Path:
    """The export as other nsys versions write it: the export metadata table under its
    older name ``EXPORT_META_DATA``, scheduler events without ``threadState`` (nsys
    2021.5's schema: id, start, cpu, isSchedIn, globalTid), kernels without
    ``demangledName`` (names in ``shortName`` only), and tables fleetd has never heard
    of."""
    dst = nsys_copy(tmp, "other-version.sqlite")
    conn = _rw(dst)
    try:
        conn.execute("ALTER TABLE META_DATA_EXPORT RENAME TO EXPORT_META_DATA")
        conn.execute("ALTER TABLE SCHED_EVENTS DROP COLUMN threadState")
        conn.execute("ALTER TABLE SCHED_EVENTS DROP COLUMN threadBlock")
        conn.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL DROP COLUMN demangledName")
        conn.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_FUTURE_THING (start INT, payload TEXT)")
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_FUTURE_THING VALUES (1, 'x')")
        conn.execute("CREATE TABLE TARGET_INFO_NEW_FIELDS (a, b, c)")
    finally:
        conn.close()
    return dst


def not_nsys(tmp: Path, kind: str) -> Path:
    """SQLite files that are not nsys exports: each should get its own hint."""
    dst = tmp / f"not-nsys-{kind}.sqlite"
    conn = _rw(dst)
    try:
        if kind == "empty":
            conn.execute("CREATE TABLE t (x)")
            conn.execute("DROP TABLE t")
        elif kind == "app":
            conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
        elif kind == "nvprof":  # nvprof's own SQLite output (--export-profile)
            conn.execute("CREATE TABLE StringTable (_id_ INTEGER PRIMARY KEY, value TEXT)")
            conn.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL (_id_ INTEGER "
                         "PRIMARY KEY, start INT, end INT, name INT)")
        elif kind == "no_cuda":  # nsys without CUDA tracing
            conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
            conn.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
            conn.execute("CREATE TABLE OSRT_API (start INT, end INT)")
        else:
            raise ValueError(kind)
    finally:
        conn.close()
    return dst


# ---- node databases --------------------------------------------------------------------


def node_db(path: Path, node: str = "gpu-01", n: int = 200) -> Path:
    from fleetd.store.writer import BatchWriter

    from conftest import synthetic_events  # the tests' conftest, on sys.path under pytest
    with BatchWriter(path, node, host=f"host-{node}") as w:
        seq = w.begin_session({"started_ns": T0, "mono_offset_ns": T0 - 10**12,
                               "clock_error_ns": 100_000, "tool_version": "test",
                               "schema_version": 1, "boot_id": f"boot-{node}"})
        w.update_session(seq, {"ended_ns": T0 + n * 1_000_000})
        w.add_processes([{"pid": 4242, "comm": "train", "rank": 0, "world_size": 1}])
        w.add_events(synthetic_events(n, t0=T0))
    return path


def node_with_endless_view(path: Path, table: str = "event_data") -> Path:
    node_db(path)
    conn = _rw(path)
    try:
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        conn.execute(f"DROP TABLE {table}")
        select = ", ".join(f"i AS {c}" if c in ("id", "ts_ns") else f"0 AS {c}" for c in cols)
        conn.execute(f"CREATE VIEW {table} AS {ENDLESS} SELECT {select} FROM c")
    finally:
        conn.close()
    return path


def node_with(path: Path, sql: str, *params: Any) -> Path:
    """A node database changed by one statement, as a hand-edited or forged copy is."""
    node_db(path)
    conn = _rw(path)
    try:
        conn.execute(sql, params)
    finally:
        conn.close()
    return path


def node_string_ts(path: Path) -> Path:
    return node_with(path, "UPDATE event_data SET ts_ns = 'soon' "
                           "WHERE id = (SELECT max(id) FROM event_data)")


def node_id_at_int64_max(path: Path) -> Path:
    return node_with(path, "INSERT INTO event_data SELECT ?, ts_ns, dur_ns, pid, tid, op, ret, "
                           "bytes, peer, a0, a1, stack FROM event_data LIMIT 1", INT64_MAX)


def node_named(path: Path, name: str) -> Path:
    return node_with(path, "UPDATE nodes SET name = ?", name)


def node_with_trigger(path: Path) -> Path:
    return node_with(path, "CREATE TRIGGER grow AFTER INSERT ON event_data BEGIN "
                           "INSERT INTO meta(key, value) SELECT 'x' || i, '' FROM "
                           "(WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c) "
                           "SELECT i FROM c); END")


# ---- running a command -----------------------------------------------------------------

_RUNNER = """
import json, resource, subprocess, sys, time
argv, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
try:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       errors="replace")
    rc, out, err = p.returncode, p.stdout, p.stderr
except subprocess.TimeoutExpired as exc:
    rc, out, err = None, "", (exc.stderr or b"").decode(errors="replace") if isinstance(
        exc.stderr, bytes) else (exc.stderr or "")
seconds = time.monotonic() - t0
peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"rc": rc, "seconds": seconds, "peak_mb": peak_mb,
                  "stdout": out[-20000:], "stderr": err[-20000:]}))
"""


def measure(args: list[str], timeout: float = 60.0) -> dict[str, Any]:
    """``fleetd ARGS`` in a fresh process: rc (None when it ran past ``timeout`` and was
    killed), seconds, peak_mb (its peak RSS), stdout, stderr."""
    argv = [sys.executable, "-m", "fleetd", *args]
    out = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(argv), str(timeout)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return dict(json.loads(out.stdout))
