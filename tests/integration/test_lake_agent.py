"""The agent's lake (fleetd agent --parquet-dir): segments close every interval while the
database grows, kill -9 leaves every closed segment readable and nothing half-written
visible, and a restart continues without losing or duplicating a row.

The agents run for real (subprocesses on loopback): one tracing the reference CUDA
workload with BPF; one serving a database that grows through the store's own
BatchWriter in this process, so that rows can be added while it is down."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from agents import agent
from workload_run import running_workload

from fleetd.store.db import open_reader
from fleetd.store.lake import lake_files
from fleetd.store.lakesql import LakeDB
from fleetd.store.writer import BatchWriter

from conftest import synthetic_events


def _segments(root: Path) -> list[Path]:
    return sorted(f.path for f in lake_files(root) if f.table == "events")


def _db_events(db: Path) -> int:
    conn = open_reader(db)
    try:
        return int(conn.execute("SELECT count(*) FROM event_data").fetchone()[0])
    finally:
        conn.close()


def _lake_rowkeys(root: Path) -> list[int]:
    keys: list[int] = []
    for f in _segments(root):
        keys += pq.read_table(f, columns=["rowkey"]).column("rowkey").to_pylist()
    return keys


def test_segments_close_survive_kill_9_and_resume(tmp_path: Path) -> None:
    db, lake = tmp_path / "node-a.db", tmp_path / "lake"
    writer = BatchWriter(db, "node-a")
    writer.add_processes([{"pid": 4242, "comm": "train_loop", "rank": 0, "world_size": 1}])
    writer.add_tasks([(4242, 4242, "train_loop"), (4243, 4242, "dataloader")])
    writer.add_events(synthetic_events(100))
    writer.flush()
    flags = ("--no-trace", "--parquet-dir", str(lake), "--parquet-every", "1s")
    try:
        with agent(db, "node-a", None, *flags) as a:
            seen: list[int] = []
            deadline = time.monotonic() + 4.5
            while time.monotonic() < deadline:
                writer.add_events(synthetic_events(40))
                writer.flush()
                seen.append(len(_segments(lake)))
                time.sleep(0.2)
            # Segments appeared while the database grew, not only at the end.
            assert len(set(seen)) >= 3, seen
            assert seen[-1] >= 3
            # What a kill in the middle of a write leaves: a temporary file beside the
            # closed ones. Readers never list it.
            part_dir = _segments(lake)[0].parent
            (part_dir / ".tmp-deadbeef-part-s000000-000000099999.parquet").write_bytes(
                b"PAR1 half a file")
            a.stop(signal.SIGKILL)
        # Every closed segment is whole; no row twice.
        for f in _segments(lake):
            pq.read_table(f)
        keys = _lake_rowkeys(lake)
        assert len(keys) == len(set(keys)) and 0 < len(keys) <= _db_events(db)
        with LakeDB(lake) as ldb:
            assert ldb.warnings == []
            assert ldb.query("SELECT count(*) FROM events").rows == [(len(keys),)]
        # More rows while the agent is down, then a restart and a clean stop: the lake
        # holds every row of the database exactly once.
        writer.add_events(synthetic_events(70))
        writer.flush()
        with agent(db, "node-a", None, *flags) as a:
            assert a.stop(signal.SIGTERM) == 0
        keys = _lake_rowkeys(lake)
        assert len(keys) == len(set(keys)) == _db_events(db)
        assert not list(lake.rglob(".tmp-*")), "the restart cleans what the kill left"
        with LakeDB(lake) as ldb:
            assert ldb.query("SELECT count(*) FROM processes").rows == [(1,)]
            assert ldb.query("SELECT count(*) FROM threads").rows == [(2,)]
    finally:
        writer.close()


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The reference workload, a steady ~2k CUDA calls/s for up to a minute."""
    with running_workload(tmp_path / "go", "--duration", "60", "--launches", "8", "--memcpy",
                          "1", "--cpu-us", "50", "--gpu-ms", "2") as proc:
        (tmp_path / "go").touch()
        yield proc


@pytest.mark.bpf
@pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")
def test_segments_appear_every_interval_while_tracing(
        tmp_path: Path, workload: subprocess.Popen[str]) -> None:
    db, lake = tmp_path / "gpu-01.db", tmp_path / "lake"
    with agent(db, "gpu-01", None, "--pid", str(workload.pid), "--sample", "1",
               "--parquet-dir", str(lake), "--parquet-every", "1s") as a:
        counts: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len({n for n in counts if n}) < 3:
            counts.append(len(_segments(lake)))
            time.sleep(0.25)
        # Three different non-empty counts: segments kept closing while it traced.
        assert len({n for n in counts if n}) >= 3, (counts, a.log.read_text()[-2000:])
        assert a.stop(signal.SIGTERM) == 0
    keys = _lake_rowkeys(lake)
    assert len(keys) == len(set(keys)) == _db_events(db) > 0
    with LakeDB(lake) as ldb:
        (ops,) = ldb.query("SELECT count(DISTINCT op) FROM events WHERE source = 'cuda'"
                           ).rows[0]
        assert ops >= 2
        assert ldb.query("SELECT count(*) FROM sessions").rows == [(1,)]
