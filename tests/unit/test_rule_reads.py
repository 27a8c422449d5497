"""The spikes' and rules' reads shared in session 16 (#44.3) give what the reads they
replaced gave, over timelines written through the store's writer (tests/synth.py):

- a first launch per process from the window's sums, without a walk of the window;
- the feeding threads' long calls read with the slow calls (one walk, not two);
- a thread's CPU takers and switch peers from one read of its switches;
- the rules' allocation and read-back calls of every process in one read;
- block requests read per spike by the sparse index instead of all of them at once;
- the allocation rule's figures and its three longest calls from those rows.

Each compares with the plain query the old code ran (its SQL here), and counts the
statements the shared read runs (sqlite3's trace callback).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from synth import MAIN, MS, T0, US, Timeline, base, build, training_loop

from fleetd.analyze.causes import rules
from fleetd.analyze.causes.rules import Context
from fleetd.analyze.causes.spikes import MAX_STALLS, Baseline
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading import nodeview
from fleetd.analyze.reading.data import (
    ALLOC_OPS,
    CALL_CODES,
    CALL_SOURCES,
    LAUNCH_OPS,
    code,
    in_list,
    nodes,
)
from fleetd.analyze.reading.nodeview import STALL_MIN_NS, NodeView
from fleetd.analyze.reading.window import Window, resolve
from fleetd.store.bounds import Bounds
from fleetd.store.db import open_reader

KINDS = ("cpu_hog", "block_stall", "alloc_churn", "host_sync", "lock_wait", "dataloader",
         "graph_storm")
LAUNCHES = tuple(sorted(code(o) for o in LAUNCH_OPS))


def _slice(path: Path, window: Window | None = None) -> NodeSlice:
    conn = open_reader(path)
    return NodeSlice(conn, nodes(conn)[0], window or resolve(conn, Bounds()))


@pytest.fixture(params=KINDS)
def node_slice(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NodeSlice]:
    sl = _slice(build(request.param, tmp_path))
    try:
        yield sl
    finally:
        sl.conn.close()


def _view(sl: NodeSlice, sums: bool = True) -> NodeView:
    return NodeView(sl.conn, sl.node, sl.window, sl.tasks, sl.names,
                    sl.sums if sums else None)


def _rows(sl: NodeSlice, sql: str, t0: int, t1: int, *params: int) -> list[tuple[int, ...]]:
    """``sql`` over [t0, t1) of the slice's node (its WHERE goes after the span's)."""
    span = "FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND"
    return sl.conn.execute("SELECT " + sql.replace("WHERE", span, 1),
                           (t0, t1, sl.node.lo, sl.node.hi, *params)).fetchall()


class Statements:
    """The statements a connection runs on event_data while counted."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn, self.seen = conn, list[str]()
        conn.set_trace_callback(self._saw)

    def _saw(self, sql: str) -> None:
        if "event_data" in sql:
            self.seen.append(sql)

    def take(self) -> int:
        n, self.seen = len(self.seen), []
        return n


def test_first_launch_from_sums_is_the_first_stored(node_slice: NodeSlice) -> None:
    """Over the span, a part of it or the window: the sums' answer where they can give
    it, the walk's where they cannot (a process whose first event is before the part)."""
    sl = node_slice
    w, (s0, s1) = sl.window, sl.span
    mid = (s0 + s1) // 2
    for ops in (LAUNCHES, tuple(sorted(code(o) for o in ALLOC_OPS)), CALL_CODES):
        for t0, t1 in ((s0, s1 + 1), (w.start_ns, w.end_ns), (s0, mid), (mid, s1 + 1)):
            want = {int(p): int(ts) for p, ts in _rows(
                sl, f"pid, min(ts_ns) WHERE op IN {in_list(ops)} GROUP BY pid", t0, t1)}
            assert _view(sl).first_of(ops, t0, t1) == want
            assert _view(sl, sums=False).first_of(ops, t0, t1) == want
    count = Statements(sl.conn)
    assert _view(sl).first_of(LAUNCHES, s0, s1 + 1)
    assert count.take() == 0  # from the sums alone


def _thresholds(sl: NodeSlice) -> dict[tuple[int, int], int]:
    base = [Baseline(int(r["pid"] or 0), code(str(r["op"])), r["count"], r["p50_ns"] or 0,
                     r["p99_ns"] or 0) for r in sl.ops
            if r["source"] in CALL_SOURCES and r["p50_ns"]]
    return {(b.pid, b.op): b.threshold for b in base}


def test_stall_reads_kept_by_the_slow_calls_read(node_slice: NodeSlice) -> None:
    """With the sums, the long calls of the threads that call CUDA come with the slow
    calls; the stall reads are then those of the plain queries, longest wait first
    (equal ones in the file's order, as SQLite's ORDER BY gave them)."""
    sl = node_slice
    feeding = sorted({t["tid"] for t in sl.threads if t["cuda_calls_stored"]})
    thresholds = _thresholds(sl)
    shared, plain = _view(sl), _view(sl, sums=False)
    count = Statements(sl.conn)
    slow = shared.slow_calls(thresholds)
    reads = shared.stall_reads(feeding, STALL_MIN_NS, MAX_STALLS * 4)
    assert count.take() == (2 if thresholds else 3)  # slow calls, the waits
    assert slow == plain.slow_calls(thresholds)
    assert reads == plain.stall_reads(feeding, STALL_MIN_NS, MAX_STALLS * 4)
    w = sl.window
    long_calls = sorted((int(tid), int(ts), int(ts) + int(dur)) for tid, ts, dur in _rows(
        sl, f"tid, ts_ns, dur_ns WHERE op IN {in_list(CALL_CODES)} AND tid IN "
            f"{in_list(feeding)} AND dur_ns >= ?", w.start_ns, w.end_ns, STALL_MIN_NS))
    assert sorted((tid, a, b) for tid, v in reads.long_calls.items() for a, b in v) == long_calls
    assert all(v == sorted(v) for v in reads.long_calls.values())
    waits = _rows(sl, "id, ts_ns, dur_ns, pid, tid, op, peer, a0, a1, 0, ret WHERE op IN "
                      f"(?, ?) AND tid IN {in_list(feeding)} AND dur_ns >= ? ORDER BY "
                      f"dur_ns DESC LIMIT {MAX_STALLS * 4}", w.start_ns, w.end_ns,
                  code("off_cpu"), code("runq_wait"), STALL_MIN_NS)
    assert reads.waits == waits


def test_cpu_takers_and_switch_peers_from_one_read(node_slice: NodeSlice) -> None:
    sl = node_slice
    w = sl.window
    for t in sl.threads[:4]:
        tid = int(t["tid"])
        view = _view(sl)
        count = Statements(sl.conn)
        peers, takers = view.switch_peers(tid), view.cpu_takers(tid)
        assert count.take() == 1
        assert peers == {int(p): int(n) for p, n in _rows(
            sl, "peer, count(*) WHERE tid = ? AND op = ? AND peer != 0 GROUP BY peer",
            w.start_ns, w.end_ns, tid, code("off_cpu"))}
        other = _view(sl)
        assert dict(other.cpu_takers(tid)) == dict(takers)  # asked the other way round
        assert other.switch_peers(tid) == peers


def test_rules_dense_calls_read_together(node_slice: NodeSlice) -> None:
    """The allocation and read-back calls of every process in one read, each set as a
    read of its own gives it (in time order, equal times in the file's order)."""
    sl = node_slice
    t0, t1 = sl.span[0], sl.span[1] + 1
    view = _view(sl)
    count = Statements(sl.conn)
    for ops in (rules.ALLOC_CODES, rules.READBACK_CODES):
        got = view.calls_by_pid(ops, t0, t1, (rules.ALLOC_CODES, rules.READBACK_CODES))
        want: dict[int, list[tuple[int, ...]]] = {}
        for k, ts, dur, pid, tid, op, a0, nbytes in _rows(
                sl, f"id, ts_ns, dur_ns, pid, tid, op, a0, bytes WHERE op IN {in_list(ops)} "
                    "ORDER BY ts_ns", t0, t1):
            want.setdefault(pid, []).append((k, ts, dur, tid, op, a0, nbytes))
        assert got == want
    assert count.take() == 1 + 2  # the shared read, and the two plain ones above


def _block_reads(sl: NodeSlice, spans: list[tuple[int, int]]) -> list[list[int]]:
    view = _view(sl)
    return [[b.rowkey for b in view.blocks_overlapping(a, b)] for a, b in spans]


def test_blocks_by_the_sparse_index_are_those_of_the_whole_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per D-state wait, by the index: the same requests as the whole window's read
    (the file without the index), in time order; and for a window that starts after
    the first requests, those up to 10 s before it too."""
    path = build("block_stall", tmp_path)
    whole = _slice(path)
    try:
        starts = [int(ts) for (ts,) in _rows(whole, "ts_ns WHERE op = ? ORDER BY ts_ns",
                                             whole.window.start_ns, whole.window.end_ns,
                                             code("block_io"))]
        assert len(starts) > 10
        later = Window(starts[5] + 1, whole.window.end_ns, "later")
    finally:
        whole.conn.close()
    for window in (None, later):
        sl = _slice(path, window)
        try:
            spans = [(ts - 1, ts + MS) for ts in starts] + [
                (ts + 5 * MS, ts + 40 * MS) for ts in starts] + [(starts[0], starts[-1])]
            by_index = _block_reads(sl, spans)
            assert sum(map(len, by_index)) > len(starts)
            with monkeypatch.context() as m:
                m.setattr(nodeview, "_has_sparse_index", lambda conn: False)
                assert _block_reads(sl, spans) == by_index
        finally:
            sl.conn.close()


def _churn_recording(path: Path) -> Path:
    """A loop that allocates and frees every step, each call exactly 300 us: every
    call ties, so the three longest are the first three in time order. The recording
    starts before the loop (an interrupt), so its first launch ends the start-up."""
    tl = Timeline()
    base(tl)
    tl.host("softirq", T0 - 5 * MS, 10 * US, a0=3)

    def churn(tl: Timeline, step: int, t: int) -> int:
        t = tl.call("cudaMalloc", t, 300 * US, always=True)
        return tl.call("cudaFree", t + 50 * US, 300 * US, always=True)

    training_loop(tl, hook=churn, steps=300)
    return tl.write(path)


def test_alloc_churn_from_the_shared_rows(tmp_path: Path) -> None:
    sl = _slice(_churn_recording(tmp_path / "churn.db"))
    try:
        ctx = Context(_view(sl), sl.span, sl.ops, sl.threads, sl.parents)
        [chain] = [c for c in rules.alloc_churn_rule(ctx) if c.root_cause == "alloc_churn"]
        t0, t1 = sl.span[0], sl.span[1] + 1
        [(first_launch,)] = _rows(sl, f"min(ts_ns) WHERE op IN {in_list(LAUNCHES)} AND "
                                      "pid = ?", t0, t1, MAIN)
        calls = _rows(sl, f"id, ts_ns, dur_ns, op WHERE op IN {in_list(rules.ALLOC_CODES)} "
                          "AND pid = ? AND ts_ns >= ? ORDER BY ts_ns, id", t0, t1, MAIN,
                      first_launch)
        frees = sum(1 for c in calls if c[3] == code("cudaFree"))
        assert chain.detail["allocs"] == len(calls) - frees and chain.detail["frees"] == frees
        mid = (first_launch + sl.span[1]) // 2
        late = sum(1 for c in calls if c[1] >= mid) / len(calls)
        assert chain.explained == round(min(1.0, 2 * late), 3)
        assert chain.detail["alloc_share"] == round(sum(c[2] for c in calls) / sl.span_ns, 4)
        shown = [e["id"] for e in chain.extra_evidence if e["kind"] == "call"]
        assert shown == [sl.node.event_id(c[0]) for c in calls[:3]]
        assert chain.op == "cudaMalloc"  # equal totals: the op called first
    finally:
        sl.conn.close()
