"""The window's timed events summed per thread, op and wait: one grouped read shared.

Op statistics (per process and op: count, total, largest, failures), the per-thread
breakdown (off-CPU and run-queue time by scheduler state and wait reason, IRQ time,
CUDA calls, reclaim stalls) and the stall finder (each thread's first and last CUDA
call) all sum the same rows. Grouping costs a sort of every row in SQLite, so they
share one: :func:`event_sums` groups the timed events by thread, process, op and, for
off-CPU and run-queue records, state and wait reason, and each reader adds up the groups
it needs.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from fleetd.analyze.reading.data import Node, code, in_window
from fleetd.analyze.reading.waits import sql_reason
from fleetd.analyze.reading.window import Window
from fleetd.store.summaries import (
    SPAN_WHERE,
    STATE_SQL,
    SUMMED_TOTALS_SQL,
    TIMED_CODES,
    TIMED_SQL,
    TOTALS_SQL,
    WAIT_CODES,
    SecRun,
    codes_sql,
    raw_spans,
    summed_runs,
)

SYSCALL = code("syscall")
__all__ = ["SYSCALL", "TIMED_CODES", "Sum", "event_sums"]
_WAITS = f"op IN {codes_sql(WAIT_CODES)}"


@dataclass(frozen=True, slots=True)
class Sum:
    """The timed events of one thread, process and op (and, for off-CPU and run-queue
    records, scheduler state ``a0 & 255`` and wait reason; 0 and "" otherwise)."""

    tid: int
    pid: int
    op: int
    state: int
    why: str
    count: int
    total: int  # sum of dur_ns
    top: int  # the largest dur_ns
    failed: int  # of them with an error (ops that keep one)
    nbytes: int  # a reclaim or compaction run's ns stalled (bytes), summed; 0 for others
    first: int  # the first one's start
    last_end: int  # the latest end


def event_sums(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
               runs: list[SecRun] | None = None) -> list[Sum]:
    """The groups in (tid, pid, op, state, why) order. The whole seconds the writer
    summed (``runs``, :func:`~fleetd.store.summaries.summed_runs`, found here when not
    given) are added up from their summaries, the rest of the window from its events:
    one sort of the rows where there are none."""
    if runs is None:
        runs = summed_runs(conn, node.key, win.start_ns, win.end_ns)
    pid_sql, pid_params = ("", []) if pid is None else (" AND pid = ?", [pid])
    rows: list[tuple[Any, ...]] = []
    parts = 0
    for first, last in runs:
        rows += conn.execute(
            f"SELECT tid, pid, op, state, CASE WHEN {_WAITS} THEN {sql_reason('wret')} ELSE "
            f"'' END, {SUMMED_TOTALS_SQL} FROM second_sums WHERE node = ? AND sec BETWEEN ? "
            f"AND ?{pid_sql} GROUP BY 1, 2, 3, 4, 5", [node.key, first, last, *pid_params])
        parts += 1
    # The whole window as every reader walks it; pieces of it through the time index.
    where = (SPAN_WHERE if runs else in_window(node, win)[0]) + pid_sql
    for lo, hi in raw_spans(win.start_ns, win.end_ns, runs):
        rows += conn.execute(
            f"SELECT tid, pid, op, {STATE_SQL}, CASE WHEN {_WAITS} THEN {sql_reason()} ELSE "
            f"'' END, {TOTALS_SQL} FROM event_data WHERE {where} AND {TIMED_SQL} "
            "GROUP BY 1, 2, 3, 4, 5", [lo, hi, node.lo, node.hi, *pid_params])
        parts += 1
    return [Sum(*row) for row in (rows if parts == 1 else _merged(rows))]


def _merged(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Groups of several reads added up per key, in key order (as one GROUP BY gives)."""
    out: dict[tuple[Any, ...], list[Any]] = {}
    for row in rows:
        key = row[:5]
        have = out.get(key)
        if have is None:
            out[key] = list(row)
            continue
        have[5] += row[5]
        have[6] += row[6]
        have[7] = max(have[7], row[7])
        have[8] += row[8]
        have[9] += row[9]
        have[10] = min(have[10], row[10])
        have[11] = max(have[11], row[11])
    return [tuple(out[k]) for k in sorted(out)]
