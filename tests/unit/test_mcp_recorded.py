"""The MCP tools on real recordings (tests/data/scenarios, made by tests/recorder.py).

An assistant investigating the recorded CPU-hog and lock-wait runs must get the same
answers `fleetd explain` gives, with numbers that match the database.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from recorder import DEFAULT_OUT
from test_mcp_server import call, server


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies, so nothing a test does can touch the stored recordings."""
    d = tmp_path_factory.mktemp("recorded")
    return {n: Path(shutil.copy(DEFAULT_OUT / f"{n}.db", d / f"{n}.db"))
            for n in ("cpu_hog", "lock_wait", "quiet")}


def _sql(db: Path, q: str, *args: Any) -> Any:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(q, args).fetchone()[0]


def _comm(v: Any) -> str:
    return str(v["untrusted"] if isinstance(v, dict) else v)


def _workload(db: Path) -> int:
    return int(_sql(db, "SELECT pid FROM events WHERE source = 'cuda' GROUP BY pid "
                        "ORDER BY count(*) DESC LIMIT 1"))


def test_chains_name_the_recorded_hog(rec: dict[str, Path]) -> None:
    got = call(server(rec["cpu_hog"]), "get_causal_chains", {"top_n": 1})
    c = got["chains"][0]
    assert c["root_cause"] == "cpu_contention" and c["severity"] == "HIGH"
    assert _comm(c["culprit"]["comm"]) == "cpu-hog"
    assert c["victim"]["pid"] == _workload(rec["cpu_hog"])
    assert any("renice" in f for f in c["fixes"])


def test_chains_name_the_recorded_lock_holder(rec: dict[str, Path]) -> None:
    got = call(server(rec["lock_wait"]), "get_causal_chains", {"top_n": 10})
    lock = [c for c in got["chains"] if c["root_cause"] == "lock_wait"]
    assert lock and _comm(lock[0]["culprit"]["comm"]) == "stats-sidecar"


def test_breakdown_shows_the_run_queue_wait_the_hog_caused(rec: dict[str, Path]) -> None:
    db = rec["cpu_hog"]
    pid = _workload(db)
    got = call(server(db), "get_latency_breakdown", {"pid": pid})
    [proc] = got["processes"]
    t = max(proc["threads"], key=lambda t: t["in_cuda_ns"])
    queued = _sql(db, "SELECT sum(dur_ns) FROM events WHERE op = 'runq_wait' AND tid = ?",
                  t["tid"])
    assert t["runq_ns"] == queued > 0
    quiet = call(server(rec["quiet"]), "get_latency_breakdown", {"pid": _workload(rec["quiet"])})
    qt = max(quiet["processes"][0]["threads"], key=lambda t: t["in_cuda_ns"])
    # The hog multiplied the time spent waiting for the CPU.
    assert t["share_of_wall"]["runq"] > 3 * qt["share_of_wall"]["runq"]


def test_stats_and_sql_agree_with_the_file(rec: dict[str, Path]) -> None:
    db = rec["cpu_hog"]
    srv = server(db)
    got = call(srv, "run_sql", {"sql": "SELECT count(*) FROM events WHERE op = ?",
                                "params": ["cudaStreamSynchronize"]})
    stored = _sql(db, "SELECT count(*) FROM events WHERE op = 'cudaStreamSynchronize'")
    assert got["rows"] == {"untrusted": [[stored]]} and stored > 100
    stats = call(srv, "get_trace_stats", {"per_process": True})
    rows = [dict(zip(stats["ops"]["columns"], r, strict=True)) for r in stats["ops"]["rows"]]
    sync = next(r for r in rows if r["op"] == "cudaStreamSynchronize")
    # Syncs are never sampled out: the exact count is the stored one.
    assert sync["count"] == stored and sync["pid"] == _workload(db)
    launches = next(r for r in rows if r["op"] == "cudaLaunchKernel")
    # Launches are sampled 1 in 100: the count comes from the kernel's histograms.
    assert launches["count"] > _sql(db, "SELECT count(*) FROM events WHERE op = "
                                        "'cudaLaunchKernel'")


def test_the_remaining_tools_answer_truthfully_about_the_recording(
        rec: dict[str, Path], tmp_path: Path) -> None:
    """get_check, get_stacks, graph_lifecycle and export_timeline on the same real file:
    what it holds (one session of rec-01, no lost events, the stacks the recorder's
    --stacks kept), and what it does not (the workload makes no graph calls)."""
    db = rec["cpu_hog"]
    srv = server(db, tmp_path / "exports")
    check = call(srv, "get_check", {})
    [session] = check["recording"]["sessions"]
    assert check["recording"]["nodes"] == ["rec-01"] and session["lost_events"] == 0
    assert session["sampled_out"] > 0  # launches kept 1 in 100; the rest in histograms
    stacks = call(srv, "get_stacks", {})
    with_stack = _sql(db, "SELECT count(*) FROM events WHERE stack != 0")
    assert with_stack > 0 and stacks["events_without_stack"] == _sql(
        db, "SELECT count(*) FROM events") - with_stack
    assert sum(int(s["events"]) for s in stacks["stacks"]) == with_stack
    # The recorded stacks lead to the workload's step, through its Python frames.
    assert any("Workload.step" in str(s["frames"]) for s in stacks["stacks"])
    assert "note" not in stacks
    graphs = call(srv, "graph_lifecycle", {})
    assert graphs["processes"] == [] and "no CUDA graph call" in graphs["note"]
    out = call(srv, "export_timeline", {"name": "hog.json"})
    assert out["events"] == _sql(db, "SELECT count(*) FROM events")
    assert out["nodes"][0]["chains"] >= 1 and Path(out["path"]).stat().st_size == out["bytes"]
