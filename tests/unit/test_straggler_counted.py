"""A node's call rate is the calls counted over the span they were counted in, so a live
agent and the same data in a file give one verdict.

A sampling tracer (the default, ``--sample 100``) stores one call in a hundred as an event
and counts every call in histograms it writes every 10 s. A live agent's newest calls are
in no histogram yet while their sampled events are already stored: counting the written
histograms over the events' span made the live rate fall with the unwritten part (the
demo's node-3 at 0.70 live, 0.81 from the merged file of the same run).

Built from the real recording tests/data/scenarios/quiet.db (one 6 s histogram window,
sample 100): its window split in two at the middle of the calls, each half with the
share of the calls the stored events put there, is the complete file; the file without
the second half is the live agent before its next write.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

from fleetd.analyze.facade import Analysis
from fleetd.store.bounds import Bounds
from fleetd.store.db import open_reader

from conftest import REPO

RECORDED = REPO / "tests" / "data" / "scenarios" / "quiet.db"


def _profile(db: Path) -> dict[str, Any]:
    conn = open_reader(db)
    try:
        return Analysis.of(conn).profile("rec-01")
    finally:
        conn.close()


def _split_histograms(tmp_path: Path) -> tuple[Path, Path]:
    """(the complete file, the live agent's file): the recording's histogram window cut
    at the middle of the stored calls; the live one lacks the second part."""
    complete = tmp_path / "complete.db"
    shutil.copy(RECORDED, complete)
    with sqlite3.connect(complete) as c:
        (ts, dur), = c.execute("SELECT DISTINCT ts_ns, dur_ns FROM aggregate_data")
        lo, hi = c.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data WHERE pid IN "
                           "(SELECT pid FROM aggregate_data WHERE bucket = -1 AND "
                           "pid != 0)").fetchone()
        mid = (lo + hi) // 2
        rows = c.execute("SELECT node, session, pid, op, bucket, count, sum "
                         "FROM aggregate_data").fetchall()
        c.execute("DELETE FROM aggregate_data")
        for node, session, pid, op, bucket, count, total in rows:
            before, after = c.execute(
                "SELECT sum(ts_ns < ?), sum(ts_ns >= ?) FROM event_data WHERE pid IS ? "
                "AND op = ?", (mid, mid, pid, op)).fetchone()
            share = (before or 0) / max(1, (before or 0) + (after or 0)) if after else 1.0
            first = round(count * share)
            c.executemany("INSERT INTO aggregate_data VALUES (?,?,?,?,?,?,?,?,?)", [
                (node, session, ts, mid - ts, pid, op, bucket, first, round(total * share)),
                (node, session, mid, ts + dur - mid, pid, op, bucket, count - first,
                 total - round(total * share))])
    live = tmp_path / "live.db"
    shutil.copy(complete, live)
    with sqlite3.connect(live) as c:
        c.execute("DELETE FROM aggregate_data WHERE ts_ns = ?", (mid,))
    return complete, live


def test_live_rate_is_counted_over_the_written_histograms(tmp_path: Path) -> None:
    complete, live = _split_histograms(tmp_path)
    whole, partial = _profile(complete), _profile(live)
    assert whole["counted_from"] == partial["counted_from"] == "histograms"
    # The live agent's calls were counted over the first part only, and so is its rate.
    assert partial["rate_span_s"] < 0.7 * whole["rate_span_s"], (partial, whole)
    for rate in ("cuda_calls_per_s", "launches_per_s"):
        a, b = whole["features"][rate], partial["features"][rate]
        assert a > 100 and abs(a - b) / a < 0.1, (rate, a, b)


def _without_histograms(tmp_path: Path, *more_sql: str) -> Path:
    """The recording as its agent holds it before writing its first histograms."""
    db = tmp_path / "first-seconds.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        for sql in ("DELETE FROM aggregate_data", *more_sql):
            c.execute(sql)
    return db


def test_no_histogram_yet_means_no_rate_not_a_hundredth(tmp_path: Path) -> None:
    prof = _profile(_without_histograms(tmp_path))
    # The stored calls are 1 in 100 (sample 100): no rate can be told from them.
    assert prof["features"]["cuda_calls_per_s"] is None
    assert prof["features"]["launches_per_s"] is None and prof["counted_from"] is None
    # The shares come from the scheduler events, which are all stored.
    assert prof["features"]["runq_share"] is not None


def test_unsampled_events_are_every_call(tmp_path: Path) -> None:
    # As if the tracer had kept every call (--sample 1): the events are the count.
    db = _without_histograms(
        tmp_path, "UPDATE session_data SET targets = json_set(targets, '$.sample', 1)")
    prof, full = _profile(db), _profile(RECORDED)
    assert prof["counted_from"] == "events"
    # The recording's events are really a sample (1 in 100 launches; slow calls and
    # errors are always kept), so their rate is a fraction of the histograms'.
    ratio = prof["features"]["cuda_calls_per_s"] / full["features"]["cuda_calls_per_s"]
    assert 0 < ratio < 0.3, ratio


def test_a_window_edge_through_a_histogram_counts_the_calls_on_its_side(
        tmp_path: Path) -> None:
    # The tracer began 6 s before the job: its histogram window spans 12 s, the calls
    # only its second half. A window from the job's second second on holds about 5/6
    # of the calls, not the share of the histogram window's time inside it.
    db = tmp_path / "early-tracer.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE aggregate_data SET ts_ns = ts_ns - 6000000000, "
                  "dur_ns = dur_ns + 6000000000")
        first, last = c.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data").fetchone()
    whole = _profile(db)
    conn = open_reader(db)
    try:
        window = Bounds.parse(from_=str(first + 10**9), to=str(last))
        later = Analysis.of(conn, window).profile("rec-01")
    finally:
        conn.close()
    a, b = whole["features"]["cuda_calls_per_s"], later["features"]["cuda_calls_per_s"]
    assert a > 100 and abs(a - b) / a < 0.1, (a, b)
