"""``explain``'s gpu_idle chain on a real nsys import: the GPU's idle holes against the
launching thread's scheduler waits, recomputed here from the nsys file with plain SQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetd.analyze.causes.gpu_chains import idle_gaps
from fleetd.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
NSYS = DATA / "perlmutter-cloverleaf-cuda.sqlite"
RANK0 = DATA / "sampled_rank-0.json.gz"
MIN_GAP_NS = 100_000


def _explain(capsys: pytest.CaptureFixture[str], tmp: Path, src: Path) -> dict[str, Any]:
    db = tmp / "in.db"
    assert main(["import", str(src), "--db", str(db)]) == 0
    capsys.readouterr()
    assert main(["explain", "--db", str(db), "--format", "json"]) == 0
    return dict(orjson.loads(capsys.readouterr().out))


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _expected() -> tuple[int, int, int]:
    """(gaps, idle ns, covered ns) straight from the nsys tables."""
    src = sqlite3.connect(f"file:{NSYS}?mode=ro&immutable=1", uri=True)
    busy = _union([(s, e) for s, e in src.execute(
        "SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL "
        "SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY")])
    holes = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)
             if b[0] - a[1] >= MIN_GAP_NS]
    tids = {g & 0xFFFFFF for (g,) in src.execute(
        "SELECT DISTINCT r.globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId "
        "IN (SELECT correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL UNION "
        "SELECT correlationId FROM CUPTI_ACTIVITY_KIND_MEMCPY)")}
    waits: list[tuple[int, int]] = []
    out_at: dict[int, int] = {}
    for t, is_in, g in src.execute("SELECT start, isSchedIn, globalTid FROM SCHED_EVENTS "
                                   "ORDER BY start"):
        if g & 0xFFFFFF not in tids:
            continue
        if not is_in:
            out_at[g] = t
        elif g in out_at:
            waits.append((out_at.pop(g), t))
    src.close()
    merged = _union(waits)
    cover = sum(max(0, min(e, b) - max(s, a)) for a, b in holes for s, e in merged)
    return len(holes), sum(b - a for a, b in holes), cover


def test_gpu_idle_chain_matches_the_nsys_file(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    report = _explain(capsys, tmp_path, NSYS)
    chains = [c for c in report["chains"] if c["root_cause"] == "gpu_idle"]
    assert len(chains) == 1
    c = chains[0]
    gaps, idle, cover = _expected()
    d = c["detail"]
    assert (d["gaps"], d["idle_ns"], d["covered_ns"]) == (gaps, idle, cover)
    assert c["explained"] == round(cover / idle, 3)
    assert c["victim"]["pid"] == 1701896 and d["device"] == 0
    kinds = [e["kind"] for e in c["evidence"]]
    assert kinds.count("gpu_gap") == 3
    for e in c["evidence"]:
        if e["kind"] != "gpu_gap":  # each host wait overlaps the hole it is listed under
            hole = next(h for h in c["evidence"] if h["kind"] == "gpu_gap"
                        and h["id"] == e["spike"])
            assert e["ts_ns"] < hole["ts_ns"] + hole["dur_ns"]
            assert e["ts_ns"] + e["dur_ns"] > hole["ts_ns"]
            assert 0 < e["overlap_ns"] <= hole["covered_ns"]
    assert c["summary"].startswith("GPU 0 of cuda-cloverleaf (pid 1701896")
    # The export recorded no thread state (nsys "Unknown"): neither preempted nor sleeping.
    assert d["dominant"] == "off the CPU (state not recorded)"
    assert c["summary"].endswith("mostly off the CPU (state not recorded)")
    waits = [e for e in c["evidence"] if e["kind"] == "off_cpu"]
    assert waits and not any("state" in e for e in waits)
    assert "fleetd trace" in c["fixes"][0]


def test_no_chain_without_host_waits(capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    """A PyTorch profiler trace has no scheduler events: nothing to tie the idle to."""
    report = _explain(capsys, tmp_path, RANK0)
    assert not [c for c in report["chains"] if c["root_cause"] == "gpu_idle"]


def test_idle_gaps_clip_and_skip_short_holes() -> None:
    busy = [(0, 10), (5, 20), (150, 200), (210, 400), (1000, 1100)]
    assert idle_gaps(busy, 0, 10_000, min_gap=100) == [(20, 150), (400, 1000)]
    assert idle_gaps(busy, 0, 600, min_gap=100) == [(20, 150), (400, 600)]
    assert idle_gaps([], 0, 100) == []
