"""A cluster engine reads the lake: Spark (local mode) runs the table definitions and
example queries of docs/scale-out.md over a lake written by fleetd, and gets the same
answers as DuckDB and as SQLite. One SparkSession for the file: a JVM start is slow."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lake_docs import doc_blocks, same_rows

from fleetd.export.parquet import export_lake
from fleetd.store.db import open_reader
from fleetd.store.lake import lake_files
from fleetd.store.lakesql import LakeDB

from conftest import REPO

pytestmark = pytest.mark.slow

# Three nodes of host events, and two ranks with GPU kernels: one lake, one database.
SOURCES = [REPO / "investigations" / "fleet" / "cluster.db",
           REPO / "investigations" / "gpu" / "ranks.db"]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spark") / "lake"
    for src in SOURCES:
        conn = open_reader(src)
        try:
            export_lake(conn, root)
        finally:
            conn.close()
    return root


@pytest.fixture(scope="module")
def spark(lake: Path) -> Iterator[Any]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("no Java runtime: scripts/setup.sh installs default-jre-headless")
    from pyspark.sql import SparkSession

    # A JVM that starts fast (C1 only, serial GC): this one runs a handful of tiny queries.
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", "--driver-java-options "
                          "'-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' pyspark-shell")
    session = (SparkSession.builder.master("local[1]").appName("fleetd-lake-test")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
               .config("spark.driver.memory", "512m")
               .getOrCreate())
    present = {f.table for f in lake_files(lake)}
    for table, ddl in doc_blocks("spark"):
        if table in present:
            session.sql(ddl.replace("${LAKE}", str(lake)))
    yield session
    session.stop()


def _sqlite_rows(sql: str) -> list[tuple[Any, ...]] | None:
    """The example on the sources' SQLite files, one node file after the other (they
    hold different nodes, so grouped rows simply add up)."""
    rows: list[tuple[Any, ...]] = []
    for src in SOURCES:
        conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
        try:
            rows += conn.execute(sql).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
        finally:
            conn.close()
    return rows


def test_documented_examples_agree_on_sqlite_duckdb_and_spark(lake: Path, spark: Any) -> None:
    examples = doc_blocks("example")
    assert {"calls-per-op", "kernels-per-node", "sessions-per-node"} <= {n for n, _ in examples}
    with LakeDB(lake) as db:
        for name, sql in examples:
            want = _sqlite_rows(sql)
            assert want, f"{name}: the sources hold rows for it"
            duck = db.query(sql).rows
            sparked = [tuple(r) for r in spark.sql(sql).collect()]
            assert same_rows(duck, want), f"{name}: DuckDB differs from SQLite"
            assert same_rows(sparked, want), f"{name}: Spark differs from SQLite"


def test_spark_sees_every_node_partition(lake: Path, spark: Any) -> None:
    got = {r[0]: r[1] for r in spark.sql(
        "SELECT node, count(*) FROM events GROUP BY node").collect()}
    want = {str(n): int(c) for n, c in
            _sqlite_rows("SELECT node, count(*) FROM events GROUP BY node") or []}
    assert len(want) == 5 and got == want  # node-1..3 and rank-0, rank-1
    ids = spark.sql("SELECT id FROM events WHERE node = 'node-2' ORDER BY rowkey LIMIT 1")
    assert ids.collect()[0][0] == "node-2:1"
