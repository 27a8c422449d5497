"""The lake's processes table carries where each process ran (lake version 2): pods
written from a node database come back from DuckDB and from a materialized copy, and a
version-1 lake, whose processes files lack the columns, still reads (NULL, no warning),
alone or beside newer files."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq

from fleetd.analyze.reading import pods
from fleetd.export.parquet import export_lake
from fleetd.store.db import open_reader
from fleetd.store.lake import LAKE_VERSION, MARKER, lake_files
from fleetd.store.lakesql import LakeDB, materialize
from fleetd.store.schema import PLACEMENT_COLUMNS, migrate

from conftest import REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "dataloader.db"
TRAINER, LOADER = 28924, 28930


def _placed_copy(dst: Path, node: str) -> Path:
    shutil.copyfile(SCENARIO, dst)
    conn = sqlite3.connect(dst, isolation_level=None)
    try:
        migrate(conn, int(conn.execute("PRAGMA user_version").fetchone()[0]))
        conn.execute("UPDATE nodes SET name = ?", (node,))
        for pid, pod in ((TRAINER, "trainer-0"), (LOADER, "loader-0")):
            conn.execute("UPDATE process_data SET cgroup = ?, runtime = 'containerd', "
                         "container = ?, container_name = ?, pod = ?, namespace = 'ml', "
                         "pod_uid = ? WHERE pid = ?",
                         (f"/kubepods/{pod}", f"{pid:064x}", pod.split("-")[0], pod,
                          f"uid-{pod}", pid))
    finally:
        conn.close()
    return dst


def _export(src: Path, root: Path) -> None:
    conn = open_reader(src)
    try:
        export_lake(conn, root)
    finally:
        conn.close()


def _placements(root: Path) -> tuple[dict[tuple[str, int], tuple[object, ...]], list[str]]:
    with LakeDB(root) as db:
        rows = db.query(f"SELECT node, pid, {', '.join(PLACEMENT_COLUMNS)} FROM processes").rows
        return {(str(r[0]), int(r[1])): tuple(r[2:]) for r in rows}, list(db.warnings)


def _as_version_1(root: Path, node: str | None = None) -> None:
    """Rewrite the processes files (of ``node``, or all) as lake version 1 wrote them."""
    for f in lake_files(root, ["processes"]):
        if node is None or f.node == node:
            table = pq.read_table(f.path)
            pq.write_table(table.drop_columns(list(PLACEMENT_COLUMNS)), f.path)
    if node is None:
        (root / MARKER).write_text(json.dumps({"format": "fleetd-lake", "version": 1}))


def test_pods_travel_through_the_lake(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    _export(_placed_copy(tmp_path / "a.db", "pods-01"), root)
    assert json.loads((root / MARKER).read_text())["version"] == LAKE_VERSION == 2
    got, warnings = _placements(root)
    assert warnings == []
    assert got[("pods-01", TRAINER)] == ("/kubepods/trainer-0", "containerd",
                                         f"{TRAINER:064x}", "trainer", "trainer-0", "ml",
                                         "uid-trainer-0")
    assert got[("pods-01", LOADER)][4:6] == ("loader-0", "ml")
    assert all(v == (None,) * 7 for k, v in got.items() if k[1] not in (TRAINER, LOADER))
    # Analysis over the lake runs on a materialized copy: --pod selects there too.
    copy = tmp_path / "copy.db"
    assert materialize(root, copy) == []
    conn = open_reader(copy)
    try:
        assert pods.select(conn, "ml/trainer-0", None) == {TRAINER}
        assert pods.select(conn, None, "ml") == {TRAINER, LOADER}
    finally:
        conn.close()


def test_a_version_1_lake_reads_its_processes_as_unplaced(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    _export(_placed_copy(tmp_path / "a.db", "pods-01"), root)
    _as_version_1(root)
    got, warnings = _placements(root)
    assert warnings == []  # not 'lacks column(s)': the files are kept
    assert len(got) == 5 and set(got.values()) == {(None,) * 7}
    copy = tmp_path / "copy.db"
    assert materialize(root, copy) == []
    conn = open_reader(copy)
    try:
        assert conn.execute("SELECT count(*) FROM processes").fetchone()[0] == 5
        assert pods.select(conn, "ml/trainer-0", None) == set()
    finally:
        conn.close()


def test_old_and_new_processes_files_side_by_side(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    _export(_placed_copy(tmp_path / "a.db", "old-01"), root)
    _as_version_1(root, "old-01")
    _export(_placed_copy(tmp_path / "b.db", "new-02"), root)
    got, warnings = _placements(root)
    assert warnings == []
    assert got[("old-01", TRAINER)] == (None,) * 7
    assert got[("new-02", TRAINER)][4:6] == ("trainer-0", "ml")


def test_a_file_lacking_an_older_column_is_still_left_out(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    _export(_placed_copy(tmp_path / "a.db", "pods-01"), root)
    for f in lake_files(root, ["processes"]):
        pq.write_table(pq.read_table(f.path).drop_columns(["exe"]), f.path)
    got, warnings = _placements(root)
    assert got == {} and len(warnings) == 1 and "lacks column(s) exe" in warnings[0]
