"""Untrusted SQL: every hostile statement is refused or cut off, and the file is unchanged."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hostile import HOSTILE

from fleetd.errors import QueryError, UsageError
from fleetd.store.guard import Limits, SafeDB


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def guarded(small_db: Path) -> SafeDB:
    return SafeDB(small_db, Limits(timeout_s=0.5))


def test_the_hostile_table_is_large_enough() -> None:
    assert len(HOSTILE) >= 25


@pytest.mark.parametrize(("sql", "code"), HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_hostile_sql_is_refused_and_changes_nothing(
    guarded: SafeDB, small_db: Path, sql: str, code: str
) -> None:
    before = _digest(small_db)
    started = time.monotonic()
    with pytest.raises(QueryError) as info:
        guarded.query(sql)
    assert info.value.code == code, info.value.message
    assert info.value.message and info.value.hint
    assert time.monotonic() - started < 3.0  # stopped near its 0.5 s deadline, not hung
    # The connection is still usable and the data untouched.
    assert guarded.query("SELECT count(*) FROM event_data").rows == [(400,)]
    guarded.close()
    assert _digest(small_db) == before
    assert not Path("/tmp/fleetd-evil.db").exists()
    assert not Path("/tmp/fleetd-evil-copy.db").exists()
    assert not Path("/tmp/fleetd-evil.txt").exists()


def test_reads_and_read_only_pragmas_work(guarded: SafeDB) -> None:
    res = guarded.query("SELECT op, count(*) FROM events GROUP BY op ORDER BY op")
    assert res.columns == ["op", "count(*)"]
    assert dict(res.rows) == {"cudaLaunchKernel": 100, "cudaMemcpyAsync": 100,
                              "cudaStreamSynchronize": 100, "off_cpu": 100}
    assert any(r[1] == "ts_ns" for r in guarded.query("PRAGMA table_info(events)").rows)
    assert not res.truncated


def test_parameters_are_bound_not_formatted(guarded: SafeDB) -> None:
    evil = "x'; DROP TABLE event_data; --"
    assert guarded.query("SELECT count(*) FROM events WHERE op = ?", [evil]).rows == [(0,)]
    assert guarded.query("SELECT ? AS v", [evil]).rows == [(evil,)]


def test_row_limit_truncates(guarded: SafeDB) -> None:
    res = guarded.query("SELECT * FROM events", limits=guarded.limits.lowered(max_rows=7))
    assert len(res.rows) == 7 and res.truncated and res.truncated_reason == "rows"


def test_byte_limit_truncates(guarded: SafeDB) -> None:
    res = guarded.query("SELECT hex(randomblob(1000)) FROM event_data",
                        limits=guarded.limits.lowered(max_bytes=10_000))
    assert res.truncated and res.truncated_reason == "bytes"
    assert 4 <= len(res.rows) <= 5


def test_a_request_may_lower_limits_but_never_raise_them() -> None:
    ceiling = Limits(timeout_s=2.0, max_rows=100, max_bytes=1000)
    raised = ceiling.lowered(timeout_s=60, max_rows=10**9, max_bytes=10**12)
    assert raised == ceiling
    lowered = ceiling.lowered(timeout_s=0.1, max_rows=5, max_bytes=10)
    assert (lowered.timeout_s, lowered.max_rows, lowered.max_bytes) == (0.1, 5, 10)
    for bad in (0, -1, "5", True):
        with pytest.raises(UsageError):
            ceiling.lowered(max_rows=bad)  # type: ignore[arg-type]


def _drain(gen: Any) -> tuple[list[str], list[list[Any]], Any, int]:
    """(columns, rows, end, largest piece) of a SafeDB.stream generator."""
    columns, rows, biggest = next(gen), [], 0
    while True:
        try:
            piece = next(gen)
        except StopIteration as stop:
            return columns, rows, stop.value, biggest
        biggest = max(biggest, len(piece))
        rows += [json.loads(line) for line in piece.splitlines()]


def test_stream_gives_the_rows_of_query_in_bounded_pieces(guarded: SafeDB) -> None:
    sql = "SELECT id, op, dur_ns, hex(randomblob(20)) FROM events ORDER BY rowkey"
    whole = guarded.query("SELECT id, op, dur_ns FROM events ORDER BY rowkey")
    columns, rows, end, biggest = _drain(guarded.stream(sql, chunk_bytes=2000))
    assert columns[:3] == whole.columns and [tuple(r[:3]) for r in rows] == whole.rows
    assert end.rows == len(rows) and not end.truncated
    assert biggest < 2000 + 200  # a piece is one row past the chunk size at most


@pytest.mark.parametrize(("limits", "reason"), [({"max_rows": 7}, "rows"),
                                                ({"max_bytes": 10_000}, "bytes")])
def test_stream_is_cut_by_the_same_limits(guarded: SafeDB, limits: dict[str, int],
                                          reason: str) -> None:
    lim = guarded.limits.lowered(**limits)
    sql = "SELECT hex(randomblob(1000)) FROM event_data"
    _, rows, end, _ = _drain(guarded.stream(sql, limits=lim))
    cut = guarded.query(sql, limits=lim)
    assert end.truncated and end.truncated_reason == reason == cut.truncated_reason
    assert end.rows == len(rows) == len(cut.rows)


def test_stream_refuses_writes_before_its_columns(guarded: SafeDB) -> None:
    with pytest.raises(QueryError) as err:
        next(guarded.stream("DELETE FROM event_data"))
    assert err.value.code == "forbidden"
    assert guarded.query("SELECT 1").rows == [(1,)]  # the connection is usable after
