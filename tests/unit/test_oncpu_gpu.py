"""host_cpu_bound with an imported GPU timeline: what the feeding thread's on-CPU samples
show while the GPU sat idle. synth's 6 s training loop, two sampler intervals of its
feeding thread (a different function in each half) and kernels on the GPU that leave
gaps in one half only: the frames of that half are the ones named, the other half's are
not blamed."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fleetd.trace.enrich.oncpu import OP_CPU_SAMPLE

PERIOD_49 = 1_000_000_000 // 49
HALF = 3 * 10**9
COLLATE = ["collate (/w/data.py:40)", "Workload.step (/w/train_loop.py:300)"]
LOGGING = ["log_metrics (/w/log.py:12)", "Workload.step (/w/train_loop.py:305)"]
SYNC = ["cudaStreamSynchronize (libcudart.so.12)", "Workload.step (/w/train_loop.py:310)"]


def _kernels(start: int, end: int, every: int, length: int) -> list[tuple[int, int]]:
    return [(t, length) for t in range(start, end, every)]


def _recording(tmp_path: Path, kernels: list[tuple[int, int]]) -> dict[str, Any]:
    """First half: 140 samples in collate; second half: 120 in log_metrics; 10 in a sync
    over the whole run. ``kernels`` (offset, length) on GPU 0 of the feeding process."""
    from synth import MAIN, MAIN_TID, T0, Timeline, base, training_loop

    from fleetd.analyze.explain import explain
    from fleetd.store.writer import BatchWriter
    from fleetd.trace.enrich.stacks import stack_hash

    tl = Timeline()
    base(tl)
    training_loop(tl)
    db = tl.write(tmp_path / "r.db")
    rows = [(T0, HALF, MAIN, MAIN_TID, OP_CPU_SAMPLE, 0, PERIOD_49, 0, 140, 0,
             stack_hash(COLLATE)),
            (T0 + HALF, HALF, MAIN, MAIN_TID, OP_CPU_SAMPLE, 0, PERIOD_49, 0, 120, 0,
             stack_hash(LOGGING)),
            (T0, 2 * HALF, MAIN, MAIN_TID, OP_CPU_SAMPLE, 0, PERIOD_49, 0, 10, 0,
             stack_hash(SYNC))]
    with BatchWriter(db, "gpu-01") as w:
        w.add_stacks([(stack_hash(f), f) for f in (COLLATE, LOGGING, SYNC)])
        w.add_events(rows)  # type: ignore[arg-type]
    with sqlite3.connect(db) as conn:
        (node,) = conn.execute("SELECT id FROM nodes WHERE name = 'gpu-01'").fetchone()
        (session,) = conn.execute("SELECT coalesce(max(seq), 1) FROM session_data WHERE "
                                  "node = ?", (node,)).fetchone()
        conn.executemany(
            "INSERT INTO gpu_data VALUES (?, ?, ?, ?, ?, 0, 7, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, "
            "1, 1)", [((node << 40) | (i + 1), session, T0 + at, dur, MAIN)
                      for i, (at, dur) in enumerate(kernels)])
    return explain(db)


def _bound(report: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in report["chains"] if c["root_cause"] == "host_cpu_bound")


def test_frames_during_gpu_idle_are_those_sampled_in_the_gaps(tmp_path: Path) -> None:
    # Busy without a break in the first half; a 1 ms kernel every 10 ms in the second.
    report = _recording(tmp_path, _kernels(0, HALF, 1_000_000, 1_000_000)
                        + _kernels(HALF, 2 * HALF, 10_000_000, 1_000_000))
    ch = _bound(report)
    idle = ch["detail"]["gpu_idle"]
    gaps = HALF // 10_000_000 - 1  # between the second half's kernels
    assert idle["gaps"] == gaps and idle["idle_ns"] == gaps * 9_000_000
    # The second interval's count, apportioned by the part of it the gaps cover.
    part = gaps * 9_000_000 / HALF
    sync_part = gaps * 9_000_000 / (2 * HALF)
    assert idle["host_samples"] == pytest.approx(120 * part, abs=0.01)
    assert idle["samples"] == pytest.approx(120 * part + 10 * sync_part, abs=0.01)
    # Its time is samples x period, over the idle time.
    assert idle["host_ns"] == pytest.approx(120 * part * PERIOD_49, rel=1e-6)
    assert idle["host_share_of_idle"] == pytest.approx(
        min(1.0, 120 * part * PERIOD_49 / idle["idle_ns"]), abs=1e-4)
    frames = [f["frame"] for f in idle["top_frames"]]
    assert frames == ["log_metrics (log.py:12)"]  # collate ran only while the GPU was busy
    assert idle["top_frames"][0]["share"] == pytest.approx(
        120 * part / (120 * part + 10 * sync_part), abs=1e-4)
    from fleetd.analyze.causes.causes import CAUSES

    assert {e["kind"] for e in ch["evidence"]} <= set(CAUSES["host_cpu_bound"].evidence)
    ev = next(e for e in ch["evidence"] if e["kind"] == "gpu_idle_frames")
    assert "log_metrics (log.py:12)" in ev["text"] and "collate" not in ev["text"]
    # The whole-window top frames still name both halves.
    assert [f["frame"] for f in ch["detail"]["top_frames"]][:2] == [
        "collate (data.py:40)", "log_metrics (log.py:12)"]


def test_the_other_half_idle_blames_the_other_frame(tmp_path: Path) -> None:
    report = _recording(tmp_path, _kernels(0, HALF, 10_000_000, 1_000_000)
                        + _kernels(HALF, 2 * HALF, 1_000_000, 1_000_000))
    idle = _bound(report)["detail"]["gpu_idle"]
    assert [f["frame"] for f in idle["top_frames"]] == ["collate (data.py:40)"]


def test_a_gpu_never_idle_or_no_timeline_adds_nothing(tmp_path: Path) -> None:
    busy = _bound(_recording(tmp_path, _kernels(0, 2 * HALF, 1_000_000, 1_000_000)))
    assert "gpu_idle" not in busy["detail"]
    assert all(e["kind"] != "gpu_idle_frames" for e in busy["evidence"])
    (tmp_path / "b").mkdir()
    none = _bound(_recording(tmp_path / "b", []))
    assert "gpu_idle" not in none["detail"]
    assert none["detail"]["top_frames"] == busy["detail"]["top_frames"]


def test_gaps_outside_the_sampled_time_are_not_counted(tmp_path: Path) -> None:
    """Kernels with gaps only after the thread's last sampler interval: no sample fell in
    them, so the chain says nothing about them."""
    late = _kernels(2 * HALF + 10**9, 2 * HALF + 2 * 10**9, 10_000_000, 1_000_000)
    ch = _bound(_recording(tmp_path, late))
    assert "gpu_idle" not in ch["detail"]


def _gpu(capsys: pytest.CaptureFixture[str], db: Path, fmt: str) -> str:
    from fleetd.cli.main import main

    capsys.readouterr()
    assert main(["gpu", "--db", str(db), "--format", fmt]) == 0
    return capsys.readouterr().out


def test_the_host_bound_gpu_verdict_says_what_the_host_ran_in_the_idle(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import orjson

    _recording(tmp_path, _kernels(0, HALF, 1_000_000, 1_000_000)
               + _kernels(HALF, 2 * HALF, 10_000_000, 1_000_000))
    (rank,) = orjson.loads(_gpu(capsys, tmp_path / "r.db", "json"))["ranks"]
    assert rank["verdict"]["host_overhead"] == "YES"  # M1: 2.7 s idle of 6 s
    hf = rank["host_frames"]
    assert hf["tid"] == 1000 and [f["frame"] for f in hf["top_frames"]] == [
        "log_metrics (log.py:12)"]
    assert hf["idle_ns"] == (HALF // 10_000_000 - 1) * 9_000_000
    text = _gpu(capsys, tmp_path / "r.db", "table")
    assert "while the GPU idled:" in text and "log_metrics (log.py:12)" in text


def test_a_gpu_bound_verdict_has_no_host_frames(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    import orjson

    _recording(tmp_path, _kernels(0, 2 * HALF, 1_000_000, 1_000_000))
    (rank,) = orjson.loads(_gpu(capsys, tmp_path / "r.db", "json"))["ranks"]
    assert rank["verdict"]["host_overhead"] == "NO" and "host_frames" not in rank
