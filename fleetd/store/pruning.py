"""Deleting a node's oldest events to keep its database under a size (``store.max_bytes``,
or the size the file had when the disk filled): the writer's thread calls it after a
commit, on the writer's connection.

After a pass that deleted events, the thread and process rows that no kept event (nor
anything else kept) names go too (:mod:`fleetd.store.taskrefs`).

The oldest go first, always: the stored ids stay one contiguous range. A pass frees a
tenth more than the excess, so pruning does not run after every commit, in steps of at
most ``step_rows`` rows, each a transaction of its own, so that the WAL is checkpointed
and reset between them instead of holding the whole pass (its size counts against the
cap: fleetd.store.sizecap).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Protocol

from fleetd.store.summaries import edge_ts, forget_before
from fleetd.store.taskrefs import TaskRefs

PRUNE_PASSES = 4  # pruning passes per commit at most, until the data is under its cap


def used_bytes(conn: sqlite3.Connection) -> int:
    """Bytes of the main file holding data (free pages left by pruning excluded)."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


class Pruner:
    """One commit's pruning of the events with ids in [lo, hi] (one node's)."""

    def __init__(self, conn: sqlite3.Connection, lo: int, hi: int, node_key: int,
                 step_rows: int) -> None:
        self.conn, self.lo, self.hi, self.node_key = conn, lo, hi, node_key
        self.step_rows = step_rows
        self.deleted = 0
        self.error: str | None = None

    def prune_to(self, cap: int, used: int) -> None:
        """Delete the oldest events until the data is under ``cap``: a pass frees fewer
        whole pages than the rows it deletes (index pages stay partly full), so it may
        take a few."""
        for _ in range(PRUNE_PASSES):
            if used <= cap or not self._pass(cap, used):
                return
            used = used_bytes(self.conn)

    def _pass(self, cap: int, used: int) -> bool:
        """One pass; False when nothing (more) is to be pruned or it failed. Ids are
        counted, not rows: this node's ids are one range with few gaps (a failed batch's),
        so its oldest and newest ids say how many events it holds, in two index seeks
        where a count(*) read every row at every pass while queries waited for the CPU."""
        row = self.conn.execute("SELECT min(id), max(id) FROM event_data WHERE id BETWEEN ? "
                                "AND ?", (self.lo, self.hi)).fetchone()
        if row is None or row[0] is None:
            return False
        first, last = int(row[0]), int(row[1])
        # Free a tenth more than the excess, so pruning does not run after every commit.
        share = min(1.0, (used - cap * 0.9) / used)
        cutoff = first + min(max(1, int((last - first + 1) * share)), last - first)
        deleted = 0
        for end in range(first + self.step_rows, cutoff + self.step_rows, self.step_rows):
            rows = self._delete_below(min(end, cutoff))
            if rows is None:
                return False
            deleted += rows
        return deleted > 0

    def _delete_below(self, end: int) -> int | None:
        """Delete the events below id ``end`` (their args, and the aggregates older than
        what is left) in one transaction: how many, or None if it failed."""
        conn = self.conn
        try:
            conn.execute("BEGIN")
            cur = conn.execute("DELETE FROM event_data WHERE id >= ? AND id < ?", (self.lo, end))
            conn.execute("DELETE FROM event_args WHERE id >= ? AND id < ?", (self.lo, end))
            oldest = edge_ts(conn, self.node_key, "ASC")
            if oldest is not None:
                conn.execute("DELETE FROM aggregate_data WHERE node = ? AND ts_ns < ?",
                             (self.node_key, oldest))
                forget_before(conn, self.node_key, oldest)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self.error = str(exc)
            return None
        self.deleted += cur.rowcount
        return int(cur.rowcount)


class PruneCounts(Protocol):
    """The writer's running counts of what pruning deleted (its WriterStats)."""

    pruned_events: int
    pruned_threads: int
    pruned_processes: int


@dataclass
class Pruned:
    """What one commit's pruning deleted, and why it stopped short (None: it did not)."""

    events: int = 0
    threads: int = 0  # task_data rows no kept event named any more
    processes: int = 0  # process_data rows, the same
    error: str | None = None

    def count_in(self, counts: PruneCounts) -> None:
        counts.pruned_events += self.events
        counts.pruned_threads += self.threads
        counts.pruned_processes += self.processes


def prune(pruner: Pruner, cap: int, refs: TaskRefs) -> Pruned:
    """The oldest events down to ``cap``, then the rows of the tasks no kept row names.
    A failure (a full disk, I/O) is reported in ``error``, never raised: the writer's
    thread goes on and the next commit tries again."""
    out = Pruned()
    try:
        pruner.prune_to(cap, used_bytes(pruner.conn))
        if pruner.deleted and pruner.error is None:
            tasks = refs.prune()
            out.threads, out.processes = tasks.threads, tasks.processes
    except sqlite3.Error as exc:
        out.error = str(exc)
    out.events = pruner.deleted
    out.error = pruner.error or out.error
    return out
