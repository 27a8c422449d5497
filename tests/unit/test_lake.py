"""The Parquet lake: export of the recorded scenarios and the 3-node set, the documented
example queries on SQLite and DuckDB, retention, and bad input (docs/scale-out.md)."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest
from lake_docs import doc_blocks, same_rows

from fleetd.errors import QueryError, StoreError
from fleetd.export.parquet import export_lake
from fleetd.store.db import open_reader
from fleetd.store.guard import Limits
from fleetd.store.lake import (
    LAKE_VERSION,
    MARKER,
    TABLES,
    Retention,
    apply_retention,
    lake_files,
)
from fleetd.store.lakesql import LakeDB, Pruning
from fleetd.store.writer import BatchWriter

from conftest import FLEETD, REPO, synthetic_events

SCENARIOS = sorted((REPO / "tests" / "data" / "scenarios").glob("*.db"))
FLEET = REPO / "investigations" / "fleet" / "cluster.db"
GPU = REPO / "investigations" / "gpu" / "ranks.db"
SOURCES = [*SCENARIOS, FLEET, GPU]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """Each source database exported into its own lake (the scenarios share a node
    name, so one lake each)."""
    out = {}
    for src in SOURCES:
        root = tmp_path_factory.mktemp("lake") / "lake"
        with closing(open_reader(src)) as conn:
            export_lake(conn, root)
        out[src] = root
    return out


def _sqlite_counts(src: Path, view: str) -> dict[str, int]:
    with closing(open_reader(src)) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (view,)).fetchone():
            return {}
        if view == "stacks":
            return {}
        return dict(conn.execute(f"SELECT node, count(*) FROM {view} GROUP BY node"))


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_row_counts_per_table_and_node_equal_the_source(lakes: dict[Path, Path],
                                                       src: Path) -> None:
    with LakeDB(lakes[src]) as db:
        assert db.warnings == []
        for name in TABLES:
            if name == "stacks":
                continue
            want = _sqlite_counts(src, name)
            got = dict(db.query(f"SELECT node, count(*) FROM {name} GROUP BY node").rows)
            assert got == want, name
            if name == "events":
                assert sum(got.values()) > 0
                if src == FLEET:
                    assert sorted(got) == ["node-1", "node-2", "node-3"]
        conn = open_reader(src)
        stacks = conn.execute("SELECT count(*) FROM stacks").fetchone()[0]
        conn.close()
        assert db.query("SELECT count(*) FROM stacks").rows == [(stacks,)]


def test_events_keep_the_store_columns_and_values(lakes: dict[Path, Path]) -> None:
    with closing(open_reader(FLEET)) as conn:
        cur = conn.execute("SELECT * FROM events ORDER BY rowkey LIMIT 200")
        cols = [d[0] for d in cur.description]
        want = cur.fetchall()
    with LakeDB(lakes[FLEET]) as db:
        got = db.query("SELECT * FROM events ORDER BY rowkey LIMIT 200")
    # The store's columns in the store's order, then the lake's own.
    assert got.columns[:len(cols)] == cols
    assert got.columns[len(cols):] == ["ts_recorded_ns", "session", "date"]
    ts = cols.index("ts_ns")
    # ts_ns is clock-corrected; the stamped value is kept beside it.
    assert [r[:ts] + r[ts + 1:len(cols)] for r in got.rows] == [
        r[:ts] + r[ts + 1:] for r in want]
    assert [r[len(cols)] for r in got.rows] == [r[ts] for r in want]


def test_clock_correction_is_the_timeline_exports(lakes: dict[Path, Path]) -> None:
    """Events move by the same interpolation between clock samples as in the Perfetto
    export (fleetd/export/clockfix.py), to the nanosecond."""
    from fleetd.export.clockfix import recorded_fix
    from fleetd.store.lake import session_clocks

    with closing(open_reader(FLEET)) as conn:
        fix, _ = recorded_fix(session_clocks(conn, "node-1"))
    assert fix.pieces, "the 3-node set has clock samples that moved"
    with LakeDB(lakes[FLEET]) as db:
        rows = db.query("SELECT ts_recorded_ns, ts_ns FROM events WHERE node = 'node-1'").rows
    moved = 0
    for stamped, corrected in rows:
        want = stamped + sum(p.delta(stamped) for p in fix.pieces)
        assert abs(corrected - want) <= 1
        moved += corrected != stamped
    assert moved > 0


@pytest.mark.parametrize("src", [FLEET, GPU, SCENARIOS[0]], ids=lambda p: p.stem)
def test_documented_examples_match_sqlite(lakes: dict[Path, Path], src: Path) -> None:
    examples = doc_blocks("example")
    assert len(examples) >= 4
    conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    with LakeDB(lakes[src]) as db:
        for name, sql in examples:
            try:
                want = conn.execute(sql).fetchall()
            except sqlite3.OperationalError:
                assert "gpu" in sql  # schema 1: no GPU views
                continue
            got = db.query(sql).rows
            assert same_rows(got, want), name
    conn.close()


def _source_count() -> int:
    """Events in the merged recording the lake is exported from."""
    return sum(_source_count_by_node().values())


def _source_count_by_node() -> dict[str, int]:
    with closing(open_reader(FLEET)) as conn:
        return {str(n): int(c) for n, c in conn.execute(
            "SELECT node, count(*) FROM events GROUP BY node")}


def test_exporting_again_replaces_never_duplicates(lakes: dict[Path, Path]) -> None:
    root = lakes[FLEET]
    before = sorted(str(f.path) for f in lake_files(root))
    with closing(open_reader(FLEET)) as conn:
        export_lake(conn, root)
    assert sorted(str(f.path) for f in lake_files(root)) == before
    with LakeDB(root) as db:
        assert db.query("SELECT count(*) FROM events").rows == [(_source_count(),)]
    assert not list(root.rglob(".tmp-*"))


def test_big_tables_go_a_chunk_at_a_time(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory stays bounded: events are read and written in row-key chunks, a file each,
    named by chunk, so exporting again still replaces rather than adds."""
    from fleetd.store import lake

    monkeypatch.setattr(lake, "CHUNK_ROWS", 1000)
    with closing(open_reader(FLEET)) as conn:
        export_lake(conn, tmp_path)
        files = sorted(str(f.path) for f in lake_files(tmp_path) if f.table == "events")
        assert len(files) >= _source_count() // 1000  # 1000 row keys a chunk
        export_lake(conn, tmp_path)
    assert sorted(str(f.path) for f in lake_files(tmp_path) if f.table == "events") == files
    with LakeDB(tmp_path) as db:
        assert dict(db.query("SELECT node, count(*) FROM events GROUP BY node").rows) == \
            _source_count_by_node()


def test_layout_is_hive_partitioned_zstd(lakes: dict[Path, Path]) -> None:
    import pyarrow.parquet as pq

    files = [f for f in lake_files(lakes[FLEET]) if f.table == "events"]
    assert {f.node for f in files} == {"node-1", "node-2", "node-3"}
    for f in files:
        rel = f.path.relative_to(lakes[FLEET]).parts
        assert rel[0] == "table=events" and rel[1] == f"node={f.node}"
        assert re.fullmatch(r"date=\d{4}-\d\d-\d\d", rel[2])
        assert re.fullmatch(r"part-.*\.parquet", rel[3])
        meta = pq.ParquetFile(f.path).metadata
        assert meta.row_group(0).column(0).compression == "ZSTD"
        # node and date live in the path only.
        assert "node" not in meta.schema.names and "date" not in meta.schema.names
    marker = json.loads((lakes[FLEET] / MARKER).read_text())
    assert marker["version"] == LAKE_VERSION


# ---- retention, pruning -------------------------------------------------------------

DAY = 86_400 * 10**9


@pytest.fixture
def dated_lake(tmp_path: Path) -> Path:
    """A node whose events span four UTC days, one lake file per day."""
    db = tmp_path / "n.db"
    t0 = 1_750_000_000 * 10**9 // DAY * DAY  # a midnight
    with BatchWriter(db, "node-a") as w:
        for d in range(4):
            w.add_events(synthetic_events(50, t0=t0 + d * DAY + 3_600 * 10**9))
    root = tmp_path / "lake"
    with closing(open_reader(db)) as conn:
        export_lake(conn, root)
    return root


def _dates(root: Path) -> list[str]:
    return sorted(f.date or "" for f in lake_files(root) if f.table == "events")


def test_retention_by_age_then_size_removes_the_oldest_first(dated_lake: Path) -> None:
    dates = _dates(dated_lake)
    assert len(dates) == 4
    # "Now" is 1 am of the last day: 2 days back is 1 am two days before, so only the
    # first day lies wholly before it.
    import datetime as dt
    last = dt.datetime.fromisoformat(dates[-1]).replace(tzinfo=dt.UTC).timestamp()
    removed = apply_retention(dated_lake, Retention(keep_days=2), now=last + 3600)
    assert _dates(dated_lake) == dates[1:] and len(removed) == 1
    assert dates[0] in str(removed[0])
    # By size: the oldest go until the rest fits.
    sizes = sorted((f.date or "", f.size) for f in lake_files(dated_lake) if f.date)
    total = sum(s for _, s in sizes)
    apply_retention(dated_lake, Retention(max_bytes=total - 1))
    assert _dates(dated_lake) == dates[2:]
    with LakeDB(dated_lake) as db:
        assert db.query("SELECT count(*) FROM events").rows == [(100,)]


def test_pruning_by_date_and_node_opens_fewer_files(dated_lake: Path) -> None:
    from fleetd.store.timeparse import parse_timestamp

    dates = _dates(dated_lake)
    since = parse_timestamp(dates[2] + "T12:00:00Z")
    with LakeDB(dated_lake, pruning=Pruning(since_ns=since)) as db:
        assert sorted(f.date or "" for f in db.files if f.table == "events") == dates[2:]
        assert db.query("SELECT count(*) FROM events").rows == [(100,)]
    # Inside DuckDB, WHERE on a partition column skips the other files unread.
    with LakeDB(dated_lake) as db:
        plan = db.conn.execute("EXPLAIN ANALYZE SELECT count(*) FROM events WHERE node = "
                               f"'node-a' AND date = '{dates[1]}'").fetchall()[0][1]
        assert "Scanning Files: 1/4" in plan, plan
    with LakeDB(dated_lake, pruning=Pruning(nodes=frozenset({"other"}))) as db:
        assert db.files == []
        assert db.query("SELECT count(*) FROM events").rows == [(0,)]


# ---- read-only and limits -----------------------------------------------------------

@pytest.mark.parametrize("sql", [
    "DELETE FROM events", "CREATE TABLE x AS SELECT 1", "COPY (SELECT 1) TO 'x.csv'",
    "SELECT * FROM read_text('/etc/passwd')", "SELECT 1; SELECT 2", "ATTACH 'x.db'",
    "SET enable_external_access = true",
])
def test_the_lake_is_read_only(lakes: dict[Path, Path], sql: str) -> None:
    with LakeDB(lakes[FLEET]) as db, pytest.raises(QueryError) as e:
        db.query(sql)
    assert e.value.code == "forbidden"


def test_time_and_row_limits(lakes: dict[Path, Path]) -> None:
    with LakeDB(lakes[FLEET]) as db:
        r = db.query("SELECT * FROM events", limits=Limits(max_rows=7))
        assert len(r.rows) == 7 and r.truncated and r.truncated_reason == "rows"
        with pytest.raises(QueryError) as e:
            db.query("SELECT count(*) FROM range(100000000000) a, events b",
                     limits=Limits(timeout_s=0.5))
        assert e.value.code == "timeout"


# ---- bad input ----------------------------------------------------------------------

def test_a_directory_that_is_not_a_lake(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a fleetd lake"):
        LakeDB(tmp_path)
    with pytest.raises(StoreError, match="does not exist"):
        LakeDB(tmp_path / "missing")
    proc = subprocess.run([FLEETD, "query", "--lake", str(tmp_path), "SELECT 1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not a fleetd lake" in proc.stderr and str(tmp_path) in proc.stderr


def test_a_lake_of_a_newer_schema_is_refused(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"format": "fleetd-lake",
                                               "version": LAKE_VERSION + 1}))
    # The version is not printed: nothing read from the marker ever is.
    with pytest.raises(StoreError, match=f"newer than this fleetd understands \\({LAKE_VERSION}"):
        LakeDB(tmp_path)


def test_a_corrupt_file_is_named_and_the_rest_answers(dated_lake: Path) -> None:
    files = sorted((f for f in lake_files(dated_lake) if f.table == "events"),
                   key=lambda f: f.date or "")
    bad = files[0].path
    bad.write_bytes(b"PAR1 not really parquet")
    with LakeDB(dated_lake) as db:
        assert len(db.warnings) == 1 and str(bad) in db.warnings[0]
        r = db.query("SELECT count(*) FROM events")
        assert r.rows == [(150,)] and str(bad) in r.warnings[0]
    proc = subprocess.run([FLEETD, "query", "--lake", str(dated_lake),
                           "SELECT count(*) AS n FROM events", "--format", "csv"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "150"
    assert str(bad) in proc.stderr and "warning" in proc.stderr


def test_export_cli_refuses_a_directory_that_is_not_a_lake(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([FLEETD, "export", "--format", "parquet", "--db", str(FLEET),
                           "-o", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a fleetd lake" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the analyzers over a lake ------------------------------------------------------

def test_analysis_over_a_lake_runs_on_a_copy_with_the_same_rows(
        lakes: dict[Path, Path], tmp_path: Path) -> None:
    from fleetd.store.lakesql import materialize

    cols = "id, node, dur_ns, pid, tid, comm, thread, op, ret, peer_pid, peer_comm, args, rank"
    for src in (FLEET, GPU):
        copy = tmp_path / f"{src.stem}.db"
        assert materialize(lakes[src], copy) == []
        got, want = (sqlite3.connect(p) for p in (copy, src))
        # The copy is of the current schema; a source of an older one has fewer columns.
        scols = ", ".join(r[1] for r in want.execute("PRAGMA table_info(sessions)"))
        for sql in (f"SELECT {cols} FROM events ORDER BY id",
                    f"SELECT {scols} FROM sessions ORDER BY id",
                    "SELECT * FROM threads ORDER BY 1, 2"):
            assert got.execute(sql).fetchall() == want.execute(sql).fetchall(), sql
        if src == GPU:
            sql = ("SELECT id, kind, name, launch_id, device, stream, dur_ns FROM gpu_activity "
                   "ORDER BY id")
            assert got.execute(sql).fetchall() == want.execute(sql).fetchall()
            sql = "SELECT id, kind, name, dur_ns FROM annotations ORDER BY id"
            assert got.execute(sql).fetchall() == want.execute(sql).fetchall()
        got.close()
        want.close()
    # The CLI: the same statistics from the lake as from the database.
    out = [subprocess.run([FLEETD, "ops", *where, "--format", "json"], capture_output=True,
                          text=True, timeout=60) for where in (["--lake", str(lakes[GPU])],
                                                                ["--db", str(GPU)])]
    assert [p.returncode for p in out] == [0, 0], out[0].stderr
    lake_rows, db_rows = (json.loads(p.stdout)["rows"] for p in out)
    assert lake_rows == db_rows and lake_rows
