"""Where each traced thread's wall time went (the latency view, after Btune 2.0).

Per thread, over the window: running, run-queue wait (scheduler latency), preempted by
hard/soft IRQs, blocked in D state, sleeping by reason (a lock, waiting for data, a
timer the program set, the GPU inside a sync call, other: :mod:`fleetd.analyze.reading.waits`),
and, overlapping those, inside CUDA calls. The columns add up to the wall time.
Off-CPU intervals are stored from 50 us up, so the split is a lower bound on waiting;
the per-process totals of the in-kernel histograms (every switch) come with it.

The off-CPU interval of a task that slept runs from switch-out to switch-in; its tail
after the wakeup is run-queue wait, stored as a ``runq_wait`` event carrying the same
state, which is how the two are told apart without double counting.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from operator import itemgetter

from fleetd.analyze.causes.chains import task_state
from fleetd.analyze.reading.data import (
    CALL_CODES,
    SYNC_OPS,
    Node,
    code,
    histograms,
    in_list,
    in_window,
)
from fleetd.analyze.reading.profile import StackRow, counts_of, stack_counts
from fleetd.analyze.reading.rows import (
    SUMMED_COLUMNS,
    HistTotal,
    ProcessRow,
    SyscallOutlier,
    ThreadRow,
    WaitChannel,
)
from fleetd.analyze.reading.sums import Sum, event_sums
from fleetd.analyze.reading.waits import REASONS, reason
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import RECLAIM_RUNS
from fleetd.store.syscalls import X86_64

OFF_CPU, RUNQ, SYSCALL = code("off_cpu"), code("runq_wait"), code("syscall")
# Stall runs of reclaim and compaction.
STALL_RUNS = RECLAIM_RUNS.codes
HARDIRQ, SOFTIRQ = code("hardirq"), code("softirq")
SCHED = frozenset((OFF_CPU, RUNQ, HARDIRQ, SOFTIRQ))  # the breakdown's scheduler columns
SYSCALL_OUTLIERS = 5
WCHANS = 3  # D-state wait channels listed per thread
SYNC_CODES = tuple(sorted(code(o) for o in SYNC_OPS))


def thread_breakdown(
    conn: sqlite3.Connection, node: Node, win: Window, span: tuple[int, int],
    tasks: dict[int, tuple[int | None, str | None]], names: dict[int, str],
    pid: int | None = None, sums: list[Sum] | None = None,
    samples: list[StackRow] | None = None,
) -> list[ThreadRow]:
    """One row per thread that has host or CUDA events in the window (``sums``: the
    node's :func:`event_sums` of ``pid``, ``samples`` its on-CPU
    :func:`~fleetd.analyze.reading.profile.stack_rows`, where the caller has them)."""
    acc: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    pids: dict[int, int] = {}
    where, params = in_window(node, win, pid)
    groups = sums if sums is not None else event_sums(conn, node, win, pid)
    # In the order the separate sums were once read (sched, calls, reclaim), so that a
    # thread's process and the order of threads with equal figures stay as they were.
    for g in groups:
        if g.op in SCHED:
            pids[g.tid] = g.pid
            _add_sched(acc[g.tid], g.op, g.state, g.count, g.total, g.why)
    for tid, p, n, total in _per_thread(groups, CALL_CODES, lambda g: g.total):
        pids[tid] = p
        acc[tid]["cuda_calls"] += n
        acc[tid]["in_cuda_stored"] += total
    # Reclaim and compaction stalls (bytes: ns stalled in each run), overlapping the
    # columns above: work the thread does in the kernel for its own allocations.
    for tid, p, _, total in _per_thread(groups, STALL_RUNS, lambda g: g.nbytes):
        pids[tid] = p
        acc[tid]["reclaim"] += total
    # Time spinning in the kernel for a lock another task holds, from the on-CPU
    # samples (the scheduler counts it as running): overlapping running, like reclaim.
    stacks, period = (counts_of(conn, node, samples) if samples is not None
                      else stack_counts(conn, node, win, pid))
    for s in stacks:
        if s.lock_spin and s.tid in acc:
            acc[s.tid]["lock_spin"] += s.samples * period
    wall = max(0, span[1] - span[0])
    _scale_cuda(conn, node, win, acc, pids, pid)
    # Reads that the sums show would find nothing are skipped: sync calls in the window
    # (with ``pid``, a thread's calls in another process sharing its tid count too, so
    # the walk decides), D-state sleeps (the same rows as the sums, ``pid`` or not).
    syncing = None if pid is not None else {g.tid for g in groups if g.op in SYNC_CODES}
    _sync_sleeps(conn, node, win, acc, syncing)
    outliers = _syscall_outliers(conn, node, where, params)
    d_state = any(g.op == OFF_CPU and g.state & 2 for g in groups)
    wchans = (_wait_channels(conn, node, win, pid, sum(g.count for g in groups)) if d_state
              else {})
    rows = [_row(tid, pids[tid], a, wall, tasks, names, outliers.get(tid, []),
                 wchans.get(tid, []))
            for tid, a in acc.items()]
    rows.sort(key=lambda r: (-int(r["in_cuda_ns"]), -int(r["off_cpu_ns"])))
    return rows


def _per_thread(groups: list[Sum], ops: tuple[int, ...], value: Callable[[Sum], int]
                ) -> list[tuple[int, int, int, int]]:
    """(tid, pid, count, sum of ``value``) of the groups of ``ops``, in (tid, pid) order."""
    out: dict[tuple[int, int], list[int]] = {}
    wanted = set(ops)
    for g in groups:
        if g.op in wanted:
            acc = out.setdefault((g.tid, g.pid), [0, 0])
            acc[0] += g.count
            acc[1] += value(g)
    return [(t, p, n, v) for (t, p), (n, v) in sorted(out.items())]


def _add_sched(a: dict[str, int], op: int, a0: int, n: int, total: int, why: str) -> None:
    state = task_state(a0)
    if op == OFF_CPU:
        a["off_cpu"] += total
        a[f"off_{state}"] += total
        a["switches"] += n
        if state == "S":
            a[f"slept_{why}"] += total
    elif op == RUNQ:
        a["runq"] += total
        a[f"runq_after_{state}"] += total
        if state == "S":
            a[f"slept_{why}"] -= total  # the tail after the wakeup is run-queue time
    else:
        a["irq"] += total


def _sync_sleeps(conn: sqlite3.Connection, node: Node, win: Window,
                 acc: dict[int, dict[str, int]], syncing: set[int] | None = None) -> None:
    """Sleeps inside a CUDA sync call are waits for the device, whatever syscall the
    driver slept in: move their overlap with the thread's sync calls (always stored)
    from their syscall's reason to ``gpu_sync``. ``syncing``: the threads with sync
    calls in the window, where the caller knows them."""
    # Only threads with sleep time left to move: a move never takes a reason below 0.
    tids = [t for t, a in acc.items() if a["cuda_calls"] and _has_sleep_time(a)
            and (syncing is None or t in syncing)]
    if not tids:
        return
    syncs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    slept: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    # Both in one pass. Only a thread's own order matters: each sleep moves time between
    # that thread's counters. The calls are sorted here (the rows come nearly in time
    # order, which Python's sort takes in one run; stable: equal starts keep the file's
    # order, as SQLite's ORDER BY did); the sleeps need no order (_move_to_sync).
    for tid, asleep, ts, end, ret in conn.execute(
        "SELECT tid, op = ?, ts_ns, ts_ns + dur_ns, ret FROM event_data WHERE ts_ns >= ? "
        "AND ts_ns < ? AND id BETWEEN ? AND ? AND (op = ? AND a0 & 255 != 0 AND a0 & 2 = 0 "
        f"OR op IN {in_list(SYNC_CODES)}) AND tid IN {in_list(tids)}",
        (OFF_CPU, win.start_ns, win.end_ns, node.lo, node.hi, OFF_CPU),
    ):
        if asleep:
            slept[tid].append((ts, end, ret))
        else:
            syncs[tid].append((ts, end))
    for tid, calls in syncs.items():
        sleeps = slept.get(tid)
        if sleeps:
            calls.sort(key=itemgetter(0))
            _move_to_sync(acc[tid], calls, sleeps)


def _has_sleep_time(a: dict[str, int]) -> bool:
    return any(a.get(f"slept_{r}", 0) > 0 for r in REASONS if r != "gpu_sync")


def _move_to_sync(a: dict[str, int], calls: list[tuple[int, int]],
                  sleeps: list[tuple[int, int, int]]) -> None:
    """Move the overlap of each of the thread's ``sleeps`` (start, end, ret) with its
    ``calls`` (start, end; sorted by start), summed from the last call that began at or
    before the sleep on, from the sleep's reason to ``gpu_sync``.

    Each reason gives up at most what it holds, and nothing else changes it meanwhile,
    so the sum of its sleeps' overlaps moved once, clamped once, moves what moving them
    one by one did, in any order. One loop, inlined (a function call per sleep was half
    the cost at a million sleeps); a sleep that neither begins inside a call nor holds
    the start of one has no overlap and is passed by two comparisons."""
    starts = list(map(itemgetter(0), calls))
    ends = list(map(itemgetter(1), calls))
    n = len(calls)
    inside: dict[str, int] = defaultdict(int)
    first_after = bisect.bisect_right
    for ts, end, ret in sleeps:
        j = first_after(starts, ts)  # the first call that begins after the sleep
        if not ((j and ends[j - 1] > ts) or (j < n and starts[j] < end)):
            continue
        j = j - 1 if j else 0
        found = 0
        while j < n:
            s0, s1 = calls[j]
            if s0 >= end:
                break
            hi = s1 if s1 < end else end
            lo = s0 if s0 > ts else ts
            if hi > lo:
                found += hi - lo
            j += 1
        if found:
            inside[reason(ret)] += found
    for why, total in inside.items():
        moved = min(total, max(0, a[f"slept_{why}"]))
        a[f"slept_{why}"] -= moved
        a["slept_gpu_sync"] += moved


def _scale_cuda(conn: sqlite3.Connection, node: Node, win: Window,
                acc: dict[int, dict[str, int]], pids: dict[int, int], pid: int | None) -> None:
    """Stored CUDA calls are a sample; the histograms hold every call's time per
    process. Share that out to the threads in proportion to their stored time."""
    hists = histograms(conn, node, win, CALL_CODES, pid)
    exact: dict[int, int] = defaultdict(int)
    for (p, _), h in hists.items():
        exact[p] += h.total
    stored: dict[int, int] = defaultdict(int)
    for tid, a in acc.items():
        stored[pids[tid]] += a["in_cuda_stored"]
    for tid, a in acc.items():
        p = pids[tid]
        factor = exact[p] / stored[p] if stored[p] and exact[p] > stored[p] else 1.0
        a["in_cuda"] = int(a["in_cuda_stored"] * factor)
        a["in_cuda_estimated"] = int(factor > 1.0)


def _syscall_outliers(conn: sqlite3.Connection, node: Node, where: str, params: list[int]
                      ) -> dict[int, list[SyscallOutlier]]:
    out: dict[int, list[SyscallOutlier]] = defaultdict(list)
    rows = conn.execute(
        f"SELECT tid, id, ts_ns, dur_ns, a0, ret FROM event_data WHERE {where} AND op = ? "
        "ORDER BY dur_ns DESC LIMIT 500", [*params, SYSCALL],
    ).fetchall()
    for tid, rowkey, ts, dur, nr, ret in rows:
        if len(out[tid]) < SYSCALL_OUTLIERS:
            out[tid].append({"id": node.event_id(rowkey), "ts_ns": ts, "dur_ns": dur, "nr": nr,
                             "name": X86_64.get(nr, f"syscall {nr}"), "ret": ret})
    return out


def _wait_channels(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None,
                   timed: int) -> dict[int, list[WaitChannel]]:
    """Per thread, where its D-state time went: the kernel wait channels the tracer
    recorded (the first frame past the scheduler), most time first.

    The D-state sleeps with args are found from the smaller side: the node's events (a
    walk of the window, ``timed`` rows at least) or its args rows (a walk of those, each
    looked up in the events by id: about 8 times a walked row's cost). Both give the
    same rows, grouped and then ordered the same way."""
    out: dict[int, list[WaitChannel]] = defaultdict(list)
    args = conn.execute("SELECT count(*) FROM event_args WHERE id BETWEEN ? AND ?",
                        (node.lo, node.hi)).fetchone()[0]
    if args * 8 < timed:  # a CROSS JOIN keeps the args the outer loop
        src = ("event_args x CROSS JOIN event_data e ON e.id = x.id WHERE x.id BETWEEN ? "
               "AND ? AND e.ts_ns >= ? AND e.ts_ns < ? AND e.op = ? AND e.a0 & 2 != 0 AND "
               "e.a0 & 255 != 0" + ("" if pid is None else " AND e.pid = ?"))
        params = [node.lo, node.hi, win.start_ns, win.end_ns, OFF_CPU]
        params += [] if pid is None else [pid]
    else:
        where, params = in_window(node, win, pid)
        src = (f"(SELECT id, tid, dur_ns FROM event_data WHERE {where} AND op = ? AND "
               "a0 & 2 != 0 AND a0 & 255 != 0) e JOIN event_args x ON x.id = e.id")
        params.append(OFF_CPU)
    for tid, wchan, n, total in conn.execute(
        f"SELECT e.tid, json_extract(x.args, '$.wchan'), count(*), sum(e.dur_ns) FROM {src} "
        "GROUP BY 1, 2 ORDER BY 4 DESC", params,
    ):
        if wchan and len(out[tid]) < WCHANS:
            out[tid].append({"wchan": str(wchan), "waits": n, "ns": total})
    return out


def _row(tid: int, pid: int, a: dict[str, int], wall: int,
         tasks: dict[int, tuple[int | None, str | None]], names: dict[int, str],
         outliers: list[SyscallOutlier], wchans: list[WaitChannel]) -> ThreadRow:
    runq = min(a["runq"], a["off_cpu"]) if a["off_cpu"] else a["runq"]
    d_state = max(0, a["off_D"] - a["runq_after_D"])
    sleeping = max(0, a["off_S"] - a["runq_after_S"])
    # Preempted intervals are run-queue wait from the switch-out on; when the runq
    # event of one fell under the threshold, the off-CPU interval still counts it.
    runq = max(runq, a["off_R"])
    off = max(a["off_cpu"], runq + d_state + sleeping)
    running = max(0, wall - off - a["irq"])
    waits = _sleep_reasons(a, off - runq - d_state)
    return {
        "pid": pid, "tid": tid, "comm": names.get(pid), "thread": tasks.get(tid, (None, None))[1],
        "wall_ns": wall, "running_ns": running, "runq_ns": runq, "irq_ns": a["irq"],
        "d_state_ns": d_state, "sleeping_ns": sleeping,
        # The five sleep reasons (waits.REASONS), in that order.
        "lock_ns": waits["lock"], "data_ns": waits["data"], "timer_ns": waits["timer"],
        "gpu_sync_ns": waits["gpu_sync"], "other_ns": waits["other"], "off_cpu_ns": off,
        "in_cuda_ns": a["in_cuda"], "in_cuda_estimated": bool(a["in_cuda_estimated"]),
        "reclaim_ns": min(wall, a["reclaim"]),
        "lock_spin_ns": min(running, a["lock_spin"]),
        "cuda_calls_stored": a["cuda_calls"], "switches": a["switches"],
        "syscall_outliers": outliers, "d_state_wchan": wchans,
    }


def _sleep_reasons(a: dict[str, int], sleeping: int) -> dict[str, int]:
    """``sleeping`` split by reason; what no reason accounts for is ``other``, so the
    parts add up to it exactly."""
    out = {r: max(0, a[f"slept_{r}"]) for r in REASONS if r != "other"}
    known = sum(out.values())
    if known > sleeping:  # rounding of run-queue tails: scale down, never above the total
        out = {r: v * sleeping // known for r, v in out.items()}
    out["other"] = sleeping - sum(out.values())
    return out


def process_rows(threads: list[ThreadRow], conn: sqlite3.Connection, node: Node,
                 win: Window) -> list[ProcessRow]:
    """Threads summed per process, with the exact histogram totals beside them."""
    hists = histograms(conn, node, win, (OFF_CPU, RUNQ, code("page_alloc"), code("block_io")))

    def h(pid: int, op: str) -> tuple[int, int]:
        x = hists.get((pid, code(op)))
        return (x.count, x.total) if x else (0, 0)

    def totals(pid: int, op: str) -> HistTotal:
        count, total = h(pid, op)
        return {"count": count, "total_ns": total}

    procs: dict[int, ProcessRow] = {}
    for t in threads:
        pid = t["pid"]
        p = procs.get(pid)
        if p is None:
            allocs, pages = h(pid, "page_alloc")
            p = procs[pid] = {
                "node": node.name, "pid": pid, "comm": t["comm"], "threads": [],
                "running_ns": 0, "runq_ns": 0, "irq_ns": 0, "d_state_ns": 0,
                "sleeping_ns": 0, "lock_ns": 0, "data_ns": 0, "timer_ns": 0,
                "gpu_sync_ns": 0, "other_ns": 0, "off_cpu_ns": 0, "in_cuda_ns": 0,
                "reclaim_ns": 0, "lock_spin_ns": 0, "switches": 0,
                "hist_off_cpu": totals(pid, "off_cpu"), "hist_runq": totals(pid, "runq_wait"),
                "page_allocs": {"count": allocs, "pages": pages},
                "block_io": totals(pid, "block_io"), "top_ops": [],
            }
        for k in SUMMED_COLUMNS:
            p[k] += t[k]
        p["threads"].append(t)
    return sorted(procs.values(), key=lambda p: (-p["in_cuda_ns"], -p["off_cpu_ns"]))
