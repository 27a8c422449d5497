"""A node's call rate is counted over the time its job was feeding the GPU, not over
everything its tracer saw: a node whose tracing began before the job (waiting at a barrier,
loading data, or just started first) is not a straggler for that idle time.

Built from the real recording tests/data/scenarios/quiet.db, with 20 s of idle scheduler
events of an unrelated task added before the job's first CUDA call.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from fleetd.analyze.facade import Analysis
from fleetd.store.catalog import op_code
from fleetd.store.db import open_reader

from conftest import REPO

RECORDED = REPO / "tests" / "data" / "scenarios" / "quiet.db"
IDLE_NS = 20_000_000_000


def _profile(db: Path) -> dict[str, object]:
    conn = open_reader(db)
    try:
        out = Analysis.of(conn).profile("rec-01")
    finally:
        conn.close()
    return out


def _with_idle_lead(tmp_path: Path) -> Path:
    """The recording, plus one off-CPU event of another task every 100 ms for 20 s before
    the first event: a tracer that started 20 s before its job."""
    db = tmp_path / "early.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as c:
        first, top = c.execute("SELECT min(ts_ns), max(id) FROM event_data").fetchone()
        off_cpu = op_code("off_cpu")
        rows = [(top + 1 + i, first - IDLE_NS + i * 100_000_000, 50_000_000, 1, 1, off_cpu,
                 0, 0, 0, 0, 0, 0) for i in range(IDLE_NS // 100_000_000)]
        c.executemany("INSERT INTO event_data VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    return db


def test_rates_ignore_the_idle_time_before_the_job(tmp_path: Path) -> None:
    plain, early = _profile(RECORDED), _profile(_with_idle_lead(tmp_path))
    # The node's span grew by the 20 s of idle lead: the rates did not fall with it.
    assert float(early["span_s"]) > float(plain["span_s"]) + 19  # type: ignore[arg-type]
    for rate in ("cuda_calls_per_s", "launches_per_s"):
        a = plain["features"][rate]  # type: ignore[index]
        b = early["features"][rate]  # type: ignore[index]
        assert a > 100 and abs(a - b) / a < 0.01, (rate, a, b)
