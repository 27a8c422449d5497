"""Per-second summaries of a node's timed events, made in the writer's idle time.

explain's shared grouped read (:mod:`fleetd.analyze.reading.sums`) sums the window's
timed events per thread, process, op and wait: a sort of every row, about 10 CPU s of a
10-minute, 7 M-event file. Grouping each batch before its commit would cost the writer
about three quarters more per row (docs/performance.md), so the writer sums whole
seconds only when its queue is empty, :data:`LAG_S` behind the newest event it stored
(an off-CPU record is written when the sleep ends, with the time it began).

``second_sums`` holds one row per (node, second, thread, process, op, scheduler state,
syscall slept in) with the grouped read's columns; ``second_cover`` one row per summed
second that held events: how many of the node's events start in it, the largest of their
ids, the earliest start and the latest end (a second without a row is read raw: an empty
one costs a reader one index seek). A reader trusts a second only while the
file still holds exactly that count and largest id: an event stored since (a late
record, an import) has a larger id than any before it and raises the largest, one
deleted (pruning) lowers the count. A second that changed, and every part of a window
not summed (its edges, the newest seconds, a file written before schema version 9), is
read from the events themselves, so an answer never depends on whether a summary exists.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterable
from typing import Protocol

from fleetd.store.catalog import BY_CODE, RECLAIM_RUNS, TIMED, op_code
from fleetd.store.schema import SEQ_BITS

log = logging.getLogger("fleetd.store.summaries")

SEC_NS = 1_000_000_000
LAG_S = 30  # seconds behind the newest stored event before a second is summed
STEP_S = 5  # seconds summed per idle step at most: one short transaction between batches
STEP_ROWS = 50_000  # and events (but one second whole): a step under a flood (125,000
# events/s: five seconds took over 1 s) holds the writer back while its queue fills
CHECK_S = 60  # seconds whose count a reader checks in one statement (a changed block
# is checked again second by second)

_SYSCALL = op_code("syscall")
# Ops with a duration: calls and host intervals (syscalls are read apart, by number).
TIMED_CODES: tuple[int, ...] = tuple(c for c in TIMED.codes if c != _SYSCALL)
# Records whose scheduler state and wait reason the breakdown splits by.
WAIT_CODES: tuple[int, ...] = (op_code("off_cpu"), op_code("runq_wait"))
# An event that failed: block_io keeps the request's error in ret, CUDA calls their
# cudaError; a scheduler record's ret is the syscall it slept in. Only a reclaim run's
# bytes are summed: other ops keep an address or a count there (a sum would overflow).
FAIL_CODES: tuple[int, ...] = tuple(c for c in TIMED_CODES if BY_CODE[c].source != "sched")


def codes_sql(codes: Iterable[int]) -> str:
    """An SQL ``(...)`` list of integer codes (ints only, so formatting is safe)."""
    return "(" + ",".join(str(int(c)) for c in codes) + ")"


_WAITS = f"op IN {codes_sql(WAIT_CODES)}"
# A group's scheduler state: a0's low byte for off-CPU and run-queue records, else 0.
STATE_SQL = f"CASE WHEN {_WAITS} THEN a0 & 255 ELSE 0 END"
# A group's totals over events: count, time, largest, failed, reclaim ns, first start,
# latest end; the same over summary rows is :data:`SUMMED_TOTALS_SQL`.
TOTALS_SQL = (f"count(*), sum(dur_ns), max(dur_ns), sum(ret != 0 AND op IN "
              f"{codes_sql(FAIL_CODES)}), sum(CASE WHEN op IN {codes_sql(RECLAIM_RUNS.codes)} "
              "THEN bytes ELSE 0 END), min(ts_ns), max(ts_ns + dur_ns)")
SUMMED_TOTALS_SQL = ("sum(n), sum(total), max(top), sum(failed), sum(nbytes), min(first_ns), "
                     "max(end_ns)")
TIMED_SQL = f"op IN {codes_sql(TIMED_CODES)}"

SecRun = tuple[int, int]  # whole seconds [first, last], both summed and still true


def node_ids(node: int) -> tuple[int, int]:
    """The event ids node key ``node`` can hold, [lo, hi]."""
    return node << SEQ_BITS, ((node + 1) << SEQ_BITS) - 1


def has_summaries(conn: sqlite3.Connection, schema: str = "main") -> bool:
    """Whether the file has the tables (schema version 9 on)."""
    return conn.execute(f"SELECT 1 FROM {schema}.sqlite_master WHERE type = 'table' AND "
                        "name = 'second_cover'").fetchone() is not None


# A node's events in a span of time, read through the time index: with ``id BETWEEN``
# SQLite would walk the node's whole id range (its every event) for a few seconds of it.
SPAN_WHERE = "ts_ns >= ? AND ts_ns < ? AND +id BETWEEN ? AND ?"


def summarize(conn: sqlite3.Connection, node: int, first: int, last: int) -> None:
    """Sum seconds [first, last] of node key ``node`` as the file holds them now, in the
    caller's transaction (replacing what was summed of them before)."""
    params = (node, first * SEC_NS, (last + 1) * SEC_NS, *node_ids(node))
    for table in ("second_sums", "second_cover"):
        conn.execute(f"DELETE FROM {table} WHERE node = ? AND sec BETWEEN ? AND ?",
                     (node, first, last))
    conn.execute(
        "INSERT INTO second_sums(node, sec, tid, pid, op, state, wret, n, total, top, "
        "failed, nbytes, first_ns, end_ns) "
        f"SELECT ?, ts_ns / {SEC_NS}, tid, pid, op, {STATE_SQL}, CASE WHEN {_WAITS} THEN "
        f"ret ELSE 0 END, {TOTALS_SQL} FROM event_data WHERE {SPAN_WHERE} AND {TIMED_SQL} "
        "GROUP BY 2, 3, 4, 5, 6, 7", params)
    conn.execute(
        "INSERT INTO second_cover(node, sec, n, top_id, first_ns, end_ns) "
        f"SELECT ?, ts_ns / {SEC_NS}, count(*), max(id), min(ts_ns), max(ts_ns + dur_ns) "
        f"FROM event_data WHERE {SPAN_WHERE} GROUP BY 2", params)


def forget_before(conn: sqlite3.Connection, node: int, oldest_ns: int) -> None:
    """Drop the summaries of seconds wholly before ``oldest_ns`` (pruning deleted their
    events), in the caller's transaction."""
    for table in ("second_sums", "second_cover"):
        conn.execute(f"DELETE FROM {table} WHERE node = ? AND sec < ?",
                     (node, oldest_ns // SEC_NS))


class SumCounts(Protocol):
    """Where the writer counts the CPU time summing took (its WriterStats)."""

    summary_cpu_ns: int


class Summarizer:
    """The writer's idle-time summing of one node's seconds, oldest first."""

    def __init__(self, conn: sqlite3.Connection, node: int, counts: SumCounts | None = None,
                 *, backfill: bool = False) -> None:
        self.conn, self.node = conn, node
        self.counts = counts
        self.failed: str | None = None  # why summing stopped
        row = conn.execute("SELECT max(sec) FROM second_cover WHERE node = ?",
                           (node,)).fetchone()
        # The next second to sum: after the last summed. In a file with events but no
        # summaries, from its newest second on (older ones stay read raw: a writer has
        # no backlog to work through), or from its oldest with ``backfill``.
        self.next_sec: int | None = None if row[0] is None else int(row[0]) + 1
        self.newest_sec: int | None = None
        if self.next_sec is None:
            newest = edge_ts(conn, node, "DESC")
            if newest is not None:
                self.newest_sec = newest // SEC_NS
                oldest = edge_ts(conn, node, "ASC") if backfill else None
                self.next_sec = self.newest_sec if oldest is None else oldest // SEC_NS

    def saw(self, first_ns: int, last_ns: int) -> None:
        """A committed batch's events began at about [first_ns, last_ns] (a hint: the
        lag covers the records that arrive out of order)."""
        if self.next_sec is None:
            self.next_sec = min(first_ns, last_ns) // SEC_NS
        top = max(first_ns, last_ns) // SEC_NS
        self.newest_sec = top if self.newest_sec is None else max(self.newest_sec, top)

    def step(self, lag_s: int = LAG_S) -> bool:
        """Sum the next seconds due (at most :data:`STEP_S` and :data:`STEP_ROWS`, from
        the next one holding an event: an idle stretch costs one seek) in one
        transaction; whether it did."""
        if self.next_sec is None or self.newest_sec is None:
            return False
        at = _first_from(self.conn, self.node, self.next_sec * SEC_NS)
        if at is None:
            return False
        first = at // SEC_NS
        last = min(self.newest_sec - lag_s, first + STEP_S - 1)
        self.next_sec = first
        if last < first:
            return False
        last = self._within_rows(first, last)
        conn = self.conn
        conn.execute("BEGIN")
        try:
            summarize(conn, self.node, first, last)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.next_sec = last + 1
        return True

    def _within_rows(self, first: int, last: int) -> int:
        """The last of seconds [first, last] to sum in one step: while they hold at
        most :data:`STEP_ROWS` events (counted in the time index), the first always."""
        total = 0
        for sec in range(first, last + 1):
            total += self.conn.execute(
                f"SELECT count(*) FROM event_data WHERE {SPAN_WHERE}",
                (sec * SEC_NS, (sec + 1) * SEC_NS, *node_ids(self.node))).fetchone()[0]
            if total > STEP_ROWS and sec > first:
                return sec - 1
        return last

    def finish(self) -> None:
        """Sum every second stored so far (the writer is closing)."""
        while self.step(lag_s=0):
            pass

    def idle(self, finish: bool = False) -> bool:
        """The writer's call while its queue is empty: one :meth:`step` (every second
        left when ``finish``), its CPU time counted; whether there may be more to do.
        A failure (a full disk) stops summing for this writer: the seconds after are
        read raw, as in a file without summaries."""
        if self.failed is not None:
            return False
        cpu0 = time.thread_time_ns()
        try:
            if finish:
                self.finish()
                return False
            return self.step()
        except sqlite3.Error as exc:
            self.failed = str(exc)
            log.warning("per-second summaries stopped (%s): explain reads the events after "
                        "them", exc)
            return False
        finally:
            if self.counts is not None:
                self.counts.summary_cpu_ns += time.thread_time_ns() - cpu0


def _first_from(conn: sqlite3.Connection, node: int, ts_ns: int) -> int | None:
    """The start of the node's first event at or after ``ts_ns``: one seek."""
    row = conn.execute(f"SELECT ts_ns FROM event_data WHERE {SPAN_WHERE} ORDER BY ts_ns "
                       "LIMIT 1", (ts_ns, 1 << 62, *node_ids(node))).fetchone()
    return None if row is None else int(row[0])


def edge_ts(conn: sqlite3.Connection, node: int, order: str) -> int | None:
    """The node's oldest (ASC) or newest (DESC) event start, from the time index's end
    (with ``id BETWEEN`` SQLite walks the node's every event; both ends in one statement
    walk the index whole)."""
    row = conn.execute(f"SELECT ts_ns FROM event_data WHERE +id BETWEEN ? AND ? ORDER BY "
                       f"ts_ns {order} LIMIT 1", node_ids(node)).fetchone()
    return None if row is None else int(row[0])


def summarize_all(conn: sqlite3.Connection, node: int) -> None:
    """Sum every second of node ``node`` as the writer would have in its idle time (a
    file built by other means: the benchmark's, a test's)."""
    Summarizer(conn, node, backfill=True).finish()


# ---- reading ------------------------------------------------------------------------

def summed_runs(conn: sqlite3.Connection, node: int, start_ns: int, end_ns: int
                ) -> list[SecRun]:
    """The whole seconds inside [start_ns, end_ns) that are summed and still true of the
    file, as runs of consecutive seconds; [] for a file without summaries."""
    first = -(-start_ns // SEC_NS)  # the first second starting at or after start_ns
    last = end_ns // SEC_NS - 1  # the last one ending at or before end_ns
    if last < first or not has_summaries(conn):
        return []
    rows = conn.execute("SELECT sec, n, top_id FROM second_cover WHERE node = ? AND sec "
                        "BETWEEN ? AND ? ORDER BY sec", (node, first, last)).fetchall()
    # The node's own events only; in a file of this node alone, without testing each
    # id (a third of the check's cost).
    ids = node_ids(node)
    lo = conn.execute("SELECT min(id) FROM event_data").fetchone()[0]  # a seek each (both
    hi = conn.execute("SELECT max(id) FROM event_data").fetchone()[0]  # in one: a walk)
    alone = lo is not None and ids[0] <= lo and hi <= ids[1]
    where = "ts_ns >= ? AND ts_ns < ?" + ("" if alone else f" AND +id BETWEEN {ids[0]} AND "
                                          f"{ids[1]}")
    good: list[int] = []
    for block in _blocks(rows):
        good.extend(_checked(conn, where, block))
    return _runs(good)


def _blocks(rows: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Cover rows cut into consecutive seconds, at most :data:`CHECK_S` each."""
    out: list[list[tuple[int, int, int]]] = []
    for row in rows:
        if out and row[0] == out[-1][-1][0] + 1 and len(out[-1]) < CHECK_S:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _checked(conn: sqlite3.Connection, where: str, block: list[tuple[int, int, int]]
             ) -> list[int]:
    """The seconds of ``block`` whose events (``where``) are still those summed: the
    whole block in one count when it holds, else second by second."""
    if _holds(conn, where, block[0][0], block[-1][0], sum(r[1] for r in block),
              max(r[2] for r in block)):
        return [r[0] for r in block]
    if len(block) == 1:
        return []
    return [r[0] for r in block if _holds(conn, where, r[0], r[0], r[1], r[2])]


def _holds(conn: sqlite3.Connection, where: str, first: int, last: int, n: int, top: int
           ) -> bool:
    count, newest = conn.execute(
        f"SELECT count(*), coalesce(max(id), 0) FROM event_data WHERE {where}",
        (first * SEC_NS, (last + 1) * SEC_NS)).fetchone()
    return bool(count == n and newest == top)


def _runs(secs: list[int]) -> list[SecRun]:
    out: list[SecRun] = []
    for s in secs:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def raw_spans(start_ns: int, end_ns: int, runs: list[SecRun]) -> list[tuple[int, int]]:
    """The parts of [start_ns, end_ns) outside ``runs``, as [lo, hi) ns spans."""
    out: list[tuple[int, int]] = []
    at = start_ns
    for first, last in runs:
        if first * SEC_NS > at:
            out.append((at, first * SEC_NS))
        at = (last + 1) * SEC_NS
    if end_ns > at:
        out.append((at, end_ns))
    return out
