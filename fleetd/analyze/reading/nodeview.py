"""What the causal-chain analysis reads from one node's window, and the records it reads.

:class:`NodeView` holds the bounded queries (a thread's host events, the block I/O of the
window, who ran when a thread left the CPU, an event's stack, kernel or wait channel);
:class:`Ev` is one stored event as those queries return it, and :func:`task_state` reads
an off-CPU record's scheduler state. The spikes (fleetd.analyze.causes.spikes) and the chains
(fleetd.analyze.causes.chains) are built on them.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from operator import itemgetter

import orjson

from fleetd.analyze.reading.answers_chain import Task
from fleetd.analyze.reading.data import CALL_CODES, Node, code, in_list
from fleetd.analyze.reading.profile import StackCount, StackRow, counts_of, stack_rows
from fleetd.analyze.reading.sums import Sum
from fleetd.analyze.reading.window import Window
from fleetd.store.sparse import sparse_only

OFF_CPU, RUNQ, WAKEUP = code("off_cpu"), code("runq_wait"), code("wakeup")
HARDIRQ, SOFTIRQ, BLOCK_IO = code("hardirq"), code("softirq"), code("block_io")
HOST_CODES = (OFF_CPU, WAKEUP, HARDIRQ, SOFTIRQ)
_STATE_MASK = 0xFF  # above it the kernel reports TASK_REPORT_MAX for a preempted task


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
        # Read when a spike first asks (many windows have no D-state spike to explain).
        self._blocks: tuple[list[Ev], list[int], int] | None = None
        self._by_pid: dict[tuple[tuple[int, ...], int, int],
                           dict[int, list[tuple[int, int, int, int, int, int, int]]]] = {}
        self._firsts: dict[tuple[str, tuple[int, ...], int, int], dict[int, int]] = {}
        self._stacks = stacks

    def over(self, t0: int, t1: int) -> NodeView:
        """The same node over [t0, t1) instead of the window (a part of it, or a
        lookback before it): its own reads, none of this view's shared ones."""
        return NodeView(self.conn, self.node, Window(t0, t1, self.win.label), self.tasks,
                        self.names)

    def _load_blocks(self) -> list[Ev]:
        # Block requests: of the traced processes, plus any slow one of the system (a
        # neighbour saturating the disk). Few by construction; kept in memory.
        rows = self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, bytes FROM event_data WHERE ts_ns >= ? "
            f"AND ts_ns < ? AND id BETWEEN ? AND ? AND op = ?{sparse_only((BLOCK_IO,))} "
            "ORDER BY ts_ns",
            (self.win.start_ns - 10**10, self.win.end_ns, self.node.lo, self.node.hi, BLOCK_IO),
        )
        return [Ev(r[0], r[1], r[2], r[3], r[4], BLOCK_IO, nbytes=r[5]) for r in rows]

    def slow_calls(self, thresholds: dict[tuple[int, int], int]
                   ) -> dict[tuple[int, int], list[Ev]]:
        """Per (pid, op) of ``thresholds``: its stored calls in the window at least its
        threshold long, longest first. One read for every group: a query per group
        scanned the whole window again each time (the window is one range of rows)."""
        lowest: dict[int, int] = {}
        for (_, op), thr in thresholds.items():
            lowest[op] = min(thr, lowest.get(op, thr))
        if not lowest:
            return {}
        # Per op its lowest threshold in SQL: what no group of that op can use stays there.
        cond = " OR ".join(f"(op = {int(op)} AND dur_ns >= {int(thr)})"
                           for op, thr in sorted(lowest.items()))
        out: dict[tuple[int, int], list[Ev]] = defaultdict(list)
        for r in self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, op FROM event_data WHERE ts_ns >= ? AND "
            f"ts_ns < ? AND id BETWEEN ? AND ? AND ({cond}) ORDER BY dur_ns DESC",
            (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi),
        ):
            key = (int(r[3]), int(r[5]))
            least = thresholds.get(key)
            if least is not None and r[2] >= least:
                out[key].append(Ev(*r))
        return dict(out)

    def calls_by_pid(self, ops: tuple[int, ...], t0: int, t1: int
                     ) -> dict[int, list[tuple[int, int, int, int, int, int, int]]]:
        """Per process: its stored events of ``ops`` in [t0, t1) as (id, ts_ns, dur_ns,
        tid, op, a0, bytes), in time order. Read once per (ops, span) for every process
        the rules ask about (a query per process scanned the whole span each time)."""
        key = (ops, t0, t1)
        found = self._by_pid.get(key)
        if found is None:
            found = self._by_pid[key] = defaultdict(list)
            for k, ts, dur, pid, tid, op, a0, nbytes in self.conn.execute(
                "SELECT id, ts_ns, dur_ns, pid, tid, op, a0, bytes FROM event_data WHERE "
                f"ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND op IN {in_list(ops)}"
                f"{sparse_only(ops)}",
                (t0, t1, self.node.lo, self.node.hi),
            ):
                found[pid].append((k, ts, dur, tid, op, a0, nbytes))
            # Sorted here, stable (equal times keep the file's order, as ORDER BY did):
            # the rows come nearly in time order, which Python sorts in one run.
            for rows in found.values():
                rows.sort(key=itemgetter(1))
        return found

    def first_of(self, ops: tuple[int, ...], t0: int, t1: int) -> dict[int, int]:
        """Per process: when its first stored event of ``ops`` in [t0, t1) started."""
        key = ("first", ops, t0, t1)
        if key not in self._firsts:
            self._firsts[key] = {int(pid): int(ts) for pid, ts in self.conn.execute(
                "SELECT pid, min(ts_ns) FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND "
                f"id BETWEEN ? AND ? AND op IN {in_list(ops)}{sparse_only(ops)} GROUP BY pid",
                (t0, t1, self.node.lo, self.node.hi))}
        return self._firsts[key]

    def thread_stacks(self, pid: int, tid: int) -> tuple[list[StackCount], int]:
        """One thread's on-CPU samples per stack and their period
        (:func:`~fleetd.analyze.reading.profile.stack_counts` of that thread), from one
        read of the node's samples for every thread asked about."""
        if self._stacks is None:
            self._stacks = stack_rows(self.conn, self.node, self.win)
        return counts_of(self.conn, self.node,
                         [r for r in self._stacks if r[0] == pid and r[1] == tid])

    def call_spans(self, tids: list[int], long_ns: int
                   ) -> tuple[dict[int, tuple[int, int]], dict[int, list[tuple[int, int]]]]:
        """Per thread of ``tids``: from the start of its first stored CUDA call in the
        window to the end of its last, and its calls of at least ``long_ns`` as sorted
        (start, end) pairs. Summed in SQL: the calls themselves stay in the file."""
        where = (f"ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND op IN "
                 f"{in_list(CALL_CODES)} AND tid IN {in_list(tids)}")
        params = (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi)
        spans = self._call_spans(tids)
        long_calls: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for tid, ts, dur in self.conn.execute(
                f"SELECT tid, ts_ns, dur_ns FROM event_data WHERE {where} AND dur_ns >= ?",
                (*params, long_ns)):
            long_calls[int(tid)].append((int(ts), int(ts) + int(dur)))
        for v in long_calls.values():
            v.sort()
        return spans, long_calls

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
        if self._blocks is None:
            blocks = self._load_blocks()
            self._blocks = (blocks, [b.ts for b in blocks], max((b.dur for b in blocks),
                                                                default=0))
        blocks, starts, longest = self._blocks
        i = bisect.bisect_left(starts, t0 - longest)
        j = bisect.bisect_left(starts, t1)
        return [b for b in blocks[i:j] if b.end > t0]

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
        rows = self.conn.execute(
            "SELECT peer, count(*) FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
            "AND id BETWEEN ? AND ? AND tid = ? AND op = ? AND peer != 0 GROUP BY peer",
            (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi, tid, OFF_CPU),
        )
        return {int(peer): int(n) for peer, n in rows}

    def cpu_takers(self, tid: int) -> dict[int, int]:
        """Who held the CPU while ``tid`` was runnable, over all its recorded run-queue
        time (the breakdown's ``runq`` column): a preemption goes to the tasks at its two
        ends (:func:`preempt_takers`), the queued tail of a short sleep to the task that
        took the CPU when the thread went to sleep, when that is the task that takes
        over at most of its switches, and the one that ran until it got the CPU back
        (:func:`tail_takers`). The same ends as a spike's, for the whole window."""
        out: dict[int, int] = defaultdict(int)
        left_to: dict[int, tuple[int, int]] = {}  # end of an off-CPU wait -> (next, dur)
        tails = []
        for op, ts, a0, peer, a1, dur in self.conn.execute(
            "SELECT op, ts_ns, a0, peer, a1, dur_ns FROM event_data WHERE ts_ns >= ? AND "
            "ts_ns < ? AND id BETWEEN ? AND ? AND tid = ? AND op IN (?, ?)",
            (self.win.start_ns - MAX_SLEEP_BEFORE_TAIL_NS, self.win.end_ns, self.node.lo,
             self.node.hi, tid, OFF_CPU, RUNQ),
        ):
            state = task_state(int(a0 or 0))
            if op == OFF_CPU:
                left_to[int(ts) + int(dur)] = (int(peer or 0), int(dur))
                if state == "R" and peer and ts >= self.win.start_ns:
                    for taker, ns in preempt_takers(tid, int(peer), int(a1 or 0), int(dur)):
                        out[taker] += ns
            elif state != "R" and a1 and ts >= self.win.start_ns:
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
        return out

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
