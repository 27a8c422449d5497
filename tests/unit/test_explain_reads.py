"""Explain reads each kind of row once per node (#44.3): the shared reads give what a
read per process, thread or group gave.

Each test takes a recorded scenario (real ``fleetd trace`` output) and compares a
shared read with the plain query it replaced, run here group by group: op statistics
(sums in SQL, exact percentiles of the groups that print them), spikes of every
(pid, op) from one read, the rules' calls per process, on-CPU stacks per thread, and
the feeding threads' sleeps with their wakers.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetd.analyze.causes import contention
from fleetd.analyze.causes.chains import Baseline
from fleetd.analyze.causes.rules import Context
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.data import CALL_CODES, CALL_SOURCES, code, in_list, name_of, nodes
from fleetd.analyze.reading.nodeview import NodeView
from fleetd.analyze.reading.profile import stack_counts
from fleetd.analyze.reading.sums import SYSCALL, TIMED_CODES
from fleetd.analyze.reading.waits import reason
from fleetd.analyze.reading.window import resolve
from fleetd.store.bounds import Bounds
from fleetd.store.db import open_reader
from fleetd.store.syscalls import syscall_name

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "tests" / "data" / "scenarios"
# The scenarios (one workload each) and a recording of four ranks: four feeding threads
# whose sleeps one read gives out.
ALL = [*sorted(SCENARIOS.glob("*.db")), REPO / "investigations" / "showcase" / "collectives.db"]


@pytest.fixture(params=ALL, ids=lambda p: p.name)
def node_slice(request: pytest.FixtureRequest) -> Iterator[NodeSlice]:
    conn = open_reader(request.param)
    try:
        yield NodeSlice(conn, nodes(conn)[0], resolve(conn, Bounds()))
    finally:
        conn.close()


def _view(sl: NodeSlice) -> NodeView:
    return NodeView(sl.conn, sl.node, sl.window, sl.tasks, sl.names)


def _rows(sl: NodeSlice, sql: str, *params: int) -> list[tuple[int, ...]]:
    """``sql``'s rows over the slice's window (its WHERE goes after the window's)."""
    w = sl.window
    window = "FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND"
    return sl.conn.execute("SELECT " + sql.replace("WHERE", window, 1),
                           (w.start_ns, w.end_ns, sl.node.lo, sl.node.hi, *params)).fetchall()


def _nearest(durs: list[int], q: float) -> int:
    s = sorted(durs)
    return s[max(0, min(len(s) - 1, int(q * len(s) + 0.999999) - 1))]


def test_op_rows_of_stored_events_are_their_exact_figures(node_slice: NodeSlice) -> None:
    """Every row that prints the stored events' own figures (every call stored) has the
    count, sum, largest and nearest-rank percentiles of those events, per process and
    summed over processes; a row from a histogram counts at least the stored ones."""
    sl = node_slice
    durs: dict[tuple[int | None, str], list[int]] = defaultdict(list)
    for pid, op, nr, dur in _rows(sl, f"pid, op, a0, dur_ns WHERE op IN "
                                      f"{in_list((*TIMED_CODES, SYSCALL))}"):
        name = syscall_name(nr) if op == SYSCALL else name_of(op)
        durs[(pid, name)].append(dur)
        durs[(None, name)].append(dur)
    checked = 0
    for per_process in (True, False):
        for r in sl.op_stats(None, per_process):
            if r["stats_from"] != "events":
                assert r["count"] >= r["events"]
                continue
            d = durs[(r["pid"], str(r["op"]))]
            assert (r["count"], r["total_ns"], r["max_ns"]) == (len(d), sum(d), max(d)), r
            assert (r["p50_ns"], r["p95_ns"], r["p99_ns"]) == tuple(
                _nearest(d, q) for q in (0.5, 0.95, 0.99)), r
            checked += 1
    assert checked or not durs


def test_spikes_of_every_group_from_one_read(node_slice: NodeSlice) -> None:
    """NodeView.slow_calls gives each (pid, op) the calls a query of that group alone
    at its own threshold returns, longest first."""
    sl = node_slice
    base = [Baseline(int(r["pid"] or 0), code(str(r["op"])), r["count"], r["p50_ns"] or 0,
                     r["p99_ns"] or 0) for r in sl.ops
            if r["source"] in CALL_SOURCES and r["p50_ns"]]
    got = _view(sl).slow_calls({(b.pid, b.op): b.threshold for b in base})
    for b in base:
        want = _rows(sl, "id, dur_ns WHERE op = ? AND pid = ? AND dur_ns >= ?", b.op, b.pid,
                     b.threshold)
        mine = [(e.rowkey, e.dur) for e in got.get((b.pid, b.op), [])]
        assert sorted(mine) == sorted((int(k), int(d)) for k, d in want)
        assert [d for _, d in mine] == sorted((d for _, d in mine), reverse=True)


def test_calls_per_process_and_first_launch_from_one_read(node_slice: NodeSlice) -> None:
    sl = node_slice
    view = _view(sl)
    ops = tuple(sorted(CALL_CODES))
    t0, t1 = sl.span[0], sl.span[1] + 1
    by_pid = view.calls_by_pid(ops, t0, t1)
    firsts = view.first_of(ops, t0, t1)
    pids = {int(p) for (p,) in _rows(sl, f"DISTINCT pid WHERE op IN {in_list(ops)}")}
    assert set(by_pid) == pids == set(firsts)
    for pid in pids:
        want = _rows(sl, f"id WHERE op IN {in_list(ops)} AND pid = ? AND ts_ns < ?", pid, t1)
        assert sorted(r[0] for r in by_pid[pid]) == sorted(int(k) for (k,) in want)
        assert [r[1] for r in by_pid[pid]] == sorted(r[1] for r in by_pid[pid])
        assert firsts[pid] == by_pid[pid][0][1]


def test_thread_stacks_are_that_threads_stack_counts(node_slice: NodeSlice) -> None:
    sl = node_slice
    view = _view(sl)
    for t in sl.threads:
        pid, tid = int(t["pid"]), int(t["tid"])
        assert view.thread_stacks(pid, tid) == stack_counts(sl.conn, sl.node, sl.window,
                                                            pid, tid)


def _one_thread_sleeps(sl: NodeSlice, tid: int) -> list[contention.Sleep]:
    """The sleeps of one thread as a query of that thread alone reads them: each with
    the first wakeup and run-queue tail inside it."""
    t0, t1 = sl.span[0], sl.span[1] + 1
    q = ("FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND tid = ? "
         "AND op = ?")
    args = (t0, t1, sl.node.lo, sl.node.hi, tid)
    wakes = sl.conn.execute(f"SELECT ts_ns, peer, stack {q} ORDER BY ts_ns",
                            (*args, code("wakeup"))).fetchall()
    tails = sl.conn.execute(f"SELECT ts_ns, dur_ns {q} ORDER BY ts_ns",
                            (*args, code("runq_wait"))).fetchall()

    def first(rows: list[tuple[int, ...]], a: int, b: int) -> tuple[int, ...] | None:
        i = bisect.bisect_left(rows, (a,))
        return rows[i] if i < len(rows) and rows[i][0] <= b else None

    out = []
    for ts, dur, ret, arg, key in sl.conn.execute(
            f"SELECT ts_ns, dur_ns, ret, bytes, id {q} AND a0 & 255 != 0 AND a0 & 2 = 0 "
            "ORDER BY ts_ns", (*args, code("off_cpu"))):
        if ret not in contention.READ_RETS:
            continue  # a timer or another wait no rule reads
        w, tail = first(wakes, ts, ts + dur), first(tails, ts, ts + dur + 1)
        out.append(contention.Sleep(ts, max(0, dur - (tail[1] if tail else 0)), reason(ret),
                                    arg, w[1] if w else 0, w[2] if w else 0, ret, key))
    return out


def test_feeders_sleeps_read_together_are_each_threads_own(node_slice: NodeSlice) -> None:
    sl = node_slice
    ctx = Context(_view(sl), sl.span, sl.ops, sl.threads, sl.parents)
    fed = contention.feeders(ctx)
    for _, main in fed:
        tid = int(main["tid"])
        assert contention.sleeps(ctx, tid) == _one_thread_sleeps(sl, tid)
    # One read for them all: the first thread asked for filled in every other one.
    assert {k[1] for k in ctx.memo if k[0] == "sleeps"} >= {int(m["tid"]) for _, m in fed}


def test_the_recordings_have_what_these_tests_compare() -> None:
    """The comparisons above are not empty: the scenarios hold feeding threads with
    lock and data sleeps, every-call-stored rows and spikes."""
    conn = open_reader(SCENARIOS / "gil_contention.db")
    try:
        sl = NodeSlice(conn, nodes(conn)[0], resolve(conn, Bounds()))
        ctx = Context(_view(sl), sl.span, sl.ops, sl.threads, sl.parents)
        fed = contention.feeders(ctx)
        assert fed
        assert any(s.why == "lock" for s in contention.sleeps(ctx, int(fed[0][1]["tid"])))
        assert any(r["stats_from"] == "events" and r["count"] > 20 for r in sl.ops)
    finally:
        conn.close()


def test_sums_of_addresses_do_not_overflow(tmp_path: Path) -> None:
    """Off-CPU records keep the futex word's address in ``bytes``: the shared sums add
    up only a reclaim run's bytes, so a long recording of lock waits (addresses near
    2^47, tens of thousands of them) explains. Two rows near 2^62 overflowed SQLite's
    64-bit sum when every op's bytes were summed."""
    db = tmp_path / "high.db"
    db.write_bytes((SCENARIOS / "gil_contention.db").read_bytes())
    conn = sqlite3.connect(db)
    conn.execute("UPDATE event_data SET bytes = ? WHERE op = ?", (1 << 62, code("off_cpu")))
    conn.commit()
    conn.close()
    reader = open_reader(db)
    try:
        sl = NodeSlice(reader, nodes(reader)[0], resolve(reader, Bounds()))
        assert sum(1 for g in sl.sums if g.op == code("off_cpu")) > 1
        assert all(g.nbytes == 0 for g in sl.sums if g.op == code("off_cpu"))
        assert sl.threads and sl.ops
    finally:
        reader.close()
