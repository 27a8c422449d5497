"""event_sparse (schema 8): the partial index on the sparse sources' rows.

A read of a rare op adds :func:`fleetd.store.sparse.sparse_only`; SQLite then reads the
index instead of walking every event of the window, and the answer is the same with or
without the index (files written before version 8, opened read-only, have none).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fleetd.analyze.reading.data import in_list
from fleetd.store.catalog import BY_CODE, NCCL, OPS, op_code
from fleetd.store.db import ensure_node, open_writer
from fleetd.store.schema import APPLICATION_ID, MIGRATIONS, SEQ_BITS
from fleetd.store.sparse import SPARSE_TERM, is_sparse, sparse_only

DENSE_SOURCES = {"cuda", "driver", "sched", "irq", "syscall"}
BLOCK_IO = op_code("block_io")


def _rows(key: int, n: int) -> list[tuple[int, ...]]:
    """n events over 10 s, every op of the catalogue in turn (so each code has rows)."""
    codes = [o.code for o in OPS]
    return [((key << SEQ_BITS) + i + 1, 10**9 + i * (10**10 // n), 1000 + i, 7, 70 + i % 3,
             codes[i % len(codes)], 0, 0, 0, 0, 0, 0) for i in range(n)]


def _fill(conn: sqlite3.Connection, n: int = 6000) -> None:
    key = ensure_node(conn, "n1")
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO event_data VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", _rows(key, n))
    conn.execute("COMMIT")


def _read(conn: sqlite3.Connection, codes: tuple[int, ...]) -> tuple[list[tuple[int, ...]], str]:
    """The rows of ``codes`` in [2 s, 8 s), as a reader asks for them, and SQLite's plan."""
    sql = (f"SELECT id, ts_ns, op FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND op IN "
           f"{in_list(codes)}{sparse_only(codes)} ORDER BY id")
    params = (2 * 10**9, 8 * 10**9)
    plan = " ".join(str(r[-1]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))
    return conn.execute(sql, params).fetchall(), plan


def test_the_sources_split_as_documented() -> None:
    for op in OPS:
        assert is_sparse(op.code) == (op.source not in DENSE_SOURCES), op.name
    assert sparse_only([op_code("off_cpu")]) == ""
    assert sparse_only([BLOCK_IO, op_code("syscall")]) == ""  # one dense code: no term
    assert sparse_only([]) == ""
    assert sparse_only(NCCL.codes) == f" AND {SPARSE_TERM}"


def test_a_sparse_read_uses_the_index_and_answers_as_the_walk(tmp_path: Path) -> None:
    conn = open_writer(tmp_path / "new.db")
    _fill(conn)
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'event_sparse'"
                        ).fetchone()[0] == 1
    indexed, plan = _read(conn, NCCL.codes)
    assert "event_sparse" in plan, plan
    walked = conn.execute(
        f"SELECT id, ts_ns, op FROM event_data NOT INDEXED WHERE ts_ns >= ? AND ts_ns < ? "
        f"AND op IN {in_list(NCCL.codes)} ORDER BY id", (2 * 10**9, 8 * 10**9)).fetchall()
    assert indexed == walked and len(walked) > 50
    assert {BY_CODE[r[2]].source for r in walked} == {"nccl"}
    # The index holds the sparse rows and no other.
    in_index = conn.execute(f"SELECT count(*) FROM event_data INDEXED BY event_sparse "
                            f"WHERE {SPARSE_TERM}").fetchone()[0]
    sparse = sum(is_sparse(r[5]) for r in _rows(1, 6000))
    assert in_index == sparse and 0 < sparse < 6000
    dense, plan = _read(conn, (op_code("off_cpu"),))
    assert "event_sparse" not in plan and len(dense) > 50


@pytest.mark.parametrize("version", [6, 7])
def test_an_older_file_reads_the_same_and_a_writer_indexes_it(tmp_path: Path,
                                                              version: int) -> None:
    old = tmp_path / "old.db"
    raw = sqlite3.connect(old)
    for script in MIGRATIONS[:version]:
        raw.executescript(script)
    raw.execute(f"PRAGMA user_version = {version}")
    raw.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    raw.commit()
    raw.close()
    conn = open_writer(tmp_path / "new.db")
    _fill(conn)
    want, plan = _read(conn, (BLOCK_IO,))
    assert "event_sparse" in plan
    conn.close()
    raw = sqlite3.connect(old)
    raw.execute("ATTACH DATABASE ? AS src", (str(tmp_path / "new.db"),))
    raw.execute("INSERT INTO nodes SELECT * FROM src.nodes")
    raw.execute("INSERT INTO event_data SELECT * FROM src.event_data")
    raw.commit()
    raw.execute("DETACH DATABASE src")
    got, plan = _read(raw, (BLOCK_IO,))  # no index yet: the walk, the same rows
    assert got == want and "event_sparse" not in plan
    raw.close()
    migrated = open_writer(old)  # a writer migrates it forward: the index is built
    got, plan = _read(migrated, (BLOCK_IO,))
    assert got == want and "event_sparse" in plan
