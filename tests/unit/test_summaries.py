"""Per-second summaries (fleetd.store.summaries): made by the writer in its idle time,
trusted by a reader only while they still describe the file, and never an answer of
their own: every read here is compared with the same read of the events alone.

Recordings are written through the store's writer (threads sleeping, waiting in the
run queue, calling CUDA), or are the shipped scenarios (real ``fleetd trace`` output)
summed as the writer would have.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.data import Node, effective_span, nodes
from fleetd.analyze.reading.sums import Sum, event_sums
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader, open_writer
from fleetd.store.summaries import LAG_S, SEC_NS, STEP_S, summarize_all, summed_runs
from fleetd.store.writer import BatchWriter

REPO = Path(__file__).resolve().parents[2]
T0 = 1_750_000_000 * SEC_NS + 123_456_789  # not on a second: the first one is a piece
MS = 10**6
SECONDS = 12


def _events(seconds: int, t0: int = T0) -> list[tuple[int, ...]]:
    """Two threads: one sleeping (futex, then read) and waiting in the run queue, one
    calling cudaStreamSynchronize and failing a cudaMalloc now and then."""
    out: list[tuple[int, ...]] = []
    sync, malloc = op_code("cudaStreamSynchronize"), op_code("cudaMalloc")
    for k in range(seconds * 50):
        at = t0 + k * 20 * MS
        nr = 202 if k % 3 else 0  # futex, or read
        out.append((at, 7 * MS + k, 10, 11, op_code("off_cpu"), nr + 1, 0, 0, 1, 0, 0))
        out.append((at + 7 * MS + k, 300_000, 10, 11, op_code("runq_wait"), nr + 1, 0, 0, 1,
                    0, 0))
        out.append((at + MS, 4 * MS + 3 * k, 10, 12, sync, 0, 0, 0, 0, 0, 0))
        out.append((at + 6 * MS, 90_000, 10, 12, malloc, 2 if k % 7 == 0 else 0, 4096, 0,
                    0, 0, 0))
        out.append((at + 8 * MS, 0, 10, 12, op_code("wakeup"), 0, 0, 11, 0, 0, 0))
    out.sort(key=lambda r: r[0])
    return out


def _record(path: Path, seconds: int = SECONDS, t0: int = T0) -> Path:
    with BatchWriter(path, "gpu-01") as w:
        w.add_processes([{"pid": 10, "comm": "python", "ppid": None}])
        w.add_tasks([(11, 10, "python"), (12, 10, "pt_main")])
        w.add_events(_events(seconds, t0))  # type: ignore[arg-type]
    return path


def _node(conn: sqlite3.Connection) -> Node:
    return nodes(conn)[0]


def _both(conn: sqlite3.Connection, win: Window, pid: int | None = None
          ) -> tuple[list[Sum], list[Sum]]:
    """The grouped read with the summaries and from the events alone."""
    node = _node(conn)
    return event_sums(conn, node, win, pid), event_sums(conn, node, win, pid, runs=[])


def _windows() -> list[Window]:
    end = T0 + SECONDS * SEC_NS
    return [Window(T0 - SEC_NS, end + SEC_NS, "all"),
            Window(T0 + 2 * SEC_NS + 517 * MS, T0 + 9 * SEC_NS + 3 * MS, "ragged"),
            Window(T0 + 3 * SEC_NS + 1, T0 + 3 * SEC_NS + 900 * MS, "inside one second")]


def test_the_writer_sums_every_second_it_stored_by_the_time_it_closes(tmp_path: Path) -> None:
    db = _record(tmp_path / "w.db")
    conn = open_reader(db)
    try:
        secs = [s for (s,) in conn.execute("SELECT sec FROM second_cover ORDER BY sec")]
        assert secs == list(range(T0 // SEC_NS, (T0 + SECONDS * SEC_NS) // SEC_NS + 1))
        total = conn.execute("SELECT sum(n) FROM second_cover").fetchone()[0]
        assert total == conn.execute("SELECT count(*) FROM event_data").fetchone()[0]
        for win in _windows():
            with_sums, raw = _both(conn, win)
            assert with_sums == raw and raw, win.label
            assert _both(conn, win, pid=10) == (raw, raw)
            node = _node(conn)
            assert effective_span(conn, node, win) == effective_span(conn, node, win, [])
        runs = summed_runs(conn, 1, *(lambda w: (w.start_ns, w.end_ns))(_windows()[1]))
        assert runs == [(T0 // SEC_NS + 3, T0 // SEC_NS + 8)]  # whole seconds only
    finally:
        conn.close()


def test_a_second_changed_since_it_was_summed_is_read_from_its_events(tmp_path: Path) -> None:
    db = _record(tmp_path / "w.db")
    sec = T0 // SEC_NS + 5
    conn = open_writer(db)
    try:
        # A late record (a long sleep written when it ended) lands in a summed second,
        # and another second loses an event: both are read raw, the rest summed.
        conn.execute("INSERT INTO event_data(ts_ns, dur_ns, pid, tid, op, ret, bytes, peer, "
                     "a0, a1, stack) SELECT ?, 3000000000, 10, 11, op, ret, 0, 0, 1, 0, 0 "
                     "FROM event_data WHERE op = ? LIMIT 1",
                     (sec * SEC_NS + 5, op_code("off_cpu")))
        conn.execute("DELETE FROM event_data WHERE id = (SELECT min(id) FROM event_data "
                     "WHERE ts_ns >= ?)", ((sec + 3) * SEC_NS,))
        win = _windows()[0]
        runs = summed_runs(conn, 1, win.start_ns, win.end_ns)
        covered = {s for a, b in runs for s in range(a, b + 1)}
        assert sec not in covered and sec + 3 not in covered
        assert {sec - 1, sec + 1, sec + 2, sec + 4} <= covered
        with_sums, raw = _both(conn, win)
        assert with_sums == raw
        late = [s for s in raw if s.tid == 11 and s.top == 3 * SEC_NS]
        assert late, "the late record is counted"
    finally:
        conn.close()


def test_pruning_forgets_the_summaries_of_what_it_deleted(tmp_path: Path) -> None:
    db = _record(tmp_path / "w.db")
    conn = open_writer(db)
    try:
        first = conn.execute("SELECT min(sec) FROM second_cover").fetchone()[0]
        from fleetd.store.pruning import Pruner
        cut = conn.execute("SELECT min(id) FROM event_data WHERE ts_ns >= ?",
                           ((first + 4) * SEC_NS,)).fetchone()[0]
        pruner = Pruner(conn, 1 << 40, (2 << 40) - 1, 1, 10_000)
        assert pruner._delete_below(cut)
        assert conn.execute("SELECT min(sec) FROM second_cover").fetchone()[0] >= first + 3
        assert conn.execute("SELECT count(*) FROM second_sums WHERE sec < ?",
                            (first + 3,)).fetchone()[0] == 0
        assert _both(conn, _windows()[0])[0] == _both(conn, _windows()[0])[1]
    finally:
        conn.close()


def test_a_live_writer_sums_while_idle_lag_behind_the_newest(tmp_path: Path) -> None:
    """Seconds are summed LAG_S behind the newest event, while the writer is idle (the
    writer's own thread, no call from the test), a step of STEP_S at a time."""
    now = T0 + 100 * SEC_NS
    span = LAG_S + 3 * STEP_S
    with BatchWriter(tmp_path / "live.db", "gpu-01") as w:
        w.add_events(_events(span, now))  # type: ignore[arg-type]
        assert w.flush()
        conn = open_reader(tmp_path / "live.db")
        try:
            deadline = time.monotonic() + 30
            want = (now + span * SEC_NS) // SEC_NS - LAG_S - now // SEC_NS + 1
            while time.monotonic() < deadline:
                got = conn.execute("SELECT count(*) FROM second_cover").fetchone()[0]
                if got >= want:
                    break
                time.sleep(0.05)
            assert got == want  # and not the last LAG_S seconds yet
        finally:
            conn.close()
        assert w.stats.summary_cpu_ns > 0


def test_a_file_without_summaries_reads_as_before(tmp_path: Path) -> None:
    db = _record(tmp_path / "w.db")
    conn = open_writer(db)
    conn.execute("DELETE FROM second_sums")
    conn.execute("DELETE FROM second_cover")
    try:
        assert summed_runs(conn, 1, T0, T0 + SECONDS * SEC_NS) == []
        win = _windows()[1]
        assert _both(conn, win)[0] == _both(conn, win)[1]
    finally:
        conn.close()


SCENARIOS = sorted((REPO / "tests" / "data" / "scenarios").glob("*.db"))


@pytest.mark.parametrize("src", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_a_shipped_recording_summed_reads_the_same(src: Path, tmp_path: Path) -> None:
    """Real ``fleetd trace`` output: the model's grouped read, span and breakdown with
    the summaries are those of the events alone, over the whole recording and a window
    with ragged edges."""
    db = tmp_path / src.name
    shutil.copy(src, db)
    conn = open_writer(db)
    try:
        for node in nodes(conn):
            summarize_all(conn, node.key)
        for node in nodes(conn):
            lo, hi = conn.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data WHERE id "
                                  "BETWEEN ? AND ?", (node.lo, node.hi)).fetchone()
            for win in (Window(lo, hi + 1, "all"),
                        Window(lo + (hi - lo) // 5 + 1, hi - (hi - lo) // 7, "ragged")):
                summed = NodeSlice(conn, node, win)
                assert summed.summed, (src.stem, win.label)
                raw = NodeSlice(conn, node, win)
                raw.__dict__["summed"] = []  # the same model, the summaries left unread
                assert summed.sums == raw.sums
                assert summed.span == raw.span
                assert summed.threads == raw.threads
    finally:
        conn.close()


def test_explain_of_a_summed_recording_is_that_of_its_events(tmp_path: Path) -> None:
    """Through the command a user types: ``fleetd explain`` of a scenario as the
    writer would have left it (summed) and as shipped (none) print the same JSON."""
    src = REPO / "tests" / "data" / "scenarios" / "alloc_churn.db"
    db = tmp_path / "summed.db"
    shutil.copy(src, db)
    conn = open_writer(db)
    summarize_all(conn, nodes(conn)[0].key)
    assert conn.execute("SELECT count(*) FROM second_cover").fetchone()[0] > 0
    conn.close()

    def explain(path: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "fleetd", "explain", "--db", str(path),
                               "--format", "json", "--quiet"], capture_output=True,
                              text=True, timeout=300, check=True)
        return done.stdout

    assert explain(db) == explain(src)


def test_a_step_holds_at_most_its_rows_but_one_second_whole(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Under a flood five seconds were over a million events: a step that long held the
    writer back while its queue filled. A step stops at STEP_ROWS events, yet always
    sums its first second whole."""
    import fleetd.store.summaries as summaries

    db = _record(tmp_path / "w.db", seconds=6)  # 250 events a second
    conn = open_writer(db)
    try:
        conn.execute("DELETE FROM second_sums")
        conn.execute("DELETE FROM second_cover")
        monkeypatch.setattr(summaries, "STEP_ROWS", 600)
        s = summaries.Summarizer(conn, 1, backfill=True)
        first = s.next_sec
        assert s.step(lag_s=0)
        assert [r[0] for r in conn.execute("SELECT sec FROM second_cover ORDER BY sec")] == [
            first, first + 1]  # 2 x 250 fit in 600, a third would not
        monkeypatch.setattr(summaries, "STEP_ROWS", 10)
        assert s.step(lag_s=0)
        assert conn.execute("SELECT max(sec) FROM second_cover").fetchone()[0] == first + 2
        s.finish()
        win = _windows()[0]
        assert _both(conn, win)[0] == _both(conn, win)[1]
    finally:
        conn.close()
