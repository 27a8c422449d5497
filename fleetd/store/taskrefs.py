"""Pruning the thread and process rows (``task_data``, ``process_data``) that nothing
stored names any more.

Events name tasks by number (``event_data.pid``, ``tid``, ``peer``) and there is no
index on those columns (one doubles the writer's cost per row: schema version 6), so
whether an event still names a task cannot be asked of the table. The writer notes it
instead, once per commit: ``task_seen`` holds, per id, the newest event id that named
it, or the newest stored when its thread or process row was written. Once pruning has
deleted every event up to that id, no event names it; the row goes unless something
else does:

- a chain (victim, culprit, or a pid/tid in its evidence), an aggregate, a GPU or
  annotation row, a session's targets, another kept row (a thread's process, a
  process's parent: the process tree the analyses walk);
- a process of the traced job (a rank, no exit recorded): never pruned;
- a task still alive: the tracer writes a thread or process row once, when it first
  meets it, and remembers it while it lives (fleetd.trace.bpf.decoder), so a quiet
  live thread's row would not come back with its next events.

Ids whose rows are gone (or that never had one: a pid with no process row) leave
``task_seen`` with them, so it holds about one row per task the kept events name.

Noting costs the writer about 100 ns of CPU per event row (a set over three columns),
so only a writer under a size cap notes: without one no event is pruned (but on a full
disk, where the thread and process rows stay). A writer that notes therefore first
gives every stored row the newest event id (events may have been written since by one
that did not note): a restart keeps them until the events stored before it are pruned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import orjson

from fleetd.store.schema import SEQ_BITS, SEQ_MASK, EventRow

log = logging.getLogger("fleetd.store.taskrefs")
# Columns of an event row (EVENT_FIELDS order) that name a task.
_PID, _TID, _PEER = itemgetter(2), itemgetter(3), itemgetter(7)
# Args that name tasks hold this: an off-CPU record's fd peers ({"pid": ..}), a cgroup
# sample's member list ("pids"). Launch args, the many, do not.
_NAMES_TASKS = '"pid'
_UPSERT = ("INSERT INTO task_seen(node, id, last_id) VALUES (?, ?, ?) ON CONFLICT(node, id) "
           "DO UPDATE SET last_id = max(last_id, excluded.last_id)")
# Processes of the traced job: a rank and no exit recorded. Never pruned, nor their threads.
_TRACED = ("SELECT pid FROM process_data WHERE node = ? AND rank IS NOT NULL "
           "AND exit_ns IS NULL")
# Tables only ever added to (neither pruned nor rewritten): the ids their rows name are
# read once, from the rows after the last one read. (table, row order column, columns)
_APPEND_ONLY: tuple[tuple[str, str, str], ...] = (
    ("chain_data", "seq", "victim_pid, victim_tid, culprit_pid, evidence"),
    ("gpu_data", "id", "pid"),
    ("annotation_data", "id", "pid, tid"),
)


def alive(task: int) -> bool:
    """A process or thread with this id exists now (/proc/TID exists for threads too)."""
    return os.path.exists(f"/proc/{task}")


@dataclass
class PrunedTasks:
    threads: int = 0  # task_data rows deleted
    processes: int = 0  # process_data rows deleted


@dataclass
class _Seen:
    """Ids named by the append-only tables, read up to ``upto`` (per table)."""

    ids: set[int] = field(default_factory=set)
    upto: dict[str, int] = field(default_factory=dict)


class TaskRefs:
    """The writer's notes of what its rows name, and the pruning of what nothing does.

    :meth:`note` and :meth:`flush` run inside the writer's commit (the notes are part of
    its transaction); :meth:`prune` after the events were pruned, on the same thread."""

    def __init__(self, conn: sqlite3.Connection, node_key: int, *, noting: bool) -> None:
        self._conn, self._node = conn, node_key
        self._lo = node_key << SEQ_BITS  # this node's event ids
        self._hi = self._lo + SEQ_MASK
        self.noting = noting
        self._pending: dict[int, int] = {}
        self._seen = _Seen()
        if noting:
            try:
                self._catch_up()
            except sqlite3.Error as exc:  # a full disk at start: prune no rows this run
                self.noting = False
                log.warning("thread and process rows will not be pruned this run: %s", exc)

    def _catch_up(self) -> None:
        """Every stored thread and process id named as of the newest stored event, in
        one transaction: until it is done, notes would miss what was written before."""
        conn = self._conn
        row = conn.execute("SELECT max(id) FROM event_data WHERE id BETWEEN ? AND ?",
                           (self._lo, self._hi)).fetchone()
        newest = 0 if row is None or row[0] is None else int(row[0])
        with _transaction(conn):
            for table, col in (("task_data", "tid"), ("process_data", "pid")):
                conn.execute(
                    f"INSERT INTO task_seen(node, id, last_id) SELECT node, {col}, ?1 FROM "
                    f"{table} WHERE node = ?2 ON CONFLICT(node, id) DO UPDATE SET "
                    "last_id = max(last_id, excluded.last_id)", (newest, self._node))

    # ---- in the commit -------------------------------------------------------------

    def note(self, kind: str, rows: Any, args: Sequence[tuple[int, str]], last_id: int
             ) -> None:
        """Note what one of the writer's items names; ``last_id`` is the newest event id
        assigned so far (an events item's own last)."""
        if not self.noting:
            return
        if kind == "events":
            self._note_events(rows, args, last_id)
        elif kind in ("tasks", "processes"):  # tid or pid first in both shapes
            pending = self._pending
            for r in rows:
                pending[r[0]] = last_id

    def _note_events(self, rows: Sequence[EventRow], args: Sequence[tuple[int, str]],
                     last_id: int) -> None:
        # One set over three columns, filled by map in C (a Python loop over the rows
        # would cost more than the row's insert).
        ids = set(map(_PID, rows))
        ids.update(map(_TID, rows))
        ids.update(map(_PEER, rows))
        for _, text in args:
            if _NAMES_TASKS in text:
                ids.update(_ids_in([text]))
        ids.discard(0)
        self._pending.update(dict.fromkeys(ids, last_id))

    def flush(self) -> None:
        """Write the notes of this commit (before its COMMIT)."""
        if self._pending:
            node = self._node
            self._conn.executemany(_UPSERT, ((node, k, v) for k, v in self._pending.items()))
            self._pending.clear()

    # ---- after event pruning -------------------------------------------------------

    def prune(self) -> PrunedTasks:
        """Delete the thread and process rows of this node that nothing kept names, in a
        transaction of its own (rolled back and raised on failure)."""
        conn, node = self._conn, self._node
        if not self.noting:
            return PrunedTasks()
        row = conn.execute("SELECT min(id) FROM event_data WHERE id BETWEEN ? AND ?",
                           (self._lo, self._hi)).fetchone()
        oldest = self._hi + 1 if row is None or row[0] is None else int(row[0])
        stale = {int(i) for (i,) in conn.execute(
            "SELECT id FROM task_seen WHERE node = ? AND last_id < ?", (node, oldest))}
        if not stale:
            return PrunedTasks()
        named = self._named_elsewhere()
        gone = [t for t in stale if t not in named and not alive(t)]
        out = PrunedTasks()
        with _transaction(conn):
            out.threads = self._delete_threads(gone)
            out.processes = self._delete_processes(set(gone))
            # Ids with neither row left stop being tracked; the rest are looked at again.
            conn.execute(
                "DELETE FROM task_seen WHERE node = ?1 AND last_id < ?2 AND id NOT IN "
                "(SELECT tid FROM task_data WHERE node = ?1) AND id NOT IN "
                "(SELECT pid FROM process_data WHERE node = ?1)", (node, oldest))
        return out

    def _delete_threads(self, gone: Sequence[int]) -> int:
        if not gone:
            return 0
        cur = self._conn.execute(
            "DELETE FROM task_data WHERE node = ?1 AND tid IN (SELECT value FROM "
            f"json_each(?2)) AND coalesce(pid, 0) NOT IN ({_TRACED.replace('?', '?1')})",
            (self._node, orjson.dumps(list(gone)).decode()))
        return int(cur.rowcount)

    def _delete_processes(self, gone: set[int]) -> int:
        """The rows of ``gone`` that no kept thread row names as its process and no kept
        process row as its parent (or an ancestor's)."""
        conn, node = self._conn, self._node
        parent = {int(p): q for p, q in conn.execute(
            "SELECT pid, ppid FROM process_data WHERE node = ?", (node,))}
        keep = {int(p) for (p,) in conn.execute(
            "SELECT DISTINCT pid FROM task_data WHERE node = ? AND pid IS NOT NULL", (node,))}
        keep.update(int(p) for (p,) in conn.execute(_TRACED, (node,)))
        doomed = (gone & parent.keys()) - keep
        for pid in parent.keys() - doomed:
            up = parent.get(pid)
            while up in doomed:  # an ancestor of a kept process stays, and its own
                doomed.discard(up)
                up = parent.get(up)
        if not doomed:
            return 0
        cur = conn.execute("DELETE FROM process_data WHERE node = ? AND pid IN (SELECT value "
                           "FROM json_each(?))", (node, orjson.dumps(sorted(doomed)).decode()))
        return int(cur.rowcount)

    def _named_elsewhere(self) -> set[int]:
        """Ids named by this node's chains, aggregates, GPU and annotation rows and
        session targets."""
        conn, node = self._conn, self._node
        seen = self._seen
        for table, order, cols in _APPEND_ONLY:
            after = seen.upto.get(table, 0)
            if table == "chain_data":
                rows = conn.execute(f"SELECT {order}, {cols} FROM {table} WHERE node = ? "
                                    f"AND {order} > ?", (node, after)).fetchall()
            else:  # node-namespaced ids
                rows = conn.execute(f"SELECT {order}, {cols} FROM {table} WHERE {order} "
                                    "BETWEEN ? AND ?", (max(after + 1, self._lo),
                                                        self._hi)).fetchall()
            for r in rows:
                seen.ids.update(_ids_in(r[1:]))
            if rows:
                seen.upto[table] = max(int(r[0]) for r in rows)
        named = set(seen.ids)
        named.update(int(p) for (p,) in conn.execute(
            "SELECT DISTINCT pid FROM aggregate_data WHERE node = ? AND pid IS NOT NULL",
            (node,)))
        for (targets,) in conn.execute(
                "SELECT targets FROM session_data WHERE node = ? AND targets IS NOT NULL",
                (node,)):
            named.update(_ids_in([targets]))
        return named


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN .. COMMIT on the writer's autocommit connection; rolled back and raised on
    failure."""
    conn.execute("BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _ids_in(values: Iterable[object]) -> set[int]:
    """Integers in columns, and under keys naming a pid or tid in JSON text (chain
    evidence, session targets, event args: ``pid``, ``culprit_pid``, ``tids``...)."""
    out: set[int] = set()
    for v in values:
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, str | bytes) and v[:1] in ("[", "{", b"[", b"{"):
            try:
                _walk(orjson.loads(v), False, out)
            except orjson.JSONDecodeError:
                continue
    out.discard(0)
    return out


_NAMING_KEYS = ("pid", "tid", "peer", "waker")


def _walk(obj: object, named: bool, out: set[int]) -> None:
    """Collect ints that sit under a key naming a task (``pid``, ``culprit_pid``,
    ``tids``, ``peer``...), at any depth, and the keys of a map under one (a session's
    ``"pids": {"4242": "rank"}``)."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int):
        if named:
            out.add(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = str(k)
            if named and key.isdigit():
                out.add(int(key))
            _walk(v, key.rstrip("s").endswith(_NAMING_KEYS), out)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, named, out)
