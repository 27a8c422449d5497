"""Op statistics: exact from events, from histograms when calls were sampled; windows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from synth import MAIN, MS, T0, US, Timeline, quiet

from fleetd.analyze.pernode.opstats import kernel_stats, load_op_stats, node_op_stats, op_stats
from fleetd.analyze.reading.data import Hist, nodes
from fleetd.analyze.reading.window import resolve_window
from fleetd.errors import UsageError
from fleetd.store.db import open_reader


def _stats(path: Path, **kw: object) -> dict[str, dict[str, object]]:
    conn = open_reader(path)
    try:
        rows = op_stats(conn, resolve_window(conn), **kw)  # type: ignore[arg-type]
    finally:
        conn.close()
    return {str(r["op"]) + ("" if r["pid"] is None else f"/{r['pid']}"): r for r in rows}


def test_exact_percentiles_from_events(tmp_path: Path) -> None:
    tl = Timeline()
    tl.process(MAIN, "python3")
    for i in range(100):  # 1..100 us: p50 = 50 us, p95 = 95 us, p99 = 99 us
        tl.call("cudaLaunchKernel", T0 + i * MS, (i + 1) * US)
    tl.call("cudaMalloc", T0, 5 * US)
    tl.events.append(tl.events.pop())  # keep it; give it an error below
    ts, dur, pid, tid, op, _, nb, peer, a0, a1, st = tl.events[-1]
    tl.events[-1] = (ts, dur, pid, tid, op, 2, nb, peer, a0, a1, st)
    r = _stats(tl.write(tmp_path / "a.db"))
    k = r["cudaLaunchKernel"]
    assert (k["count"], k["p50_ns"], k["p95_ns"], k["p99_ns"], k["max_ns"]) == (
        100, 50 * US, 95 * US, 99 * US, 100 * US)
    assert k["stats_from"] == "events" and k["total_ns"] == 5050 * US
    assert r["cudaMalloc"]["errors"] == 1
    assert k["calls_per_s"] == pytest.approx(100 / 0.1, rel=0.02)


def test_sampled_calls_use_histograms(tmp_path: Path) -> None:
    r = _stats(quiet(tmp_path / "q.db", sample=10), per_process=True)
    k = r[f"cudaLaunchKernel/{MAIN}"]
    assert k["stats_from"] == "histogram"
    assert k["count"] == 600 * 20 + 2 and int(str(k["events"])) < int(str(k["count"])) // 5
    # Uniform 6..10 us launches: the bucket estimate lands inside the real range.
    assert 6 * US <= int(str(k["p50_ns"])) <= 10 * US
    sync = r[f"cudaStreamSynchronize/{MAIN}"]
    assert sync["stats_from"] == "events" and sync["count"] == 60


def test_histogram_quantiles_stay_near_the_bucket_mean() -> None:
    h = Hist()
    h.add_bucket(12, 100, 100 * 8000)  # 100 calls of 8000 ns
    # Not spread over 4096..8192 as a plain interpolation would do.
    assert h.quantile(0.5) == 8000 and 8000 <= (h.quantile(0.99) or 0) <= 8000 * 1.03


def test_window_bounds_and_errors(tmp_path: Path) -> None:
    path = quiet(tmp_path / "q.db")
    conn: sqlite3.Connection = open_reader(path)
    try:
        whole = resolve_window(conn)
        assert whole.label == "whole recording" and not whole.warnings
        part = resolve_window(conn, from_=str(T0 + 10**9), to=str(T0 + 2 * 10**9))
        rows = op_stats(conn, part)
        sync = next(r for r in rows if r["op"] == "cudaStreamSynchronize")
        assert sync["count"] == 10  # one sync per 100 ms, one second of data
        old = resolve_window(conn, since="5m")
        assert old.warnings and "no events in the last 5m" in old.warnings[0]
        assert op_stats(conn, old) == []
        with pytest.raises(UsageError, match="not before"):
            resolve_window(conn, from_=str(T0 + 10**9), to=str(T0))
    finally:
        conn.close()


def test_kernel_stats_name_each_kernel_and_scale_the_sample(tmp_path: Path) -> None:
    from fleetd.store.writer import BatchWriter

    tl = Timeline(sample=4)
    tl.process(MAIN, "python3")
    kernels = []
    for i in range(400):  # gemm twice as often as the copy kernel, all under the slow cut
        before = len(tl.events)
        tl.call("cudaLaunchKernel", T0 + i * MS, (20 if i % 3 else 5) * US)
        if len(tl.events) > before:
            kernels.append((len(tl.events) - 1, "gemm" if i % 3 else "copy"))
    path = tl.write(tmp_path / "k.db")
    with BatchWriter(path, "gpu-01") as w:  # the same launches again, with their names
        w.add_events([(ts + 1, *rest) for ts, *rest in (tl.events[i] for i, _ in kernels)],
                     [(j, {"kernel": name}) for j, (_, name) in enumerate(kernels)])
    conn = open_reader(path)
    try:
        rows = {r["kernel"]: r for r in kernel_stats(conn, resolve_window(conn))}
    finally:
        conn.close()
    # 100 stored unnamed launches from the first write, 100 named from the second.
    assert set(rows) == {"gemm", "copy", "(unnamed)"}
    gemm, copy = rows["gemm"], rows["copy"]
    assert gemm["count"] + copy["count"] == 100 and gemm["stats_from"] == "sample"
    assert gemm["p50_ns"] == 20 * US and copy["p50_ns"] == 5 * US
    # 400 calls counted by the histogram over 200 stored: each stored launch stands for 2.
    assert gemm["est_calls"] == 2 * gemm["count"]
    assert gemm["total_ns"] > copy["total_ns"]


@pytest.mark.parametrize("pruned", [40, 100])
def test_rows_pruned_between_the_count_and_the_durations_still_give_percentiles(
        tmp_path: Path, pruned: int) -> None:
    """A live agent's database changes between explain's reads: the counts are read
    first and the durations after, and the writer commits or prunes in between. The
    percentiles come from the durations read; none left gives None, never an error (a
    lookup by the count's rank raised KeyError: the live chains answer was HTTP 500)."""
    tl = Timeline()
    tl.process(MAIN, "python3")
    for i in range(100):
        tl.call("cudaLaunchKernel", T0 + i * MS, (i + 1) * US)
    path = tl.write(tmp_path / "a.db")
    conn = open_reader(path)
    try:
        node = nodes(conn, None)[0]
        win = resolve_window(conn)
        loaded = load_op_stats(conn, node, win)
        with sqlite3.connect(path) as w:  # the pruner: the oldest calls go
            w.execute(f"DELETE FROM event_data WHERE id IN (SELECT id FROM event_data "
                      f"ORDER BY ts_ns LIMIT {pruned})")
        rows = node_op_stats(conn, node, win, per_process=False, loaded=loaded)
    finally:
        conn.close()
    k = next(r for r in rows if r["op"] == "cudaLaunchKernel")
    assert k["count"] == 100  # as counted
    if pruned == 100:
        assert (k["p50_ns"], k["p99_ns"]) == (None, None)
    else:  # the 60 left: 41..100 us
        assert (k["p50_ns"], k["p99_ns"]) == (70 * US, 100 * US)
