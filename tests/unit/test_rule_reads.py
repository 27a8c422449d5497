"""The spikes' and rules' reads shared in session 16 (#44.3) give what the reads they
replaced gave, over timelines written through the store's writer (tests/synth.py):

- a first launch per process from the window's sums, without a walk of the window;
- the feeding threads' long calls read with the slow calls (one walk, not two);
- a thread's CPU takers and switch peers from one read of its switches;
- the rules' allocation and read-back calls of every process in one read;
- block requests read per spike by the sparse index instead of all of them at once;
- the allocation rule's figures and its three longest calls from those rows;
- the longest calls of a process from rows already read, where they hold them;
- a wait's file found from the args' side (a wait never named walked every event).

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
        for row in _rows(sl, f"{', '.join(nodeview.SPAN_COLS)} WHERE op IN {in_list(ops)} "
                             "ORDER BY ts_ns", t0, t1):
            want.setdefault(row[3], []).append(row)
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


@pytest.mark.parametrize("kind", ["host_sync", "graph_storm", "dataloader"])
def test_longest_calls_are_those_of_the_plain_query(kind: str, tmp_path: Path) -> None:
    """From the rows the rules read (no statement), the slow calls (their thresholds
    hold the longest) or a read of their own: the rows ORDER BY dur_ns DESC gives."""
    sl = _slice(build(kind, tmp_path))
    try:
        t0, t1 = sl.span[0], sl.span[1] + 1
        sets = [tuple(sorted(code(o) for o in ops)) for ops in
                (rules.SYNC_OPS, rules.READBACKS.name_set, rules.CAPTURE_OPS, LAUNCH_OPS)]
        pids = [int(p) for (p,) in _rows(sl, "DISTINCT pid WHERE op < 500", t0, t1)]
        for ops in sets:
            for n in (3, 40):
                read, slow, plain = _view(sl), _view(sl), _view(sl, sums=False)
                read.calls_by_pid(ops, t0, t1)
                slow.slow_calls(_thresholds(sl))
                for pid in pids:
                    want = _rows(sl, f"id, ts_ns, dur_ns, tid, op WHERE pid = ? AND op IN "
                                     f"{in_list(ops)} ORDER BY dur_ns DESC LIMIT {n}",
                                 t0, t1, pid)
                    count = Statements(sl.conn)
                    assert read.longest_calls(pid, ops, t0, t1, n) == want
                    assert count.take() == 0
                    assert slow.longest_calls(pid, ops, t0, t1, n) == want
                    assert plain.longest_calls(pid, ops, t0, t1, n) == want
    finally:
        sl.conn.close()


def test_longest_of_equal_calls_come_in_the_files_order(tmp_path: Path) -> None:
    sl = _slice(_churn_recording(tmp_path / "churn.db"))
    try:
        t0, t1 = sl.span[0], sl.span[1] + 1
        want = _rows(sl, f"id, ts_ns, dur_ns, tid, op WHERE pid = ? AND op IN "
                         f"{in_list(rules.ALLOC_CODES)} ORDER BY dur_ns DESC LIMIT 5",
                     t0, t1, MAIN)
        view = _view(sl)
        view.calls_by_pid(rules.ALLOC_CODES, t0, t1)
        assert view.longest_calls(MAIN, rules.ALLOC_CODES, t0, t1, 5) == want
        assert [r[0] for r in want] == sorted(r[0] for r in want)  # all equal: by id
    finally:
        sl.conn.close()


def test_a_waits_file_is_the_first_named_by_id(tmp_path: Path) -> None:
    """Queues.file_of: the path the tracer named on the first wait (by id) of the same
    thread, syscall and fd, found from the args' side; None for an fd never named."""
    from fleetd.analyze.causes.io_owner import Queues
    from fleetd.store.writer import BatchWriter

    off = code("off_cpu")
    rows, args = [], []
    for i in range(40):
        fd = 3 + i % 2  # fd 3 named on some waits, fd 4 never
        rows.append((T0 + i * MS, MS // 2, MAIN, MAIN, off, 75, fd, 7, 2, 0, 0))
        if fd == 3 and i % 6 == 0:
            args.append((len(rows) - 1, {"fd": {"path": f"/data/shard-{i}"}}))
        rows.append((T0 + i * MS + MS // 2, 10 * US, MAIN, MAIN, code("cudaLaunchKernel"),
                     0, 0, 0, 0, 0, 0))
    path = tmp_path / "files.db"
    with BatchWriter(path, "gpu-01") as w:
        w.add_processes([{"pid": MAIN, "comm": "python3", "ppid": 1}])
        w.add_events(rows, args)  # type: ignore[arg-type]
    sl = _slice(path)
    try:
        view = _view(sl)
        waits = [int(k) for (k,) in _rows(sl, "id WHERE op = ? ORDER BY id", sl.window.start_ns,
                                          sl.window.end_ns, off)]
        for key in waits[:4]:
            got = Queues(view).file_of(nodeview.Ev(key, 0, 0, MAIN, MAIN, off, ret=75))
            [(fd,)] = sl.conn.execute("SELECT bytes FROM event_data WHERE id = ?", (key,))
            assert got == ("/data/shard-0" if fd == 3 else None)
    finally:
        sl.conn.close()


def test_feeders_sleeps_come_with_the_rules_calls(node_slice: NodeSlice) -> None:
    """The rules' first read of allocation calls also reads the feeding threads' sleeps:
    the wait rules then read nothing, and find the sleeps a read of their own gives."""
    from fleetd.analyze.causes import contention

    sl = node_slice
    shared = Context(_view(sl), sl.span, sl.ops, sl.threads, sl.parents)
    alone = Context(_view(sl), sl.span, sl.ops, sl.threads, sl.parents)
    fed = [int(main["tid"]) for _, main in shared.feeders()]
    count = Statements(sl.conn)
    rules.alloc_churn_rule(shared)
    reads = count.take()
    assert reads == (1 if shared.gpu_pids() else 0)  # the first launches: from the sums
    for tid in fed:
        assert contention.sleeps(shared, tid) == contention.sleeps(alone, tid)
    assert count.take() == (1 if fed else 0)  # alone's one read; shared's none
