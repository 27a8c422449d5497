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

from fleetd.analyze.reading.data import Node, code, in_list, in_window
from fleetd.analyze.reading.waits import sql_reason
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import BY_CODE, RECLAIM_RUNS, TIMED

SYSCALL = code("syscall")
# Ops with a duration: calls and host intervals (syscalls are read apart, by number).
TIMED_CODES: tuple[int, ...] = tuple(c for c in TIMED.codes if c != SYSCALL)
# Records whose scheduler state and wait reason the breakdown splits by.
_WAITS = (code("off_cpu"), code("runq_wait"))
# An event that failed: block_io keeps the request's error in ret, CUDA calls their
# cudaError; a scheduler record's ret is the syscall it slept in. Only a reclaim run's
# bytes are summed: other ops keep an address or a count there (a sum would overflow).
_FAILS = tuple(c for c in TIMED_CODES if BY_CODE[c].source != "sched")


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


def event_sums(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None
               ) -> list[Sum]:
    """The groups in (tid, pid, op, state, why) order: one pass, one sort."""
    waits = f"op IN {in_list(_WAITS)}"
    where, params = in_window(node, win, pid)
    sql = (f"SELECT tid, pid, op, CASE WHEN {waits} THEN a0 & 255 ELSE 0 END, "
           f"CASE WHEN {waits} THEN {sql_reason()} ELSE '' END, count(*), sum(dur_ns), "
           f"max(dur_ns), sum(ret != 0 AND op IN {in_list(_FAILS)}), "
           f"sum(CASE WHEN op IN {in_list(RECLAIM_RUNS.codes)} THEN bytes ELSE 0 END), "
           f"min(ts_ns), max(ts_ns + dur_ns) FROM event_data WHERE {where} AND op IN "
           f"{in_list(TIMED_CODES)} GROUP BY 1, 2, 3, 4, 5")
    return [Sum(*row) for row in conn.execute(sql, params)]
