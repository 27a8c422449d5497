"""Schema creation, forward migration, and refusal of files that are not ours."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fleetd.errors import StoreError
from fleetd.store import schema
from fleetd.store.catalog import OPS
from fleetd.store.db import open_reader, open_writer
from fleetd.store.writer import BatchWriter

from conftest import old_schema_file


def test_new_database_has_schema_identity_and_lookups(tmp_path: Path) -> None:
    conn = open_writer(tmp_path / "a.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == schema.APPLICATION_ID
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    for needed in ("event_data", "events", "sessions", "chains", "chain_history", "stacks",
                   "processes", "threads", "aggregates", "ops", "nodes"):
        assert needed in names
    assert conn.execute("SELECT count(*) FROM ops").fetchone()[0] == len(OPS)
    assert conn.execute("SELECT code FROM ops WHERE name='cudaLaunchKernel'").fetchone() == (100,)


def test_events_view_resolves_names(small_db: Path) -> None:
    conn = open_reader(small_db)
    rows = conn.execute(
        "SELECT id, node, comm, thread, source, op FROM events WHERE op = 'cudaLaunchKernel' "
        "ORDER BY ts_ns LIMIT 2"
    ).fetchall()
    assert rows[0] == ("node-a:1", "node-a", "train_loop", "train_loop", "cuda", "cudaLaunchKernel")
    assert rows[1][0] == "node-a:5"


def test_forward_migration_keeps_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "old.db"
    BatchWriter(path, "n1").close()
    with sqlite3.connect(path) as c:
        c.execute("INSERT INTO meta VALUES ('kept', 'yes')")
    v2 = "ALTER TABLE meta ADD COLUMN note TEXT;\nCREATE TABLE added_in_v2 (x INTEGER);"
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, v2))
    now = schema.SCHEMA_VERSION
    monkeypatch.setattr(schema, "SCHEMA_VERSION", now + 1)
    import fleetd.store.db as db

    monkeypatch.setattr(db, "SCHEMA_VERSION", now + 1)
    conn = open_writer(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == now + 1
    assert conn.execute("SELECT value FROM meta WHERE key='kept'").fetchone() == ("yes",)
    assert conn.execute("SELECT count(*) FROM added_in_v2").fetchone() == (0,)


def _both_refuse(path: Path, reader_says: str, writer_says: str) -> None:
    """Neither a reader nor the writer opens ``path``; each says why (a pattern)."""
    with pytest.raises(StoreError, match=reader_says):
        open_reader(path)
    with pytest.raises(StoreError, match=writer_says):
        open_writer(path)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    BatchWriter(path, "n1").close()
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA user_version = 99")
    _both_refuse(path, "schema version 99, newer", "upgrade|newer")


def test_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE x(y)")
    _both_refuse(path, "not a fleetd one", "not a fleetd one")


def test_corrupt_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a readable SQLite database"):
        open_reader(path)


def test_reader_never_creates_a_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    with pytest.raises(StoreError, match="does not exist"):
        open_reader(path)
    assert not path.exists()


def _version_2_file(path: Path) -> Path:
    """A file as fleetd wrote it before schema 3: its processes have no job."""
    conn = old_schema_file(path, 2)
    conn.execute("INSERT INTO process_data(node, pid, comm, rank, world_size) "
                 "VALUES (1, 42, 'train', 3, 8)")
    conn.close()
    return path


def test_version_2_files_stay_readable_and_gain_the_job_column(tmp_path: Path) -> None:
    old = _version_2_file(tmp_path / "v2.db")
    reader = open_reader(old)  # read as it is: the processes view without job
    assert reader.execute("SELECT pid, rank FROM processes").fetchall() == [(42, 3)]
    reader.close()
    from fleetd.store.merge import merge

    merged = tmp_path / "merged.db"
    merge([old], merged)
    with sqlite3.connect(merged) as c:
        assert c.execute("SELECT pid, rank, world_size, job FROM processes").fetchall() == [
            (42, 3, 8, None)]
    conn = open_writer(old)  # a writer migrates it forward, keeping the rows
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION == 9
    # Version 6 creates nothing: its per-process/per-thread indexes were withdrawn.
    assert not {"event_pid_op", "event_tid_op"} & {n for (n,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert conn.execute("SELECT pid, comm, rank, job FROM processes").fetchall() == [
        (42, "train", 3, None)]
    conn.close()
    with BatchWriter(old, "old") as w:
        w.add_processes([{"pid": 42, "job": "run-1"}, {"pid": 43, "rank": 0, "job": "run-1"}])
    with sqlite3.connect(old) as c:
        assert c.execute("SELECT pid, rank, job FROM processes ORDER BY pid").fetchall() == [
            (42, 3, "run-1"), (43, 0, "run-1")]
