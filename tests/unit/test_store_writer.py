"""The batch writer: ids across restarts, pruning, load from many threads, flush on close."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from fleetd.store.schema import SEQ_BITS
from fleetd.store.writer import BatchWriter

from conftest import synthetic_events


def _ids(path: Path) -> list[str]:
    with sqlite3.connect(path) as c:
        return [r[0] for r in c.execute("SELECT id FROM events ORDER BY rowkey")]


def test_ids_are_node_namespaced_and_continue_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    with BatchWriter(path, "gpu-07") as w:
        w.add_events(synthetic_events(3))
    with BatchWriter(path, "gpu-07") as w:
        assert w.next_seq == 4
        w.add_events(synthetic_events(2))
    assert _ids(path) == [f"gpu-07:{i}" for i in range(1, 6)]
    with sqlite3.connect(path) as c:
        key = c.execute("SELECT id FROM nodes WHERE name='gpu-07'").fetchone()[0]
        lo, hi = c.execute("SELECT min(id), max(id) FROM event_data").fetchone()
    assert lo == (key << SEQ_BITS) + 1 and hi == (key << SEQ_BITS) + 5


def test_sessions_and_chain_history_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    with BatchWriter(path, "n1") as w:
        s = w.begin_session({"started_ns": 1, "mono_offset_ns": 5, "tool_version": "t",
                             "schema_version": 1, "drops": {"cuda": 0}})
        w.update_session(s, {"ended_ns": 2, "lost_events": 3})
        base = {"key": "cpu_contention:4242", "ts_ns": 1, "dur_ns": 2, "severity": "LOW",
                "root_cause": "cpu_contention", "summary": "s", "evidence": [], "fixes": ["f"]}
        w.add_chains([base, {**base, "severity": "HIGH", "summary": "worse"}])
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT id, ended_ns, lost_events, drops FROM sessions").fetchall() == [
            ("n1:1", 2, 3, '{"cuda":0}')]
        hist = c.execute("SELECT version, severity FROM chain_history ORDER BY version").fetchall()
        assert hist == [(1, "LOW"), (2, "HIGH")]
        assert c.execute("SELECT id, version, summary FROM chains").fetchall() == [
            ("n1:2", 2, "worse")]


def test_event_args_are_joined(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    with BatchWriter(path, "n1") as w:
        w.add_events(synthetic_events(4), args=[(2, {"grid": [4, 1, 1]})])
    with sqlite3.connect(path) as c:
        rows = c.execute("SELECT id, args FROM events ORDER BY rowkey").fetchall()
    assert rows[2] == ("n1:3", '{"grid":[4,1,1]}')
    assert [r[1] for r in rows if r[0] != "n1:3"] == [None, None, None]


def test_writer_under_load_from_many_threads(tmp_path: Path) -> None:
    path = tmp_path / "load.db"
    per_thread, chunk = 60_000, 1_000
    # Room for every row: what is under test is four writers at once (ids, batching),
    # not how fast the writer thread drains on a busy machine (a starved writer falls
    # behind four producers; the tracer flood test holds what a full queue costs).
    w = BatchWriter(path, "n1", batch_rows=20_000, queue_rows=4 * per_thread)
    rows = synthetic_events(chunk)

    def produce() -> None:
        for _ in range(per_thread // chunk):
            assert w.add_events(rows)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = w.close()
    assert stats.events_written == 4 * per_thread
    assert stats.queue_dropped == 0 and stats.failed_rows == 0
    assert stats.batches < 4 * per_thread // chunk  # rows really were batched
    with sqlite3.connect(path) as c:
        n, distinct = c.execute("SELECT count(*), count(DISTINCT id) FROM event_data").fetchone()
    assert n == distinct == 4 * per_thread


def test_close_flushes_everything_queued(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    w = BatchWriter(path, "n1")
    for _ in range(50):
        w.add_events(synthetic_events(100))
    w.close()
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT count(*) FROM event_data").fetchone()[0] == 5000


def test_full_queue_counts_drops_instead_of_blocking_forever(tmp_path: Path) -> None:
    w = BatchWriter(tmp_path / "n.db", "n1", queue_rows=10, put_timeout_s=0.01)
    assert w.add_events(synthetic_events(11)) is False
    stats = w.close()
    assert stats.queue_dropped == 11 and stats.events_written == 0


def test_pruning_drops_oldest_first_and_bounds_size(tmp_path: Path) -> None:
    path = tmp_path / "small.db"
    limit = 2 * 1024 * 1024
    w = BatchWriter(path, "n1", max_bytes=limit, batch_rows=5_000)
    total = 0
    for _ in range(40):
        w.add_events(synthetic_events(5_000))
        w.flush()
        total += 5_000
    assert w.used_bytes() <= limit
    stats = w.close()
    assert stats.pruned_events > 0
    with sqlite3.connect(path) as c:
        kept, first, last = c.execute(
            "SELECT count(*), min(id & 1099511627775), max(id & 1099511627775) FROM event_data"
        ).fetchone()
    assert kept + stats.pruned_events == total
    assert last == total  # the newest events survive
    assert first == stats.pruned_events + 1  # exactly the oldest ones went


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this pid now (until the kernel reuses it)


def test_a_session_whose_tracer_died_is_closed_as_crashed_on_the_next_open(
        tmp_path: Path) -> None:
    import os
    import time

    db = tmp_path / "w.db"
    emitted = iter(range(1000, 10**6, 1000))
    with BatchWriter(db, "gpu-01") as w:
        started = time.time_ns()
        dead = w.begin_session({"started_ns": started, "mono_offset_ns": 0,
                                "tool_version": "t", "schema_version": 3,
                                "targets": {"tracer_pid": _dead_pid()}})
        live = w.begin_session({"started_ns": started, "mono_offset_ns": 0,
                                "tool_version": "t", "schema_version": 3,
                                "targets": {"tracer_pid": os.getpid()}})
        unknown = w.begin_session({"started_ns": started, "mono_offset_ns": 0,
                                   "tool_version": "t", "schema_version": 3})
        w.track_session(dead, lambda: next(emitted))
        w.add_events(synthetic_events(300))
        w.flush()
        w.add_events(synthetic_events(200))
        w.flush()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT emitted_events, accounted_events FROM session_data "
                         "WHERE seq = ?", (dead,)).fetchone() == (2000, 500)
    # Reopened as a restarted tracer would: only the session whose tracer is gone closes.
    w2 = BatchWriter(db, "gpu-01")
    w2.close()
    assert w2.crashed_sessions == [dead]
    with sqlite3.connect(db) as c:
        rows = dict((r[0], r[1:]) for r in c.execute(
            "SELECT seq, end_reason, ended_ns = updated_ns, lost_events, "
            "json_extract(drops, '$.crash') FROM session_data"))
    assert rows[dead] == ("crashed", 1, 1500, 1500)
    assert rows[live][0] is None and rows[unknown][0] is None


def _on_disk(path: Path) -> int:
    """What an operator sees: the main file and its write-ahead log."""
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_the_cap_holds_for_the_main_file_and_its_wal(tmp_path: Path) -> None:
    """Pruning keeps db + -wal within the cap, as a reader queries between commits (the
    agent's pool does; a reader's snapshot can keep the WAL from being reset)."""
    path = tmp_path / "capped.db"
    cap = 4 * 2**20
    w = BatchWriter(path, "n1", max_bytes=cap)
    reader = sqlite3.connect(path)
    biggest = 0
    for _ in range(120):
        w.add_events(synthetic_events(2_000))
        w.flush()
        reader.execute("SELECT count(*) FROM event_data WHERE ts_ns > 0").fetchone()
        biggest = max(biggest, _on_disk(path))
    stats = w.close()
    reader.close()
    assert stats.pruned_events > 100_000  # the cap was reached early and held since
    assert biggest <= cap, f"{biggest} bytes on disk under a cap of {cap}"
    with sqlite3.connect(path) as c:
        kept, first = c.execute(
            "SELECT count(*), min(id & 1099511627775) FROM event_data").fetchone()
    assert first == stats.pruned_events + 1 and kept + stats.pruned_events == 240_000
