"""The rules' walks of a span: every process's calls of some ops and the feeding
threads' sleeps, read once for all the rules that ask (fleetd.analyze.causes.rules),
and kept as SQLite returns the rows (there are millions on a long window).

A walk can be read ahead: in a thread on a connection of its own
(:meth:`SpanReads.prefetch_calls`: SQLite steps it without the interpreter lock), or by
another process (:meth:`SpanReads.calls_read` there, :meth:`SpanReads.await_calls`
here: fleetd.analyze.pernode.preload's child). Either is taken when a rule first asks.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from operator import itemgetter

from fleetd.analyze.reading.data import Node, code, in_list
from fleetd.analyze.reading.waits import OUTPUT_RETS, rets_of
from fleetd.store.sparse import sparse_only

OFF_CPU, RUNQ, WAKEUP = code("off_cpu"), code("runq_wait"), code("wakeup")


def op_range(codes: Iterable[int]) -> str:
    """``op >= lo AND op <= hi`` around ``codes``: true of every row a read of them
    wants, and put first it turns most other rows away at one comparison each (an
    ``IN`` list or a chain of ``OR`` terms costs a walk of the window up to 70% more).
    Never written ``BETWEEN``: ``op BETWEEN 200 AND 299`` is a term of the sparse
    index's condition, and SQLite would then read by that index, in another order."""
    wanted = [int(c) for c in codes]
    return f"op >= {min(wanted)} AND op <= {max(wanted)}"


# The sleeps the wait and pipe rules read: for a lock, for input, in a write. The rest
# (most are timers a loop sets) stay in the file.
SLEEP_RETS = rets_of("lock", "data") | OUTPUT_RETS
_SLEEP_OPS = (OFF_CPU, RUNQ, WAKEUP)
# The columns of the span's reads, calls and sleeps alike (a SpanRow).
SPAN_COLS = ("id", "ts_ns", "dur_ns", "pid", "tid", "op", "a0", "bytes", "peer", "stack",
             "ret")
_SPAN_COLS = ", ".join(SPAN_COLS)
SpanRow = tuple[int, int, int, int, int, int, int, int, int, int, int]
CallRow = SpanRow  # a call of NodeView.calls_by_pid: as read, no tuple of its own per row


def _sleeps_sql(tids: Iterable[int]) -> str:
    """The rows of :meth:`SpanReads.sleep_rows` of ``tids``."""
    return (f"{op_range(_SLEEP_OPS)} AND tid IN {in_list(sorted(tids))} AND (op IN "
            f"({WAKEUP}, {RUNQ}) OR (op = {OFF_CPU} AND a0 & 255 != 0 AND a0 & 2 = 0 AND "
            f"ret IN {in_list(sorted(SLEEP_RETS))}))")


@dataclass(slots=True)
@dataclass(frozen=True)
class CallsRead:
    """:meth:`SpanReads.calls_read`'s answer as plain values: per op set, per process,
    the rows of :data:`SPAN_COLS` in time order; the sleepers and their sleep rows per
    op and thread (None: none read)."""

    calls: dict[tuple[int, ...], dict[int, list[CallRow]]]
    t0: int
    t1: int
    sleeps: tuple[list[int], dict[int, dict[int, list[SpanRow]]]] | None


class _SleepRows:
    """Sleep, wakeup and run-queue rows of some threads (``tids``), per op and thread."""

    tids: frozenset[int]
    rows: dict[int, dict[int, list[SpanRow]]]

    def __init__(self, tids: Iterable[int]) -> None:
        self.tids = frozenset(tids)
        self.rows = {op: defaultdict(list) for op in _SLEEP_OPS}

    def add(self, row: SpanRow) -> None:
        self.rows[row[5]][row[4]].append(row)

    def sorted(self) -> _SleepRows:
        for by_tid in self.rows.values():
            for rows in by_tid.values():
                rows.sort(key=itemgetter(1))  # stable: equal times in the file's order
        return self


class SpanReads:
    """One node's walks of spans (:meth:`calls_by_pid`, :meth:`sleep_rows`), each read
    once and kept."""

    def __init__(self, conn: sqlite3.Connection, node: Node) -> None:
        self.conn, self.node = conn, node
        self.by_pid: dict[tuple[tuple[int, ...], int, int], dict[int, list[CallRow]]] = {}
        self.sleeps: dict[tuple[int, int], _SleepRows] = {}  # per span: calls_by_pid's
        self._pending: Callable[[], None] | None = None  # a read in flight

    def calls_by_pid(self, ops: tuple[int, ...], t0: int, t1: int,
                     together: tuple[tuple[int, ...], ...] = (),
                     sleepers: Collection[int] = ()) -> dict[int, list[CallRow]]:
        """Per process: its stored events of ``ops`` in [t0, t1) as rows of
        :data:`SPAN_COLS`, in time order. Read once per (ops, span) for every process
        the rules ask about (a query per process scanned the whole span each time), and
        in the same read the other op sets of ``together`` not read yet (each kept for
        its own call) and the sleeps of ``sleepers`` (:meth:`sleep_rows`): one walk of
        the span for them all."""
        self.settle()
        key = (ops, t0, t1)
        if key not in self.by_pid:
            self._read_calls(*self._calls_plan(ops, t0, t1, together, sleepers))
        return self.by_pid[key]

    def _calls_plan(self, ops: tuple[int, ...], t0: int, t1: int,
                    together: tuple[tuple[int, ...], ...], sleepers: Collection[int]
                    ) -> tuple[list[tuple[int, ...]], int, int, Collection[int]]:
        """What one read of :meth:`calls_by_pid` takes: the op sets not read yet, the
        span, and the sleepers (none when a scheduler op is among the calls, which would
        then be both: those are read apart)."""
        sets = [ops, *(o for o in together if o != ops and (o, t0, t1) not in self.by_pid)]
        apart = (t0, t1) in self.sleeps or any(set(o) & set(_SLEEP_OPS) for o in sets)
        return sets, t0, t1, () if apart else sleepers

    def prefetch_calls(self, reopen: Callable[[], sqlite3.Connection], ops: tuple[int, ...],
                       t0: int, t1: int, together: tuple[tuple[int, ...], ...] = (),
                       sleepers: Collection[int] = ()) -> None:
        """Start :meth:`calls_by_pid`'s read in a thread on a connection of its own
        (``reopen``): SQLite walks the span without the interpreter lock while the
        caller goes on. The next :meth:`calls_by_pid` or :meth:`sleep_rows` waits for
        it; a read that failed there is read again then."""
        if (ops, t0, t1) in self.by_pid or self._pending is not None:
            return
        plan = self._calls_plan(ops, t0, t1, together, sleepers)

        def read() -> None:
            conn = reopen()
            try:
                self._read_calls(*plan, conn=conn)
            finally:
                conn.close()

        thread = threading.Thread(target=read, name="fleetd-prefetch", daemon=True)
        thread.start()
        self._pending = thread.join

    def calls_read(self, sets: list[tuple[int, ...]], t0: int, t1: int,
                   sleepers: Collection[int]) -> CallsRead:
        """:meth:`calls_by_pid`'s read of the op ``sets`` and the sleeps of ``sleepers``
        over [t0, t1), as plain values (another process reads it for this one:
        fleetd.analyze.pernode.preload)."""
        self._read_calls(sets, t0, t1, sleepers)
        slept = self.sleeps.get((t0, t1))
        return CallsRead(
            {ops: {pid: rows for pid, rows in self.by_pid[(ops, t0, t1)].items()}
             for ops in sets}, t0, t1,
            None if slept is None else (sorted(slept.tids), {
                op: dict(by_tid) for op, by_tid in slept.rows.items()}))

    def await_calls(self, fetch: Callable[[], CallsRead | None]) -> None:
        """A read of :meth:`calls_read` made elsewhere, taken when :meth:`calls_by_pid`
        or :meth:`sleep_rows` first needs it (None then: read here as usual)."""
        if self._pending is not None:
            return

        def take() -> None:
            got = fetch()
            if got is None:
                return
            for ops, by_pid in got.calls.items():
                self.by_pid[(ops, got.t0, got.t1)] = defaultdict(list, by_pid)
            if got.sleeps is not None:
                slept = _SleepRows(got.sleeps[0])
                for op, by_tid in got.sleeps[1].items():
                    slept.rows[op] = defaultdict(list, by_tid)
                self.sleeps[(got.t0, got.t1)] = slept

        self._pending = take

    def settle(self) -> None:
        """Take a read in flight (:meth:`prefetch_calls`, :meth:`await_calls`)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _read_calls(self, sets: list[tuple[int, ...]], t0: int, t1: int,
                    sleepers: Collection[int], conn: sqlite3.Connection | None = None
                    ) -> None:
        """One walk of [t0, t1) for the calls of every op set and the sleeps of
        ``sleepers``; kept once whole (a prefetch that failed leaves nothing)."""
        into: dict[int, list[dict[int, list[CallRow]]]] = defaultdict(list)
        read: dict[tuple[tuple[int, ...], int, int], dict[int, list[CallRow]]] = {}
        for ops in sets:
            found: dict[int, list[CallRow]] = defaultdict(list)
            read[(ops, t0, t1)] = found
            for op in ops:
                into[op].append(found)
        codes = sorted(into)
        cond = f"{op_range(codes)} AND op IN {in_list(codes)}{sparse_only(codes)}"
        if sleepers:
            cond = f"({cond}) OR ({_sleeps_sql(sleepers)})"
        slept = _SleepRows(sleepers)
        by_op = slept.rows
        # Each row kept as SQLite gives it (no tuple of its own: there are millions).
        for row in (conn or self.conn).execute(
                f"SELECT {_SPAN_COLS} FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id "
                f"BETWEEN ? AND ? AND ({cond})", (t0, t1, self.node.lo, self.node.hi)):
            calls = into.get(row[5])
            if calls is None:
                by_op[row[5]][row[4]].append(row)  # a sleep
                continue
            for found in calls:
                found[row[3]].append(row)
        # Sorted here, stable (equal times keep the file's order, as ORDER BY did): the
        # rows come nearly in time order, which Python sorts in one run.
        for by_pid in read.values():
            for rows in by_pid.values():
                rows.sort(key=itemgetter(1))
        if sleepers:
            self.sleeps[(t0, t1)] = slept.sorted()
        self.by_pid.update(read)

    def sleep_rows(self, tids: Collection[int], t0: int, t1: int
                   ) -> dict[int, tuple[list[SpanRow], list[SpanRow], list[SpanRow]]]:
        """Per thread of ``tids``: its sleeps the rules read (S state, in a syscall of
        :data:`SLEEP_RETS`), its wakeups and its run-queue records in [t0, t1), each in
        time order, rows of :data:`SPAN_COLS`. From :meth:`calls_by_pid`'s read where it
        read them for these threads, else one read for all of them."""
        self.settle()
        found = self.sleeps.get((t0, t1))
        if found is None or not set(tids) <= found.tids:
            found = _SleepRows(tids)
            for row in self.conn.execute(
                    f"SELECT {_SPAN_COLS} FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND "
                    f"id BETWEEN ? AND ? AND {_sleeps_sql(tids)}",
                    (t0, t1, self.node.lo, self.node.hi)):
                found.add(row)
            found = found.sorted()
        return {t: (found.rows[OFF_CPU].get(t, []), found.rows[WAKEUP].get(t, []),
                    found.rows[RUNQ].get(t, [])) for t in tids}
