"""The batch writer: the only thread that writes a node database.

Producers (the tracer's decoder, the analyzer) hand over lists of rows; the writer
thread drains its queue and commits many rows per transaction, which is what makes
hundreds of thousands of inserts per second possible on one core. It assigns
node-namespaced ids that continue after a restart, prunes the oldest events when the
file outgrows its limit, and flushes everything on close.

Nothing is lost silently: rows refused because the queue stayed full, or because a
write failed (disk full), are counted in :class:`WriterStats`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import orjson

from fleetd.store.caps import cap, capped
from fleetd.store.chainrow import CHAIN_FIELDS, ChainRow
from fleetd.store.db import ensure_node, open_writer
from fleetd.store.losses import tracer_gone
from fleetd.store.pruning import Pruner, prune, used_bytes
from fleetd.store.schema import (
    EVENT_FIELDS,
    PLACEMENT_COLUMNS,
    SEQ_BITS,
    SEQ_MASK,
    EventArgs,
    EventRow,
    ProcessFields,
)
from fleetd.store.sizecap import (
    RESERVE_BYTES,
    RESERVE_SUFFIX,
    SizeCap,
    hold_reserve,
    on_disk,
    rows_per_txn,
    wal_bytes,
    wal_pages,
)
from fleetd.store.summaries import Summarizer
from fleetd.store.taskrefs import TaskRefs

log = logging.getLogger("fleetd.store.writer")

_EVENT_SQL = (
    f"INSERT INTO event_data(id, {', '.join(EVENT_FIELDS)}) "
    f"VALUES ({', '.join('?' * (len(EVENT_FIELDS) + 1))})"
)
# The same without ids, when SQLite's own choice (largest rowid + 1) is the next id.
_EVENT_NEXT_HEAD = f"INSERT INTO event_data({', '.join(EVENT_FIELDS)}) VALUES "
_ARGS_HEAD = "INSERT INTO event_args(id, args) VALUES "
_ARGS_SQL = _ARGS_HEAD + "(?, ?)"
# Rows per statement on the bulk paths: one statement of BLOCK rows costs about a
# quarter less per row than BLOCK one-row statements (fewer steps and resets).
BLOCK = 64
PROCESS_COLS = (
    "pid", "ppid", "comm", "exe", "cmdline", "rank", "local_rank", "world_size",
    "start_ns", "exit_ns", "exit_code", "job", *PLACEMENT_COLUMNS,
)
# Later facts fill in what earlier ones lacked, never blank out what is known.
PROCESS_SQL = (
    f"INSERT INTO process_data(node, {', '.join(PROCESS_COLS)}) "
    f"VALUES (?, {', '.join('?' * len(PROCESS_COLS))}) "
    "ON CONFLICT(node, pid) DO UPDATE SET "
    + ", ".join(f"{c} = coalesce(excluded.{c}, {c})" for c in PROCESS_COLS[1:])
)
TASK_SQL = (
    "INSERT INTO task_data(node, tid, pid, comm) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(node, tid) DO UPDATE SET pid = coalesce(excluded.pid, pid), "
    "comm = coalesce(excluded.comm, comm)"
)
_STACK_SQL = "INSERT OR IGNORE INTO stacks(hash, frames) VALUES (?, ?)"
_AGG_SQL = (
    "INSERT INTO aggregate_data(node, session, ts_ns, dur_ns, pid, op, bucket, count, sum) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SESSION_COLS = (
    "host", "kernel", "boot_id", "started_ns", "ended_ns", "mono_offset_ns", "clock_error_ns",
    "clock_samples", "rank", "local_rank", "world_size", "tool_version", "schema_version",
    "lost_events", "dropped_stacks", "sampled_out", "drops", "targets", "headers_route",
    "command", "end_reason",
)
# A session still open whose tracer is gone (kill -9, a crash, a reboot) is closed at
# its last commit, as crashed, counting as lost what the kernel had emitted by then that
# the file neither holds nor counted as lost.
_CLOSE_CRASHED = """
UPDATE session_data SET
    ended_ns = coalesce(updated_ns, started_ns),
    end_reason = 'crashed',
    lost_events = lost_events + max(0, coalesce(emitted_events - accounted_events, 0)),
    drops = json_set(coalesce(drops, '{}'), '$.crash',
                     max(0, coalesce(emitted_events - accounted_events, 0)))
WHERE node = ? AND seq = ? AND ended_ns IS NULL
"""
# Free space that ends a disk-full episode: room for a few batches and their WAL frames.
SPACE_BACK_BYTES = RESERVE_BYTES + 2 * 2**20
_PROGRESS_SQL = ("UPDATE session_data SET updated_ns = ?, emitted_events = ?, "
                 "accounted_events = ? WHERE node = ? AND seq = ?")


# Rows the writer may have waiting. A queued row costs about 450 bytes of Python objects
# (measured: a flood that filled a 2,000,000-row queue held 904 MB), so this bounds the
# backlog near 110 MB: 8 s of a 30,000 records/s flood, 90 s at a realistic 2,700/s. A
# longer queue only postpones the drops of a tracer that outruns its disk, at the cost
# of the node's memory; past it, rows are dropped and counted (queue_dropped).
QUEUE_ROWS = 250_000


@dataclass
class WriterStats:
    events_written: int = 0
    batches: int = 0
    queue_dropped: int = 0  # rows refused because the queue stayed full
    failed_rows: int = 0  # rows lost to a failed write (disk full, I/O error)
    pruned_events: int = 0
    pruned_threads: int = 0  # thread and process rows no kept event named (taskrefs)
    pruned_processes: int = 0
    last_error: str | None = None
    queue_rows: int = 0  # rows waiting right now
    used_bytes: int = 0  # of the main file, as of the last commit (read by other threads)
    file_bytes: int = 0  # on disk: the main file and its -wal, as of the last commit
    commit_cpu_ns: int = 0  # the writer thread's CPU time in commits (per-stage costs)
    summary_cpu_ns: int = 0  # and in summing seconds while idle (fleetd.store.summaries)
    disk_full: bool = False  # writes fail for lack of space now
    disk_full_rows: int = 0  # of failed_rows, those lost to a full disk
    disk_full_episodes: int = 0  # times the disk filled up (each ends when space returns)


@dataclass
class _Item:
    kind: str
    rows: Any
    done: threading.Event | None = None
    args: list[tuple[int, str]] = field(default_factory=list)  # events: (row, JSON text)
    seq: int = 0  # session: which row
    new: bool = False  # session: a new row (else more of one)


class BatchWriter:
    """One writer thread per database file.

    ``max_bytes`` bounds the database's files on disk (the main file and its -wal):
    when a commit takes the data past the bound less a headroom (:mod:`fleetd.store.sizecap`), the
    oldest events of this node are deleted (their space is reused, so the file stops
    growing).
    """

    def __init__(
        self,
        path: Path,
        node: str,
        *,
        host: str | None = None,
        max_bytes: int | None = None,
        batch_rows: int = 50_000,
        queue_rows: int = QUEUE_ROWS,
        put_timeout_s: float = 2.0,
    ) -> None:
        self.path = path
        self.node = node
        self.max_bytes = max_bytes
        # While the disk is full: the used size when it filled, kept by pruning the
        # oldest as new rows come (store.max_bytes' rule with a lower cap), so the file
        # stops growing and writing goes on inside it; None otherwise.
        self._full_cap: int | None = None
        # Space held back for a full disk: given up when it fills, so that pruning's
        # own writes (the WAL frames of its DELETE) have room; kept again when space
        # returns.
        self._reserve = Path(f"{path}{RESERVE_SUFFIX}")
        hold_reserve(self._reserve)
        # Under a cap a commit's rows are bounded too: its frames make the WAL's size.
        self.batch_rows = batch_rows if max_bytes is None else min(
            batch_rows, rows_per_txn(max_bytes))
        self.queue_limit = queue_rows
        self.put_timeout_s = put_timeout_s
        self.stats = WriterStats()
        self._conn = open_writer(path)
        self._size = None if max_bytes is None else SizeCap(max_bytes, self.batch_rows)
        if max_bytes is not None:
            # Beside a small cap the WAL is checkpointed sooner and truncated back after
            # a reset, instead of keeping the largest size it reached.
            page = self._scalar("PRAGMA page_size")
            pages = wal_pages(max_bytes, page)
            self._conn.execute(f"PRAGMA wal_autocheckpoint={pages}")
            self._conn.execute(f"PRAGMA journal_size_limit={pages * page}")
            # This SQLite build zeroes every freed page (SECURE_DELETE), so pruning wrote
            # each deleted page through the WAL again: the WAL grew by the share pruned
            # and the writer fell behind a flood. FAST zeroes deleted rows inside pages
            # it writes anyway; freed pages keep old events until reused, in a file only
            # readers of its events can open.
            self._conn.execute("PRAGMA secure_delete=FAST")
        self.node_key = ensure_node(self._conn, node, host)
        # What the first commit adds is measured from the file as it is.
        self.stats.used_bytes = self.used_bytes()
        self._lo = self.node_key << SEQ_BITS
        self._hi = self._lo + SEQ_MASK
        self._refs = TaskRefs(self._conn, self.node_key, noting=max_bytes is not None)
        self._next_seq = self._max_seq("event_data", "id") + 1
        # (session seq, the kernel's emitted count, events accounted for before it began)
        self._tracking: tuple[int, Callable[[], int], int] | None = None
        self.crashed_sessions = self._close_dead_sessions()
        self._next_session = self._scalar(
            "SELECT coalesce(max(seq), 0) FROM session_data WHERE node = ?", self.node_key
        ) + 1
        self._next_chain = self._scalar(
            "SELECT coalesce(max(seq), 0) FROM chain_data WHERE node = ?", self.node_key
        ) + 1
        self._sums = Summarizer(self._conn, self.node_key, self.stats)  # runs while idle
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._space = threading.Condition()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fleetd-writer", daemon=True)
        self._closed = False
        self._thread.start()

    # ---- producer side (any thread) -------------------------------------------------

    def add_events(
        self, rows: Sequence[EventRow], args: Sequence[tuple[int, EventArgs]] = ()
    ) -> bool:
        """Queue event rows (fields in EVENT_FIELDS order). False if they were dropped.

        ``args`` holds extras for a few of the rows, as (index into rows, dict) pairs;
        a ``str`` in place of the dict is taken as its JSON text, already made (the
        tracer reuses the text of repeated launches).
        """
        # Finished JSON text comes from args that were capped when first made (the
        # tracer's launch cache); a dict is capped here.
        texts = [(i, a if isinstance(a, str) else orjson.dumps(capped(a)).decode())
                 for i, a in args]
        return self._put(_Item("events", rows, args=texts), len(rows))

    def add_processes(self, rows: Iterable[ProcessFields]) -> None:
        """Process facts by PROCESS_COLS name; the names the process chose are capped
        (fleetd.store.caps)."""
        tuples = [tuple(capped(r).get(c) for c in PROCESS_COLS) for r in rows]
        self._put(_Item("processes", tuples), len(tuples))

    def add_tasks(self, rows: Iterable[tuple[int, int | None, str | None]]) -> None:
        """(tid, pid, comm) triples; a thread's name is capped like a comm."""
        tuples = [(t, p, c if c is None else cap("comm", c)) for t, p, c in rows]
        self._put(_Item("tasks", tuples), len(tuples))

    def add_stacks(self, rows: Iterable[tuple[int, list[str]]]) -> None:
        """(hash, frames) pairs; a hash already stored is kept as it is."""
        tuples = [(h, orjson.dumps([cap("frame", f) for f in frames]).decode())
                  for h, frames in rows]
        self._put(_Item("stacks", tuples), len(tuples))

    def add_aggregates(
        self, rows: Iterable[tuple[int | None, int, int, int | None, int, int, int, int]]
    ) -> None:
        """(session, ts_ns, dur_ns, pid, op, bucket, count, sum) rows."""
        tuples = list(rows)
        self._put(_Item("aggregates", tuples), len(tuples))

    def begin_session(self, fields: Mapping[str, object]) -> int:
        """Record a trace session now and return its seq (events carry it)."""
        _check_session_fields(fields)
        with self._lock:
            seq = self._next_session
            self._next_session += 1
        self._put(_Item("session", dict(fields), seq=seq, new=True), 1)
        return seq

    def update_session(self, seq: int, fields: Mapping[str, object]) -> None:
        _check_session_fields(fields)
        self._put(_Item("session", dict(fields), seq=seq, new=False), 1)

    def track_session(self, seq: int | None, emitted: Callable[[], int] | None = None) -> None:
        """With every commit of events, record how far session ``seq`` got: when, the
        kernel's emitted count (``emitted()``, called on the writer thread) and the
        events accounted for since now (stored, or counted as lost). A session killed
        before its stop is closed from these by the next one. None stops tracking."""
        self._tracking = (None if seq is None or emitted is None
                          else (seq, emitted, self._accounted()))

    def _accounted(self) -> int:
        st = self.stats
        return st.events_written + st.queue_dropped + st.failed_rows

    def add_chains(self, chains: Iterable[ChainRow]) -> None:
        """New chain versions; a chain whose ``key`` exists gets the next version."""
        items = [c.copy() for c in chains]
        self._put(_Item("chains", items), len(items))

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything queued before this call is committed."""
        done = threading.Event()
        self._queue.put(_Item("flush", None, done))
        return done.wait(timeout)

    def close(self) -> WriterStats:
        """Drain the queue, commit, close the file. Safe to call twice."""
        if self._closed:
            return self.stats
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._conn.close()
        return self.stats

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, item: _Item, n: int) -> bool:
        if self._closed:
            raise RuntimeError("writer is closed")
        with self._space:
            if self.stats.queue_rows + n > self.queue_limit and not self._space.wait_for(
                lambda: self.stats.queue_rows + n <= self.queue_limit, self.put_timeout_s
            ):
                self.stats.queue_dropped += n
                return False
            self.stats.queue_rows += n
        self._queue.put(item)
        return True

    # ---- writer thread --------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._next_item()
            batch: list[_Item] = []
            waiters: list[threading.Event] = []
            rows = 0
            while True:
                if item is None:
                    stop = True
                elif item.kind == "flush":
                    assert item.done is not None
                    waiters.append(item.done)
                else:
                    batch.append(item)
                    rows += _rows_of(item)
                if stop or rows >= self.batch_rows:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._commit(batch, rows)
            for w in waiters:
                w.set()
        self._sums.idle(finish=True)

    def _next_item(self) -> _Item | None:
        """The next queued item; while there is none, a step of summing seconds (the
        writer's idle time: never between a batch and its commit)."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            if not self._sums.idle():
                return self._queue.get()

    def _commit(self, batch: list[_Item], rows: int) -> None:
        cpu0 = time.thread_time_ns()
        try:
            self._commit_batch(batch, rows)
        finally:
            self.stats.commit_cpu_ns += time.thread_time_ns() - cpu0

    def _commit_batch(self, batch: list[_Item], rows: int) -> None:
        conn = self._conn
        events = 0
        try:
            conn.execute("BEGIN")
            for item in batch:
                events += self._write(item)
                self._refs.note(item.kind, item.rows, item.args, self._lo + self._next_seq - 1)
            self._refs.flush()
            if events and self._tracking is not None:
                self._record_progress(self._tracking, events)
            conn.execute("COMMIT")
            self.stats.events_written += events
            self.stats.batches += 1
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._failed(exc, rows)
        finally:
            with self._space:
                self.stats.queue_rows -= rows
                self._space.notify_all()
        if self.stats.disk_full:
            self._check_space_back()
        cap = _lowest(self._data_cap(), self._full_cap)
        if cap is not None:
            self._prune_if_needed(cap)
        with contextlib.suppress(sqlite3.Error):
            self.stats.used_bytes = self.used_bytes()
        self.stats.file_bytes = on_disk(self.path)
        if self._size is not None:  # the prune's own frames are in the WAL now
            self._size.observe(0, wal_bytes(self.path))
            if self.stats.file_bytes > self._size.cap:
                self._truncate_wal()

    def _truncate_wal(self) -> None:
        """Over the cap: the WAL outgrew the headroom (a reader's snapshot kept it from
        being reset) and the main file cannot shrink, so the WAL is emptied (a no-op
        while a reader is still inside its snapshot: the next commit tries again)."""
        with contextlib.suppress(sqlite3.Error):
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        self.stats.file_bytes = on_disk(self.path)

    def _data_cap(self) -> int | None:
        """The used size to prune to under store.max_bytes: the cap less what the last
        commit added and the WAL holds, at their largest so far (:class:`SizeCap`)."""
        if self._size is None:
            return None
        with contextlib.suppress(sqlite3.Error):
            self._size.observe(self.used_bytes() - self.stats.used_bytes, wal_bytes(self.path))
        return self._size.target()

    def _write(self, item: _Item) -> int:
        conn, node = self._conn, self.node_key
        if item.kind == "events":
            base = self._lo + self._next_seq
            self._next_seq += len(item.rows)
            if self._top_id() == base - 1:
                # Our last id is the table's largest: SQLite numbers the rows exactly
                # as we would (largest rowid + 1), and no id tuple is built per row.
                _insert_blocks(conn, _EVENT_NEXT_HEAD, len(EVENT_FIELDS), item.rows)
            else:
                conn.executemany(_EVENT_SQL, _with_ids(base, item.rows))
            if item.args:
                _insert_blocks(conn, _ARGS_HEAD, 2,
                               [(base + i, a) for i, a in item.args])
            if item.rows:
                self._sums.saw(item.rows[0][0], item.rows[-1][0])
            return len(item.rows)
        if item.kind == "processes":
            conn.executemany(PROCESS_SQL, ((node, *r) for r in item.rows))
        elif item.kind == "tasks":
            conn.executemany(TASK_SQL, ((node, *r) for r in item.rows))
        elif item.kind == "stacks":
            conn.executemany(_STACK_SQL, item.rows)
        elif item.kind == "aggregates":
            conn.executemany(_AGG_SQL, ((node, *r) for r in item.rows))
        elif item.kind == "session":
            self._write_session(item.rows, item.seq, item.new)
        elif item.kind == "chains":
            for chain in item.rows:
                self._write_chain(chain)
        return 0

    def _top_id(self) -> int | None:
        row = self._conn.execute("SELECT max(id) FROM event_data").fetchone()
        return int(row[0]) if row and row[0] is not None else None

    def _close_dead_sessions(self) -> list[int]:
        """Close this node's sessions whose tracer died before stopping them."""
        rows = self._conn.execute(
            "SELECT seq, boot_id, started_ns, json_extract(targets, '$.tracer_pid') "
            "FROM session_data WHERE node = ? AND ended_ns IS NULL", (self.node_key,)
        ).fetchall()
        dead = [int(seq) for seq, boot, started, pid in rows
                if tracer_gone(boot, started, pid)]
        if dead:
            with self._conn:
                for seq in dead:
                    self._conn.execute(_CLOSE_CRASHED, (self.node_key, seq))
            log.warning("node %s: closed session(s) %s, whose tracer died before stopping "
                        "them (killed or crashed); their losses are counted", self.node,
                        ", ".join(map(str, dead)))
        return dead

    def _record_progress(self, tracking: tuple[int, Callable[[], int], int], events: int
                         ) -> None:
        seq, emitted, base = tracking
        try:
            count = int(emitted())
        except Exception as exc:  # noqa: BLE001 - the tracer is stopping: skip the mark
            log.debug("emitted count unavailable: %s", exc)
            return
        accounted = self._accounted() + events - base  # this commit's events included
        self._conn.execute(_PROGRESS_SQL, (time.time_ns(), count, accounted, self.node_key,
                                           seq))

    def _write_session(self, fields: Mapping[str, object], seq: int, new: bool) -> None:
        # Session columns by name (the caller's own shape, e.g. the tracer's
        # SessionOpening), checked against the table on the caller's thread.
        values = {k: _jsonish(v) for k, v in fields.items()}
        if new:
            cols = ["node", "seq", *values]
            marks = ", ".join("?" * len(cols))
            self._conn.execute(
                f"INSERT INTO session_data({', '.join(cols)}) VALUES ({marks})",
                (self.node_key, seq, *values.values()),
            )
        elif values:
            sets = ", ".join(f"{k} = ?" for k in values)
            self._conn.execute(
                f"UPDATE session_data SET {sets} WHERE node = ? AND seq = ?",
                (*values.values(), self.node_key, seq),
            )

    def _write_chain(self, chain: ChainRow) -> None:
        key = str(chain["key"])
        version = self._scalar(
            "SELECT coalesce(max(version), 0) FROM chain_data WHERE node = ? AND key = ?",
            self.node_key, key,
        ) + 1
        seq = self._next_chain
        self._next_chain += 1
        values = [_jsonish(chain.get(c)) for c in CHAIN_FIELDS]
        cols = ("node", "seq", "key", "version", "created_ns", *CHAIN_FIELDS)
        self._conn.execute(
            f"INSERT INTO chain_data({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            (self.node_key, seq, key, version, time.time_ns(), *values),
        )

    def _failed(self, exc: sqlite3.Error, rows: int) -> None:
        """Count a failed batch; a full disk starts an episode (logged once) in which
        the file is held at its size by pruning, until space returns."""
        st = self.stats
        st.failed_rows += rows
        st.last_error = str(exc)
        if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
            log.error("write of %d rows to %s failed: %s", rows, self.path, exc)
            return
        st.disk_full_rows += rows
        if st.disk_full:
            log.debug("disk still full: %d more rows dropped", rows)
            return
        st.disk_full = True
        st.disk_full_episodes += 1
        with contextlib.suppress(OSError):
            self._reserve.unlink()
        with contextlib.suppress(sqlite3.Error):
            # A tenth below the size now: the first prune frees room inside the file.
            self._full_cap = int(self.used_bytes() * 0.9)
        log.error("the disk holding %s is full: %d rows dropped (counted); pruning the "
                  "oldest events to write on inside the file, and writing resumes by "
                  "itself when space returns", self.path, rows)

    def _check_space_back(self) -> None:
        """End a disk-full episode once the file system has room for a few batches."""
        try:
            free = shutil.disk_usage(self.path.parent).free
        except OSError:
            return
        if free < SPACE_BACK_BYTES:
            return
        self._full_cap = None
        self.stats.disk_full = False
        hold_reserve(self._reserve)
        log.warning("the disk holding %s has space again (%d bytes free): writing as "
                    "before; %d rows were dropped while it was full", self.path, free,
                    self.stats.disk_full_rows)

    def _prune_if_needed(self, cap: int) -> None:
        st = self.stats
        done = prune(Pruner(self._conn, self._lo, self._hi, self.node_key, self.batch_rows),
                     cap, self._refs)
        done.count_in(st)
        if done.error is not None:
            st.last_error = done.error
            # While the disk is full this is expected until the reserve gives room.
            log.log(logging.DEBUG if st.disk_full else logging.ERROR,
                    "pruning %s failed: %s", self.path, done.error)
        elif done.events:
            log.info("pruned %d oldest events from %s (its data over %d bytes), and %d "
                     "thread and %d process rows no kept event named", done.events,
                     self.path, cap, done.threads, done.processes)

    def used_bytes(self) -> int:
        """Bytes of the main file holding data (free pages left by pruning excluded)."""
        return used_bytes(self._conn)

    def _max_seq(self, table: str, col: str) -> int:
        top = self._scalar(
            f"SELECT max({col}) FROM {table} WHERE {col} BETWEEN ? AND ?", self._lo, self._hi
        )
        return (top & SEQ_MASK) if top else 0

    def _scalar(self, sql: str, *params: Any) -> int:
        row = self._conn.execute(sql, params).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    @property
    def next_seq(self) -> int:
        return self._next_seq


def _lowest(*caps: int | None) -> int | None:
    known = [c for c in caps if c is not None]
    return min(known) if known else None


def _check_session_fields(fields: Mapping[str, object]) -> None:
    # Checked on the caller's thread: a bad field must not cost the batch it lands in.
    unknown = set(fields) - set(_SESSION_COLS)
    if unknown:
        raise ValueError(f"unknown session fields {sorted(unknown)}")


def _insert_blocks(conn: sqlite3.Connection, head: str, width: int,
                   rows: Sequence[Sequence[Any]]) -> None:
    """``head`` + VALUES for each row, BLOCK rows per statement (the rest one by one).
    Every row must have ``width`` values: the flattened blocks are checked, since a
    short row would otherwise shift its neighbours' columns instead of failing."""
    one = "(" + ", ".join("?" * width) + ")"
    full = len(rows) - len(rows) % BLOCK
    if full:
        flat = list(chain.from_iterable(rows[:full]))
        if len(flat) != full * width:
            full = 0  # a malformed row: the one-row statements below say which
        else:
            step = width * BLOCK
            conn.executemany(head + ", ".join([one] * BLOCK),
                             [flat[j:j + step] for j in range(0, len(flat), step)])
    if full < len(rows):
        conn.executemany(head + one, rows[full:])


def _with_ids(base: int, rows: Sequence[EventRow]) -> Iterator[tuple[int, ...]]:
    for i, row in enumerate(rows):
        yield (base + i, *row)


def _rows_of(item: _Item) -> int:
    return len(item.rows) if isinstance(item.rows, list | tuple) else 1


def _jsonish(value: object) -> object:
    """Lists and dicts go in as JSON text; everything else as it is."""
    if isinstance(value, list | dict | tuple):
        return orjson.dumps(value).decode()
    return value
