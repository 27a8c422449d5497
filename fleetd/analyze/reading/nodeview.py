"""What the causal-chain analysis reads from one node's window, and the records it reads.

:class:`NodeView` holds the bounded queries (a thread's host events, the block I/O of the
window, who ran when a thread left the CPU, an event's stack, kernel or wait channel);
:class:`Ev` is one stored event as those queries return it, and :func:`task_state` reads
an off-CPU record's scheduler state. The spikes (fleetd.analyze.causes.spikes) and the chains
(fleetd.analyze.causes.chains) are built on them.
"""

from __future__ import annotations

import bisect
import heapq
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import orjson

from fleetd.analyze.reading.answers_chain import Task
from fleetd.analyze.reading.data import CALL_CODES, Node, code, in_list
from fleetd.analyze.reading.profile import StackCount, StackRow, counts_of, stack_rows
from fleetd.analyze.reading.spanreads import SLEEP_RETS as SLEEP_RETS
from fleetd.analyze.reading.spanreads import SPAN_COLS as SPAN_COLS
from fleetd.analyze.reading.spanreads import (
    CallRow,
    CallsRead,
    SpanReads,
    SpanRow,
    op_range,
)
from fleetd.analyze.reading.sums import TIMED_CODES, Sum
from fleetd.analyze.reading.window import Window
from fleetd.store.sparse import sparse_only

OFF_CPU, RUNQ, WAKEUP = code("off_cpu"), code("runq_wait"), code("wakeup")
HARDIRQ, SOFTIRQ, BLOCK_IO = code("hardirq"), code("softirq"), code("block_io")
HOST_CODES = (OFF_CPU, WAKEUP, HARDIRQ, SOFTIRQ)
_STATE_MASK = 0xFF  # above it the kernel reports TASK_REPORT_MAX for a preempted task
_SUMMED = frozenset(TIMED_CODES)  # the ops the window's sums (reading/sums.py) hold
_CALL_SET = frozenset(CALL_CODES)
# How far before the window a block request may have started and still be in service.
BLOCK_LOOKBACK_NS = 10**10


def task_state(prev_state: int) -> str:
    """R (preempted while runnable), D (uninterruptible) or S (any other sleep)."""
    s = prev_state & _STATE_MASK
    if s == 0:
        return "R"
    return "D" if s & 2 else "S"


@dataclass(slots=True)
class Ev:
    rowkey: int
    ts: int
    dur: int
    pid: int
    tid: int
    op: int
    peer: int = 0
    a0: int = 0
    a1: int = 0
    nbytes: int = 0
    ret: int = 0  # off-CPU records: the syscall the thread slept in, + 1 (waits.reason)

    @property
    def end(self) -> int:
        return self.ts + self.dur


def overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def preempt_takers(tid: int, first: int, last: int, ns: int) -> list[tuple[int, int]]:
    """Who held the CPU while preempted ``tid`` waited ``ns`` for it: the task that took
    the CPU (``first``, the switch's next) and the one that had it last before ``tid``
    got it back (``last``). Two busy loops sharing its CPU take turns: the first always
    takes over and the second always hands back, and charging the whole wait to the
    first named one task for work two did. So two different takers share it half and
    half (a third one between them is not seen: the tracer keeps the two ends)."""
    if last and last != first and last != tid:
        return [(first, ns - ns // 2), (last, ns // 2)]
    return [(first, ns)]


# A wait or call of a thread that calls CUDA at least this long is read with the slow
# calls (spikes.find_stalls' stalls: a shorter between-call wait is ordinary scheduling).
STALL_MIN_NS = 2_000_000
_WAIT_OPS = (OFF_CPU, RUNQ)
EvRow = tuple[int, int, int, int, int, int, int, int, int, int, int]  # Ev's fields




def _has_sparse_index(conn: sqlite3.Connection) -> bool:
    """Whether the file has the sparse ops' index (fleetd.store.sparse; a file written
    before schema version 8 and read read-only has none)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND "
                        "name = 'event_sparse'").fetchone() is not None


def _long_calls_sql(tids: Iterable[int]) -> str:
    return f"op IN {in_list(CALL_CODES)} AND tid IN {in_list(sorted(tids))}"


@dataclass(frozen=True, slots=True)
class StallReads:
    """What :func:`~fleetd.analyze.causes.spikes.find_stalls` reads of its threads: per
    thread its first call's start and last call's end (``spans``), its calls of at least
    the threshold as sorted (start, end) pairs (``long_calls``), and its off-CPU and
    run-queue records of at least the threshold, longest first (``waits``)."""

    spans: dict[int, tuple[int, int]]
    long_calls: dict[int, list[tuple[int, int]]]
    waits: list[EvRow]


# A sleep this short before a run-queue wait: the task that took the CPU when the thread
# went to sleep is most likely still on it when the thread wakes (a busy loop is).
MAX_SLEEP_BEFORE_TAIL_NS = 50_000_000


def tail_takers(tid: int, left_to: int, slept_ns: int, last: int, ns: int,
                waker: int = 0) -> list[tuple[int, int]]:
    """Who held the CPU while ``tid``, just woken, waited ``ns`` for it: the task that
    ran until it got the CPU (``last``, the switch's prev) and, after a short sleep,
    the one that took the CPU when it went to sleep (``left_to``). The prev alone is
    often a bystander: a kernel thread (rcu_preempt, a kworker) or another short task
    preempts a busy loop for microseconds, and the scheduler then picks the woken
    thread, so the loop that held the CPU for the whole wait was never the prev and a
    hog inside the thread's own CPU share was never named. A sleep of more than
    :data:`MAX_SLEEP_BEFORE_TAIL_NS` says nothing about who runs at its end.

    A prev that is also the ``waker`` held the CPU the whole wait: it was running when
    it woke the thread onto its own CPU and ran until it handed that CPU over, so the
    task that took the CPU at the sleep had already lost it (a thread woken by the
    interpreter-lock holder it shares a CPU with, beside an idle-priority loop that
    runs only while both sleep)."""
    if waker and waker == last:
        return [(last, ns)]
    if 0 <= slept_ns <= MAX_SLEEP_BEFORE_TAIL_NS and left_to:
        return preempt_takers(tid, left_to, last, ns)
    return [(last, ns)]


class NodeView:
    """Everything chains need from one node's window, read with bounded queries."""

    def __init__(self, conn: sqlite3.Connection, node: Node, win: Window,
                 tasks: dict[int, tuple[int | None, str | None]], names: dict[int, str],
                 sums: list[Sum] | None = None, stacks: list[StackRow] | None = None
                 ) -> None:
        """``sums``: the window's :func:`~fleetd.analyze.reading.sums.event_sums`, and
        ``stacks`` its :func:`~fleetd.analyze.reading.profile.stack_rows`, where the
        caller has them (each thread's first and last CUDA call, its on-CPU samples)."""
        self.conn, self.node, self.win = conn, node, win
        self.sums = sums
        self.tasks, self.names = tasks, names
        # Read when a spike first asks (many windows have no D-state spike to explain):
        # every request and their starts, or None and [] (read per call), and the longest.
        self._blocks: tuple[list[Ev] | None, list[int], int] | None = None
        self._spans = SpanReads(conn, node)  # the rules' walks of a span
        self._firsts: dict[tuple[str, tuple[int, ...], int, int], dict[int, int]] = {}
        self._stacks = stacks
        self._switched: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        # slow_calls' long calls of the CUDA-calling threads: (those threads, (tid, ts, dur)).
        self._long: tuple[frozenset[int], list[tuple[int, int, int]]] | None = None
        # slow_calls' thresholds and calls, for longest_calls.
        self._slow: tuple[dict[tuple[int, int], int], dict[tuple[int, int], list[Ev]]] | None = None

    def over(self, t0: int, t1: int) -> NodeView:
        """The same node over [t0, t1) instead of the window (a part of it, or a
        lookback before it): its own reads, none of this view's shared ones."""
        return NodeView(self.conn, self.node, Window(t0, t1, self.win.label), self.tasks,
                        self.names)

    def _load_blocks(self, t0: int, t1: int) -> list[Ev]:
        """Block requests starting in [t0, t1): of the traced processes, plus any slow
        one of the system (a neighbour saturating the disk), in time order."""
        rows = self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, bytes FROM event_data WHERE ts_ns >= ? "
            f"AND ts_ns < ? AND id BETWEEN ? AND ? AND op = ?{sparse_only((BLOCK_IO,))} "
            "ORDER BY ts_ns", (t0, t1, self.node.lo, self.node.hi, BLOCK_IO))
        return [Ev(r[0], r[1], r[2], r[3], r[4], BLOCK_IO, nbytes=r[5]) for r in rows]

    def slow_calls(self, thresholds: dict[tuple[int, int], int]
                   ) -> dict[tuple[int, int], list[Ev]]:
        """Per (pid, op) of ``thresholds``: its stored calls in the window at least its
        threshold long, longest first. One read for every group: a query per group
        scanned the whole window again each time (the window is one range of rows).
        Where the window's sums name the threads that call CUDA, the same read keeps
        their calls of at least :data:`STALL_MIN_NS` for :meth:`stall_reads`."""
        lowest: dict[int, int] = {}
        for (_, op), thr in thresholds.items():
            lowest[op] = min(thr, lowest.get(op, thr))
        if not lowest:
            return {}
        # Per op its lowest threshold in SQL: what no group of that op can use stays there.
        cond = " OR ".join(f"(op = {int(op)} AND dur_ns >= {int(thr)})"
                           for op, thr in sorted(lowest.items()))
        callers = self._callers()
        ops, shortest = set(lowest), min(lowest.values())
        if callers:
            cond += f" OR ({_long_calls_sql(callers)} AND dur_ns >= {STALL_MIN_NS})"
            ops.update(CALL_CODES)
            shortest = min(shortest, STALL_MIN_NS)
        out: dict[tuple[int, int], list[Ev]] = defaultdict(list)
        long_calls: list[tuple[int, int, int]] = []
        for r in self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, op FROM event_data WHERE ts_ns >= ? AND "
            f"ts_ns < ? AND id BETWEEN ? AND ? AND {op_range(ops)} AND dur_ns >= "
            f"{int(shortest)} AND ({cond}) ORDER BY dur_ns DESC",
            (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi),
        ):
            key = (int(r[3]), int(r[5]))
            least = thresholds.get(key)
            # A row of a group at or above its threshold is one its op's condition took.
            if least is not None and r[2] >= least:
                out[key].append(Ev(*r))
            if r[2] >= STALL_MIN_NS and r[5] in _CALL_SET and r[4] in callers:
                long_calls.append((r[4], r[1], r[2]))
        if callers:
            self._long = (callers, long_calls)
        self._slow = (dict(thresholds), dict(out))
        return dict(out)

    def longest_calls(self, pid: int, ops: Iterable[int], t0: int, t1: int, n: int
                      ) -> list[tuple[int, int, int, int, int]]:
        """The ``n`` longest stored calls of ``pid`` of ``ops`` in [t0, t1) as (id, ts_ns,
        dur_ns, tid, op), longest first (equal ones in the file's order, as ORDER BY gave
        them): from :meth:`slow_calls`' rows where they surely hold them, else read."""
        codes = sorted({int(op) for op in ops})
        found = self._longest_read(pid, codes, t0, t1, n)
        if found is None:
            found = self._longest_slow(pid, codes, t0, t1, n)
        if found is not None:
            return found
        return [(int(k), int(ts), int(dur), int(tid), int(op)) for k, ts, dur, tid, op in
                self.conn.execute(
                    "SELECT id, ts_ns, dur_ns, tid, op FROM event_data WHERE ts_ns >= ? AND "
                    f"ts_ns < ? AND id BETWEEN ? AND ? AND {op_range(codes)} AND pid = ? AND "
                    f"op IN {in_list(codes)} ORDER BY dur_ns DESC LIMIT {int(n)}",
                    (t0, t1, self.node.lo, self.node.hi, pid))]

    def _longest_read(self, pid: int, codes: list[int], t0: int, t1: int, n: int
                      ) -> list[tuple[int, int, int, int, int]] | None:
        """:meth:`longest_calls` from :meth:`calls_by_pid`'s rows of the same span that
        hold these ops (every call of them), where it read them; None otherwise."""
        wanted = set(codes)
        # A snapshot: a walk read ahead in a thread may be adding its sets meanwhile.
        for (ops, a, b), by_pid in list(self._spans.by_pid.items()):
            if (a, b) == (t0, t1) and wanted <= set(ops):
                rows = [r for r in by_pid.get(pid, []) if r[5] in wanted]
                # Equal ones in the order of the walk (by id), as in _longest_slow.
                top = heapq.nsmallest(n, rows, key=lambda r: (-r[2], r[0]))
                return [(r[0], r[1], r[2], r[4], r[5]) for r in top]
        return None

    def _longest_slow(self, pid: int, codes: list[int], t0: int, t1: int, n: int
                      ) -> list[tuple[int, int, int, int, int]] | None:
        """:meth:`longest_calls` from the slow calls, when they hold every call of the
        process's ops at least as long as the n-th longest among them: each op with calls
        in the window (its sums) read at a threshold at most that long. None otherwise."""
        if self._slow is None or self.sums is None or not set(codes) <= _SUMMED or not (
                self.win.start_ns <= t0 and t1 <= self.win.end_ns):
            return None
        thresholds, slow = self._slow
        called = {g.op for g in self.sums if g.pid == pid and g.count}
        limits = [thresholds.get((pid, op)) for op in codes if op in called]
        if not limits or None in limits:
            return None  # an op of the process read at no threshold
        found = [e for op in codes for e in slow.get((pid, op), []) if t0 <= e.ts < t1]
        # Equal ones in the order of the read's walk (by id: the window's reads walk the
        # node's rows by id, and SQLite's sort keeps the order rows come in).
        found.sort(key=lambda e: (-e.dur, e.rowkey))
        top = found[:n]
        if len(top) < n or top[-1].dur < max(t for t in limits if t is not None):
            return None
        return [(e.rowkey, e.ts, e.dur, e.tid, e.op) for e in top]

    def _callers(self) -> frozenset[int]:
        """The threads with stored CUDA calls in the window, from its sums (empty
        without them): the breakdown's threads with ``cuda_calls_stored``."""
        if self.sums is None:
            return frozenset()
        return frozenset(g.tid for g in self.sums if g.op in _CALL_SET and g.count)

    def stall_reads(self, tids: list[int], long_ns: int, limit: int) -> StallReads:
        """The calls and waits of ``tids`` at least ``long_ns`` long (see
        :class:`StallReads`; the ``limit`` longest waits): the calls from
        :meth:`slow_calls`' read where it kept them."""
        wanted = frozenset(tids)
        params = (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi, long_ns)
        window = "ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?"
        if self._long is not None and long_ns == STALL_MIN_NS and wanted <= self._long[0]:
            calls = [r for r in self._long[1] if r[0] in wanted]
        else:
            calls = self.conn.execute(
                f"SELECT tid, ts_ns, dur_ns FROM event_data WHERE {window} AND "
                f"{_long_calls_sql(wanted)} AND dur_ns >= ?", params).fetchall()
        long_calls: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for tid, ts, dur in calls:
            long_calls[int(tid)].append((int(ts), int(ts) + int(dur)))
        for v in long_calls.values():
            v.sort()
        # Its own read: the waits of at least long_ns are many (a loop's timer sleeps),
        # and only the longest are wanted.
        waits = self.conn.execute(
            f"SELECT id, ts_ns, dur_ns, pid, tid, op, peer, a0, a1, 0, ret FROM event_data "
            f"WHERE {window} AND {op_range(_WAIT_OPS)} AND dur_ns >= ? AND op IN "
            f"{in_list(_WAIT_OPS)} AND tid IN {in_list(tids)} ORDER BY dur_ns DESC "
            f"LIMIT {int(limit)}", params).fetchall()
        return StallReads(self._call_spans(tids), dict(long_calls), waits)

    def calls_by_pid(self, ops: tuple[int, ...], t0: int, t1: int,
                     together: tuple[tuple[int, ...], ...] = (),
                     sleepers: Collection[int] = ()) -> dict[int, list[CallRow]]:
        """Per process: its stored events of ``ops`` in [t0, t1), read once with the op
        sets of ``together`` and the sleeps of ``sleepers`` (SpanReads.calls_by_pid)."""
        return self._spans.calls_by_pid(ops, t0, t1, together, sleepers)

    def sleep_rows(self, tids: Collection[int], t0: int, t1: int
                   ) -> dict[int, tuple[list[SpanRow], list[SpanRow], list[SpanRow]]]:
        """Per thread: its sleeps, wakeups and run-queue records the rules read
        (SpanReads.sleep_rows)."""
        return self._spans.sleep_rows(tids, t0, t1)

    def prefetch_calls(self, reopen: Callable[[], sqlite3.Connection], ops: tuple[int, ...],
                       t0: int, t1: int, together: tuple[tuple[int, ...], ...] = (),
                       sleepers: Collection[int] = ()) -> None:
        """:meth:`calls_by_pid`'s walk started in a thread (SpanReads.prefetch_calls)."""
        self._spans.prefetch_calls(reopen, ops, t0, t1, together, sleepers)

    def calls_read(self, sets: list[tuple[int, ...]], t0: int, t1: int,
                   sleepers: Collection[int]) -> CallsRead:
        """That walk as plain values, for another process (SpanReads.calls_read)."""
        return self._spans.calls_read(sets, t0, t1, sleepers)

    def await_calls(self, fetch: Callable[[], CallsRead | None]) -> None:
        """That walk read elsewhere, taken when first asked for (SpanReads.await_calls)."""
        self._spans.await_calls(fetch)

    def first_of(self, ops: tuple[int, ...], t0: int, t1: int) -> dict[int, int]:
        """Per process: when its first stored event of ``ops`` in [t0, t1) started."""
        key = ("first", ops, t0, t1)
        if key not in self._firsts:
            found = self._first_from_sums(ops, t0, t1)
            self._firsts[key] = found if found is not None else {
                int(pid): int(ts) for pid, ts in self.conn.execute(
                    "SELECT pid, min(ts_ns) FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
                    f"AND id BETWEEN ? AND ? AND op IN {in_list(ops)}{sparse_only(ops)} "
                    "GROUP BY pid", (t0, t1, self.node.lo, self.node.hi))}
        return self._firsts[key]

    def _first_from_sums(self, ops: tuple[int, ...], t0: int, t1: int
                         ) -> dict[int, int] | None:
        """:meth:`first_of` from the window's sums (each group's first start), without a
        walk of the window; None where they cannot say: no sums, an op they leave out, a
        span reaching outside the window, or a process whose first event lies before
        ``t0`` (its first one inside the span is then another event)."""
        if self.sums is None or not set(ops) <= _SUMMED or not (
                self.win.start_ns <= t0 and t1 <= self.win.end_ns):
            return None
        wanted = set(ops)
        first: dict[int, int] = {}
        for g in self.sums:
            if g.op in wanted and g.count:
                first[g.pid] = min(g.first, first.get(g.pid, g.first))
        if any(ts < t0 for ts in first.values()):
            return None
        # A process whose first event is at or after t1 has none in [t0, t1).
        return {pid: ts for pid, ts in sorted(first.items()) if ts < t1}

    def thread_stacks(self, pid: int, tid: int) -> tuple[list[StackCount], int]:
        """One thread's on-CPU samples per stack and their period
        (:func:`~fleetd.analyze.reading.profile.stack_counts` of that thread), from one
        read of the node's samples for every thread asked about."""
        if self._stacks is None:
            self._stacks = stack_rows(self.conn, self.node, self.win)
        return counts_of(self.conn, self.node,
                         [r for r in self._stacks if r[0] == pid and r[1] == tid])

    def _call_spans(self, tids: list[int]) -> dict[int, tuple[int, int]]:
        if self.sums is None:
            where = (f"ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND op IN "
                     f"{in_list(CALL_CODES)} AND tid IN {in_list(tids)}")
            return {int(tid): (int(lo), int(hi)) for tid, lo, hi in self.conn.execute(
                f"SELECT tid, min(ts_ns), max(ts_ns + dur_ns) FROM event_data WHERE {where} "
                "GROUP BY tid", (self.win.start_ns, self.win.end_ns, self.node.lo,
                                 self.node.hi))}
        calls, wanted = set(CALL_CODES), set(tids)
        out: dict[int, tuple[int, int]] = {}
        for g in self.sums:
            if g.op in calls and g.tid in wanted:
                lo, hi = out.get(g.tid, (g.first, g.last_end))
                out[g.tid] = (min(lo, g.first), max(hi, g.last_end))
        return out

    def blocks_overlapping(self, t0: int, t1: int) -> list[Ev]:
        """The block requests of the window (and the :data:`BLOCK_LOOKBACK_NS` before
        it) in service at some time in [t0, t1), in time order. Read per call by the
        sparse index where the file has it (a spike asks about a few; a long recording
        holds hundreds of thousands), else all of them once, kept in memory."""
        since = self.win.start_ns - BLOCK_LOOKBACK_NS
        if self._blocks is None:
            if _has_sparse_index(self.conn):
                self._blocks = (None, [], self._longest_block(since))
            else:
                every = self._load_blocks(since, self.win.end_ns)
                self._blocks = (every, [b.ts for b in every],
                                max((b.dur for b in every), default=0))
        blocks, starts, longest = self._blocks
        if blocks is None:  # read by the index, those that can reach into [t0, t1)
            found = self._load_blocks(max(since, t0 - longest), min(t1, self.win.end_ns))
            return [b for b in found if b.end > t0]
        i = bisect.bisect_left(starts, t0 - longest)
        j = bisect.bisect_left(starts, t1)
        return [b for b in blocks[i:j] if b.end > t0]

    def _longest_block(self, since: int) -> int:
        """The longest block request starting in [since, window end): the window's
        from its sums, where they are there, the rest read (by the sparse index)."""
        upto = self.win.end_ns if self.sums is None else self.win.start_ns
        row = self.conn.execute(
            "SELECT max(dur_ns) FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id "
            f"BETWEEN ? AND ? AND op = ?{sparse_only((BLOCK_IO,))}",
            (since, upto, self.node.lo, self.node.hi, BLOCK_IO)).fetchone()
        durs = [int(row[0])] if row and row[0] is not None else []
        durs += [g.top for g in self.sums or [] if g.op == BLOCK_IO and g.count]
        return max(durs, default=0)

    def host_events(self, tid: int, t0: int, t1: int) -> list[Ev]:
        """Off-CPU, wakeup and IRQ events of one thread starting in [t0, t1)."""
        rows = self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, op, peer, a0, a1, 0, ret FROM event_data "
            "WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND tid = ? "
            f"AND op IN {in_list(HOST_CODES)} ORDER BY ts_ns",
            (t0, t1, self.node.lo, self.node.hi, tid),
        )
        return [Ev(*r) for r in rows]

    def switch_peers(self, tid: int) -> dict[int, int]:
        """How often each task was the next to run when ``tid`` left the CPU, any reason.

        A task that is always runnable beside the victim (a busy loop on its CPU, or in
        its CPU-quota slice) takes over at nearly every switch, voluntary ones included;
        the task that happens to run first after a throttled or long wait does not.
        """
        return self._switches(tid)[1]

    def cpu_takers(self, tid: int) -> dict[int, int]:
        """Who held the CPU while ``tid`` was runnable, over all its recorded run-queue
        time (the breakdown's ``runq`` column): a preemption goes to the tasks at its two
        ends (:func:`preempt_takers`), the queued tail of a short sleep to the task that
        took the CPU when the thread went to sleep, when that is the task that takes
        over at most of its switches, and the one that ran until it got the CPU back
        (:func:`tail_takers`). The same ends as a spike's, for the whole window."""
        return self._switches(tid)[0]

    def _switches(self, tid: int) -> tuple[dict[int, int], dict[int, int]]:
        """:meth:`cpu_takers` and :meth:`switch_peers` of ``tid``, from one read of its
        off-CPU and run-queue records (a chain of CPU contention asks for both)."""
        found = self._switched.get(tid)
        if found is not None:
            return found
        start = self.win.start_ns
        out: dict[int, int] = defaultdict(int)
        switched: Counter[int] = Counter()  # switch_peers: off-CPU records in the window
        left_to: dict[int, tuple[int, int]] = {}  # end of an off-CPU wait -> (next, dur)
        tails = []
        for op, ts, a0, peer, a1, dur in self.conn.execute(
            "SELECT op, ts_ns, a0, peer, a1, dur_ns FROM event_data WHERE ts_ns >= ? AND "
            f"ts_ns < ? AND id BETWEEN ? AND ? AND {op_range(_WAIT_OPS)} AND tid = ? AND "
            "op IN (?, ?)",
            (start - MAX_SLEEP_BEFORE_TAIL_NS, self.win.end_ns, self.node.lo,
             self.node.hi, tid, OFF_CPU, RUNQ),
        ):
            preempted = not int(a0 or 0) & _STATE_MASK  # task_state "R", without the call
            if op == OFF_CPU:
                left_to[int(ts) + int(dur)] = (int(peer or 0), int(dur))
                if peer and ts >= start:
                    switched[int(peer)] += 1
                if preempted and peer and ts >= start:
                    for taker, ns in preempt_takers(tid, int(peer), int(a1 or 0), int(dur)):
                        out[taker] += ns
            elif not preempted and a1 and ts >= start:
                tails.append((int(ts) + int(dur), int(a1), int(dur), int(peer or 0)))
        # Only the task that takes over at most of the thread's switches (a busy loop
        # beside it) is still on the CPU when the thread wakes; another one that took
        # the CPU at one sleep (a peer's short step) has long gone back to sleep.
        peers = Counter(peer for peer, _ in left_to.values() if peer)
        top = peers.most_common(1)
        busy = top[0][0] if top and top[0][1] * 2 >= sum(peers.values()) else 0
        for end, last, ns, waker in tails:
            first, off = left_to.get(end, (0, 0))
            for taker, part in tail_takers(tid, first if first == busy else 0, off - ns,
                                           last, ns, waker):
                out[taker] += part
        found = self._switched[tid] = (out, dict(sorted(switched.items())))
        return found

    def wait_channel(self, ev: Ev) -> str | None:
        """The kernel function a D-state wait slept in, when the tracer recorded it."""
        row = self.conn.execute("SELECT json_extract(args, '$.wchan') FROM event_args "
                                "WHERE id = ?", (ev.rowkey,)).fetchone()
        return str(row[0]) if row and row[0] else None

    def kernel(self, ev: Ev) -> str | None:
        """The kernel a launch started, when the tracer named it."""
        row = self.conn.execute("SELECT json_extract(args, '$.kernel') FROM event_args "
                                "WHERE id = ?", (ev.rowkey,)).fetchone()
        return str(row[0]) if row and isinstance(row[0], str) and row[0] else None

    def stack(self, ev: Ev) -> list[str]:
        """The recorded stack of an event (innermost first), or [] when it has none."""
        row = self.conn.execute("SELECT s.frames FROM event_data e JOIN stacks s ON "
                                "s.hash = e.stack WHERE e.id = ? AND e.stack != 0",
                                (ev.rowkey,)).fetchone()
        try:
            value = orjson.loads(row[0]) if row else None
        except orjson.JSONDecodeError:  # a frames value from a foreign writer: one frame
            return [str(row[0])]
        return [str(f) for f in value] if isinstance(value, list) else []

    def next_call_stack(self, ev: Ev) -> list[str]:
        """The stack of the thread's next CUDA call after ``ev`` (within a second)."""
        row = self.conn.execute(
            "SELECT id FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
            f"AND tid = ? AND op IN {in_list(CALL_CODES)} ORDER BY ts_ns LIMIT 1",
            (ev.end, ev.end + 10**9, self.node.lo, self.node.hi, ev.tid)).fetchone()
        return self.stack(Ev(int(row[0]), 0, 0, 0, ev.tid, 0)) if row else []

    def who(self, tid: int) -> Task:
        """A task as the output shows it: pid, tid and the process name."""
        pid, thread = self.tasks.get(tid, (None, None))
        comm = self.names.get(pid) if pid is not None else None
        return {"pid": pid if pid is not None else tid, "tid": tid,
                "comm": comm or thread or f"tid {tid}", "thread": thread}

    def event_id(self, ev: Ev) -> str:
        return self.node.event_id(ev.rowkey)
