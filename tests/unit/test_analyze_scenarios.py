"""Diagnoses of the synthetic scenarios in tests/synth.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from synth import HALO, MAIN, MAIN_TID, SCENARIOS, STRESS, WORKERS, build, quiet

from fleetd.analyze.explain import explain, profile
from fleetd.analyze.reading.window import resolve_window
from fleetd.store.db import open_reader

# ---- assertions -------------------------------------------------------------------


def _top(report: dict[str, Any], root: str) -> dict[str, Any]:
    chains: list[dict[str, Any]] = [c for c in report["chains"] if c["root_cause"] == root]
    assert chains, [(c["root_cause"], c["severity"], c["summary"]) for c in report["chains"]]
    return chains[0]


def _chain(name: str, tmp_path: Path,
           root: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """explain's report on scenario ``name`` and its first chain (of cause ``root`` when
    given), the chain's shape checked."""
    report = explain(build(name, tmp_path))
    c = _top(report, root) if root else report["chains"][0]
    _check_chain_shape(c)
    return report, c


def _check_chain_shape(c: dict[str, Any]) -> None:
    for k in ("id", "node", "severity", "summary", "root_cause", "culprit", "victim", "op",
              "evidence", "fixes"):
        assert k in c, k
    assert c["severity"] in ("HIGH", "MEDIUM", "LOW")
    assert c["fixes"] and all(isinstance(f, str) and f for f in c["fixes"])
    assert c["evidence"]
    assert set(c["victim"]) >= {"pid", "tid", "comm"}


def _check_aligned(c: dict[str, Any]) -> None:
    """Every host event cited under a spike overlaps that spike, on its thread."""
    spikes = {e["id"]: e for e in c["evidence"] if e["kind"] in ("spike", "stall")}
    cited = [e for e in c["evidence"] if "spike" in e]
    assert spikes and cited
    for e in cited:
        s = spikes[e["spike"]]
        if e["kind"] != "block_io":
            assert e["tid"] == s["tid"]
        assert e["ts_ns"] < s["ts_ns"] + s["dur_ns"] and e["ts_ns"] + e["dur_ns"] > s["ts_ns"]
        assert 0 < e["overlap_ns"] <= s["dur_ns"]


def test_quiet_baseline_has_no_high_chain(tmp_path: Path) -> None:
    report = explain(build("quiet", tmp_path))
    assert not [c for c in report["chains"] if c["severity"] == "HIGH"], report["chains"]
    assert report["quiet"] is True
    assert report["verdict"].startswith("quiet")
    assert report["processes"] and report["processes"][0]["pid"] == MAIN


def test_quiet_baseline_sampled_is_still_quiet(tmp_path: Path) -> None:
    report = explain(quiet(tmp_path / "q.db", sample=10))
    assert not [c for c in report["chains"] if c["severity"] in ("HIGH", "MEDIUM")]


def test_cpu_hog_names_the_hog(tmp_path: Path) -> None:
    _, c = _chain("cpu_hog", tmp_path)
    assert c["root_cause"] == "cpu_contention"
    assert c["severity"] == "HIGH"
    assert c["op"] == "cudaStreamSynchronize"
    # The culprit is a thread: it names the thread too (tid and thread name).
    assert c["culprit"] == {"pid": STRESS, "comm": "stress", "self": False, "tid": STRESS,
                            "thread": "stress"}
    assert c["victim"]["pid"] == MAIN and c["victim"]["tid"] == MAIN_TID
    assert c["explained"] >= 0.5
    assert any(str(STRESS) in f and "renice" in f for f in c["fixes"])
    _check_aligned(c)


def test_the_tracer_is_named_when_it_is_the_culprit(tmp_path: Path) -> None:
    """The session records fleetd's own pid: when that process took the CPU, the chain
    says so and the fix is about the tracer, not about renicing a neighbour."""
    import json
    import sqlite3

    path = build("cpu_hog", tmp_path)
    with sqlite3.connect(path) as conn:
        (node,) = conn.execute("SELECT id FROM nodes").fetchone()
        conn.execute("INSERT INTO session_data (node, seq, started_ns, mono_offset_ns, "
                     "tool_version, schema_version, targets) VALUES (?, 99, 1, 0, 'x', 1, ?)",
                     (node, json.dumps({"tracer_pid": STRESS})))
    c = explain(path)["chains"][0]
    assert c["root_cause"] == "cpu_contention"
    assert c["culprit"]["pid"] == STRESS and c["culprit"]["comm"] == "stress (the tracer)"
    assert "the tracer" in c["summary"]
    assert any("tracer itself" in f and str(STRESS) in f for f in c["fixes"])
    assert not any("renice" in f for f in c["fixes"])


def test_lock_wait_blames_the_waker(tmp_path: Path) -> None:
    report, c = _chain("lock_wait", tmp_path, "lock_wait")
    assert c["culprit"]["pid"] == HALO and c["culprit"]["comm"] == "halolet"
    assert c["op"] == "cudaLaunchKernel"
    assert c["severity"] in ("HIGH", "MEDIUM")
    assert report["chains"][0]["root_cause"] == "lock_wait"
    _check_aligned(c)
    d_items = [e for e in c["evidence"] if e["kind"] == "off_cpu"]
    assert d_items and all(e["state"] == "D" for e in d_items)


def test_spike_evidence_names_the_launched_kernel(tmp_path: Path) -> None:
    import sqlite3

    from fleetd.store.catalog import op_code

    path = build("lock_wait", tmp_path)
    with sqlite3.connect(path) as c:  # the tracer names launches in their args
        c.execute("INSERT OR IGNORE INTO event_args SELECT id, '{\"kernel\":\"gemm<float>\"}' "
                  "FROM event_data WHERE op = ?", (op_code("cudaLaunchKernel"),))
    c_ = _top(explain(path), "lock_wait")
    spikes = [e for e in c_["evidence"] if e["kind"] == "spike"]
    assert spikes and all(e["kernel"] == "gemm<float>" for e in spikes)
    assert all(e["text"].startswith("cudaLaunchKernel of gemm<float> took ") for e in spikes)


def test_block_io_stall_between_calls(tmp_path: Path) -> None:
    report, c = _chain("block_stall", tmp_path)
    assert c["root_cause"] == "block_io"
    assert c["severity"] == "HIGH"
    assert c["culprit"]["pid"] == MAIN and c["culprit"]["self"] is True
    assert any("checkpoint" in f for f in c["fixes"])
    assert any(e["kind"] == "block_io" for e in c["evidence"])
    _check_aligned(c)
    main = report["processes"][0]["threads"][0]
    assert main["d_state_ns"] > 0
    assert main["syscall_outliers"][0]["name"] == "fsync"


def test_host_sync_per_step(tmp_path: Path) -> None:
    _, c = _chain("host_sync", tmp_path)
    assert c["root_cause"] == "host_sync" and c["severity"] == "HIGH"
    assert c["culprit"] is None and c["op"] == "cudaStreamSynchronize"
    assert any(".item()" in f for f in c["fixes"])


def test_alloc_churn(tmp_path: Path) -> None:
    c = _top(explain(build("alloc_churn", tmp_path)), "alloc_churn")
    _check_chain_shape(c)
    assert c["severity"] in ("HIGH", "MEDIUM")
    assert c["op"] in ("cudaMalloc", "cudaFree")
    assert any("caching allocator" in f for f in c["fixes"])


def test_graph_recapture_storm(tmp_path: Path) -> None:
    _, c = _chain("graph_storm", tmp_path, "graph_recapture")
    assert c["severity"] == "HIGH"
    assert c["detail"]["launch_rate_drop"] > 0.75
    assert c["detail"]["captures"] >= 20


def test_dataloader_oversubscription(tmp_path: Path) -> None:
    _, c = _chain("dataloader", tmp_path)
    assert c["root_cause"] == "dataloader_oversubscription"
    assert c["culprit"]["pid"] in WORKERS and c["culprit"]["comm"] == "pt_data_worker"
    assert c["severity"] in ("HIGH", "MEDIUM")
    assert any(e["kind"] == "page_alloc" and e["pages"] > 0 for e in c["evidence"])
    assert any("workers" in f for f in c["fixes"])
    _check_aligned(c)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_sorted_and_json_shaped(name: str, tmp_path: Path) -> None:
    from fleetd.cli.output import dumps

    report = explain(build(name, tmp_path))
    ranks = [("HIGH", "MEDIUM", "LOW").index(c["severity"]) for c in report["chains"]]
    assert ranks == sorted(ranks)
    assert dumps(report)  # JSON-able
    for c in report["chains"]:
        _check_chain_shape(c)
        assert c["node"] == "gpu-01" and c["id"].startswith("gpu-01:")


def test_profile_features(tmp_path: Path) -> None:
    path = build("cpu_hog", tmp_path)
    conn = open_reader(path)
    try:
        win = resolve_window(conn)
        prof = profile(conn, win, "gpu-01")
        quiet_conn = open_reader(build("quiet", tmp_path))
        qprof = profile(quiet_conn, resolve_window(quiet_conn), "gpu-01")
        quiet_conn.close()
    finally:
        conn.close()
    f, q = prof["features"], qprof["features"]
    assert prof["main_pid"] == MAIN and f["launch_op"] == "cudaLaunchKernel"
    assert f["runq_share"] > q["runq_share"]
    assert f["sync_p99_ns"] > q["sync_p99_ns"]
    assert f["launches_per_s"] < q["launches_per_s"]


def test_pid_filter_keeps_only_that_victim(tmp_path: Path) -> None:
    path = build("cpu_hog", tmp_path)
    assert explain(path, pid=MAIN)["chains"]
    other = explain(path, pid=STRESS)
    assert other["chains"] == [] and all(p["pid"] == STRESS for p in other["processes"])
