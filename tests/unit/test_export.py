"""Perfetto export: layout, nesting, chains and arrows, clocks, filters, streaming."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import sqlite3
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from synth import MAIN, STRESS, build

from fleetd.errors import UsageError
from fleetd.export import perfetto
from fleetd.export.clockfix import MAX_REORDER_NS, corrected, recorded_fix
from fleetd.export.lanes import Group
from fleetd.export.model import ChainMark, ClockFix, EventRow, NodeTrace, event_from_api
from fleetd.export.output import open_output
from fleetd.store.catalog import op_code
from fleetd.store.clockinfo import SessionClock
from fleetd.store.db import open_reader

from conftest import FLEETD, REPO

sys.path.insert(0, str(REPO / "tests"))

import export_golden  # noqa: E402
import perfetto_check  # noqa: E402

T0 = 1_750_000_000 * 10**9


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)


def export(db: Path, out: Path, *extra: str) -> perfetto_check.TraceSummary:
    proc = fleetd("export", "--db", str(db), "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return perfetto_check.validate(perfetto_check.load(out))


def x_events(trace: dict[str, Any], name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"]
            if e["ph"] == "X" and (name is None or e["name"] == name)]


# ---- lanes and timestamps -------------------------------------------------------------


def test_lanes_always_nest() -> None:
    rng = random.Random(3)
    lanes: dict[int, list[tuple[int, int]]] = {}
    g = Group("t", 0, 1, lambda grp: 100 + len(grp.tids))
    ts = 0
    for _ in range(5000):
        ts += rng.choice([0, 1, 5, 20])
        end = ts + rng.choice([0, 1, 3, 10, 50, 200])
        lanes.setdefault(g.place(ts, end), []).append((ts, end))
    assert len(lanes) > 1  # random intervals overlap: extra lanes were needed
    for slices in lanes.values():
        stack: list[int] = []
        for a, b in slices:
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1]
            stack.append(b)


def test_microseconds_are_exact_decimals() -> None:
    assert perfetto._us(0) == "0.000"
    assert perfetto._us(1_500) == "1.500"
    assert perfetto._us(1_750_000_000_123_456_789) == "1750000000123456.789"
    assert perfetto._us(-1_500) == "-1.500"
    assert Decimal(perfetto._us(-7)) * 1000 == -7


# ---- the timeline of a scenario -------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_hog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("cpu_hog", tmp_path_factory.mktemp("cpu"))


def test_layout_of_a_node(cpu_hog: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    s = export(cpu_hog, out)
    trace = perfetto_check.load(out)
    assert s.processes == {1: "gpu-01"}
    names = set(s.threads.values())
    assert {"python3[1000]", "IRQ"} <= names
    syncs = x_events(trace, "cudaStreamSynchronize")
    # On the thread's own track, or its overlap lane for those that straddle a slice still
    # open there (the synthetic loop lets a long step spill into the next one).
    assert syncs and sum(e["tid"] == MAIN for e in syncs) >= 0.8 * len(syncs)
    assert {s.threads[(1, e["tid"])] for e in syncs} == {"python3[1000]",
                                                         "python3[1000] (overlap 1)"}
    assert set(syncs[0]["args"]) >= {"op", "ret", "bytes", "event"}
    # Preemptions sit on the thread's own track, nested inside the sync they delay.
    pre = [e for e in x_events(trace, "preempted") if e["args"]["next"].startswith("stress")]
    assert pre and all(e["tid"] == MAIN for e in pre)
    spans = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in syncs]
    inside = [p for p in pre if any(a <= Decimal(p["ts"]) and
                                    Decimal(p["ts"]) + Decimal(p["dur"]) <= b for a, b in spans)]
    assert len(inside) >= len(pre) // 2
    assert {e["name"] for e in x_events(trace)} >= {"cudaLaunchKernel", "cudaMemcpyAsync",
                                                     "run queue", "hardirq 42"}
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {c["name"] for c in counters} == {"CUDA calls/s (stored events)",
                                             "CUDA calls/s (all, from histograms)"}


def test_chains_are_colored_markers_with_arrows(cpu_hog: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    s = export(cpu_hog, out)
    high = [m for m in s.markers if m["args"]["severity"] == "HIGH"]
    assert high and high[0]["cname"] == "terrible" and high[0]["s"] == "g"
    args = high[0]["args"]
    assert args["root_cause"] == "cpu_contention" and args["fixes"]
    assert args["culprit"]["pid"] == STRESS and args["victim"]["pid"] == MAIN
    assert s.flows >= 1
    stress = [k for k, v in s.threads.items() if v.startswith("stress")]
    assert stress, s.threads
    marks = [sl for sl in s.slices[stress[0]] if sl[2].startswith("ran while python3")]
    assert marks
    none = export(cpu_hog, tmp_path / "n.json", "--chains", "none")
    assert none.markers == [] and none.flows == 0


def test_block_io_arrows_and_tracks(tmp_path: Path) -> None:
    db = build("block_stall", tmp_path)
    out = tmp_path / "t.json"
    s = export(db, out)
    trace = perfetto_check.load(out)
    blocks = x_events(trace, "block I/O")
    assert blocks and {s.threads[(1, b["tid"])] for b in blocks} <= {"block I/O",
                                                                    "block I/O (overlap 1)"}
    assert {"D-state", "fsync"} <= {e["name"] for e in x_events(trace)}  # named syscalls
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] in ("s", "f")}
    starts = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    assert starts and any(s.threads[(1, e["tid"])].startswith("block I/O") for e in starts)
    assert ends


def test_gzip_output_is_the_same_trace(cpu_hog: Path, tmp_path: Path) -> None:
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    export(cpu_hog, plain)
    export(cpu_hog, packed)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    export(cpu_hog, tmp_path / "again.json.gz")
    assert (tmp_path / "again.json.gz").read_bytes() == packed.read_bytes()  # reproducible


def test_filters(cpu_hog: Path, tmp_path: Path) -> None:
    db = export_golden.build(tmp_path)
    only = export(db, tmp_path / "p.json", "--pid", "55")  # the kworker: block I/O only
    assert {only.threads[k] for k, v in only.slices.items() if v} == {
        "block I/O", "block I/O (overlap 1)"}
    assert only.markers == [] and only.flows == 0  # no chain has the kworker as victim
    limited = tmp_path / "l.json"
    export(cpu_hog, limited, "--limit-per-node", "100")
    trace = perfetto_check.load(limited)
    assert trace["otherData"]["nodes"][0]["events"] == 100
    proc = fleetd("export", "--db", str(cpu_hog), "-o", str(tmp_path / "s.json"),
                  "--since", "5m")
    assert proc.returncode == 0 and "no events in the last 5m" in proc.stderr


def test_mistakes_are_one_line(cpu_hog: Path, tmp_path: Path) -> None:
    cases = [
        (["--db", str(tmp_path / "none.db")], "does not exist"),
        (["--db", str(cpu_hog), "--format", "svg"], "unknown export format 'svg'"),
        (["--db", str(cpu_hog), "--offset", "gpu-01"], "invalid --offset 'gpu-01'"),
        (["--db", str(cpu_hog), "--offset", "gpu-01=soon"], "invalid duration 'soon'"),
        (["--db", str(cpu_hog), "--limit-per-node", "0"], "invalid --limit-per-node 0"),
        (["--db", str(cpu_hog), "--pid", "-4"], "invalid --pid -4"),
        (["--nodes", "a:1,b:2"], "fleet CA"),
    ]
    for args, needle in cases:
        proc = fleetd("export", *args, "-o", str(tmp_path / "x.json"))
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("fleetd: error: ") and needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.json").exists()
    proc = fleetd("export", "--db", str(cpu_hog), "-o", str(tmp_path / "missing" / "x.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_an_interrupted_export_leaves_no_file(tmp_path: Path) -> None:
    def rows() -> Iterator[EventRow]:
        yield (1, T0, 10, 1, 1, op_code("cudaLaunchKernel"), 0, 0, 0, 0, 0, 0, None)
        raise KeyboardInterrupt

    out = tmp_path / "t.json"
    with pytest.raises(KeyboardInterrupt), open_output(out) as stream:
        perfetto.write_trace([NodeTrace("n", rows())], stream, origin_ns=T0)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="is a directory"), open_output(tmp_path):
        pass


# ---- clocks ---------------------------------------------------------------------------


def test_recorded_samples_give_an_interpolated_correction() -> None:
    off = T0 - 10**12
    s = SessionClock(1, "b", T0, None, off, 1000,
                     [(10**12, off, 1000), (10**12 + 10**9, off + 100_000, 1000)])
    fix, warnings = recorded_fix([s])
    assert warnings == [] and fix.source == "recorded" and fix.error_ns == 1000
    assert fix.apply(T0) == T0
    assert fix.apply(T0 + 500_000_000) == T0 + 500_000_000 + 50_000
    assert fix.apply(T0 + 2 * 10**9) == T0 + 2 * 10**9  # after the last sample: as stamped
    stepped = SessionClock(1, "b", T0, None, off, 1000,
                           [(10**12, off, 1000), (10**12 + 10**9, off + 2 * MAX_REORDER_NS, 1)])
    fix, warnings = recorded_fix([stepped], 5, "manual")
    assert fix.pieces == () and fix.offset_ns == 5 and fix.source == "manual"
    assert "stepped" in warnings[0]


def test_correction_keeps_the_stream_in_order() -> None:
    # The clock jumped back 30 us between samples: stamped order is not true order.
    off = T0 - 10**12
    s = SessionClock(1, "b", T0, None, off, 1,
                     [(10**12, off, 1), (10**12 + 1_000_000, off - 30_000, 1)])
    fix, _ = recorded_fix([s])
    rows: list[EventRow] = [(i, T0 + i * 1000, 0, 1, 1, 100, 0, 0, 0, 0, 0, 0, None)
                            for i in range(2000)]
    out = list(corrected(rows, fix))
    assert [r[1] for r in out] == sorted(r[1] for r in out)
    assert sorted(r[0] for r in out) == list(range(2000))
    shifted = list(corrected(rows[:3], ClockFix(offset_ns=7)))
    assert [r[1] - T0 for r in shifted] == [7, 1007, 2007]


def test_manual_offset_moves_a_node(tmp_path: Path) -> None:
    db = export_golden.build(tmp_path)
    plain = tmp_path / "a.json"
    moved = tmp_path / "b.json"
    export(db, plain, "--no-clock-correction")
    export(db, moved, "--no-clock-correction", "--offset", "gpu-b=+5ms")
    a, b = perfetto_check.load(plain), perfetto_check.load(moved)
    first = {n["name"]: n for n in a["otherData"]["nodes"]}
    later = {n["name"]: n for n in b["otherData"]["nodes"]}
    assert later["gpu-b"]["first_ns"] - first["gpu-b"]["first_ns"] == 5_000_000
    assert later["gpu-b"]["clock"]["source"] == "manual"
    assert first["gpu-a"]["clock"]["source"] == "none"  # correction turned off
    bx = [e for e in x_events(b) if e["pid"] == 2]
    ax = [e for e in x_events(a) if e["pid"] == 2]
    assert [Decimal(y["ts"]) - Decimal(x["ts"]) for x, y in zip(ax, bx, strict=True)] == \
        [Decimal(5000)] * len(ax)


# ---- the exporter as a pure function (the fleet client's entry point) ----------------


def test_api_rows_export_like_database_rows(tmp_path: Path) -> None:
    db = export_golden.build(tmp_path)
    conn = open_reader(db)
    cols = ("id, node, ts_ns, dur_ns, pid, tid, comm, thread, source, op, ret, bytes, peer, "
            "peer_comm, a0, a1, stack, args, rank, rowkey")
    cur = conn.execute(f"SELECT {cols} FROM events WHERE node = 'gpu-b' ORDER BY ts_ns, rowkey")
    names = [d[0] for d in cur.description]
    api = [json.loads(json.dumps(dict(zip(names, r, strict=True)))) for r in cur]
    conn.close()
    rows = [event_from_api(o) for o in api]
    assert all(r is not None for r in rows)
    assert event_from_api({**api[0], "op": "future_op"}) is None
    buf = io.BytesIO()
    trace = NodeTrace("gpu-b", [r for r in rows if r is not None], ranks=(1,),
                      processes={100: "python3"}, threads={100: (100, "python3")},
                      clock=ClockFix(offset_ns=-1000, source="fleet", error_ns=250_000))
    stats = perfetto.write_trace([trace], buf, origin_ns=T0, meta={"source": "fleet"})
    assert stats[0].events == 5 and stats[0].clock["source"] == "fleet"
    obj = json.loads(buf.getvalue(), parse_float=Decimal)
    perfetto_check.validate(obj)
    assert obj["otherData"]["source"] == "fleet"
    assert Decimal(x_events(obj)[0]["ts"]) == Decimal("9.000")  # 10 us, corrected by -1 us


def test_nodes_sort_by_rank_then_name() -> None:
    def node(name: str, ranks: tuple[int, ...]) -> NodeTrace:
        return NodeTrace(name, [], ranks=ranks)

    order = perfetto.sort_nodes([node("z", ()), node("b", (3,)), node("a", ()),
                                 node("c", (0, 1, 2, 3))])
    assert [n.name for n in order] == ["c", "b", "a", "z"]
    assert perfetto.node_label("c", (0, 1, 2, 3)) == "c (ranks 0-3)"
    assert perfetto.node_label("c", (1, 3)) == "c (ranks 1,3)"
    assert perfetto.node_label("c", (2,)) == "c (rank 2)"


def test_arrows_to_filtered_events_are_dropped() -> None:
    chain = ChainMark("n:1", "HIGH", "cpu_contention", "s", T0, 100, victim={"tid": 1},
                      evidence=[{"kind": "off_cpu", "id": "n:9", "ts_ns": T0, "dur_ns": 50,
                                 "state": "R", "culprit": {"pid": 2, "tid": 2}}])
    buf = io.BytesIO()
    perfetto.write_trace([NodeTrace("n", [], chains=[chain])], buf, origin_ns=T0)
    obj = json.loads(buf.getvalue(), parse_float=Decimal)
    s = perfetto_check.validate(obj)
    assert s.flows == 0 and len(s.markers) == 1  # the marker stays, the half arrow goes


def test_export_streams_in_constant_memory() -> None:
    def rows(n: int) -> Iterator[EventRow]:
        launch, off = op_code("cudaLaunchKernel"), op_code("off_cpu")
        for i in range(n):
            yield (i + 1, T0 + i * 10_000, 5_000, 7, 7 + i % 3, launch if i % 4 else off,
                   0, 0, 0, 0, 0, 0, '{"grid":[1,1,1]}' if i % 2 else None)

    class Null:
        def write(self, data: bytes) -> int:
            return len(data)

    def peak(n: int) -> int:
        tracemalloc.start()
        perfetto.write_trace([NodeTrace("n", rows(n))], Null(), origin_ns=T0)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(8_000), peak(64_000)
    assert large < small * 1.5 + 200_000, (small, large)


# ---- the golden file ----------------------------------------------------------------


def test_golden_trace(tmp_path: Path) -> None:
    """Exactly the committed file: regenerate it only with tests/export_golden.py --write."""
    data = export_golden.export(tmp_path)
    golden = export_golden.GOLDEN.read_bytes()
    assert data == golden, "export changed; review and run tests/export_golden.py --write"
    s = perfetto_check.validate(json.loads(golden, parse_float=Decimal))
    assert s.processes == {1: "gpu-a (rank 0)", 2: "gpu-b (rank 1)"}
    assert s.flows == 4 and len(s.markers) == 3
    assert "python3[100] (overlap 1)" in s.threads.values()


def test_validator_catches_broken_traces() -> None:
    good = {"displayTimeUnit": "ns", "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "n"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "t"}},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 10, "name": "a", "cat": "c",
         "args": {}},
    ]}
    perfetto_check.validate(good)
    overlap = dict(good, traceEvents=[*good["traceEvents"], {
        "ph": "X", "pid": 1, "tid": 2, "ts": 5, "dur": 10, "name": "b", "cat": "c", "args": {}}])
    with pytest.raises(perfetto_check.TraceError, match="overlaps"):
        perfetto_check.validate(overlap)
    unnamed = dict(good, traceEvents=[good["traceEvents"][0], good["traceEvents"][2]])
    with pytest.raises(perfetto_check.TraceError, match="before its thread_name"):
        perfetto_check.validate(unnamed)
    dangling = dict(good, traceEvents=[*good["traceEvents"], {
        "ph": "s", "id": 1, "pid": 1, "tid": 2, "ts": 1, "name": "x", "cat": "c"}])
    with pytest.raises(perfetto_check.TraceError, match="only"):
        perfetto_check.validate(dangling)


def test_exported_files_open_as_plain_json(cpu_hog: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    export(cpu_hog, out)
    obj = json.loads(out.read_text())  # floats, as a viewer reads them
    assert obj["traceEvents"][0]["ph"] == "M"
    assert sqlite3.connect(cpu_hog).execute("SELECT count(*) FROM event_data").fetchone()[0] \
        == obj["otherData"]["nodes"][0]["events"]
