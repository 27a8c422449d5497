"""Every tool of `fleetd mcp --db`, driven through the MCP SDK's client over its
in-memory JSON-RPC transport, against synthetic scenarios with known answers
(tests/synth.py, decorated by tests/mcp_data.py with a hostile process name and stacks).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sqlite3
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.types import CallToolResult
from mcp_data import (
    HOSTILE,
    HOSTILE_CLEAN,
    LAUNCH_STACK_CLEAN,
    SYNC_STACK,
    build,
    fingerprint,
)
from synth import MAIN, MAIN_TID, STRESS

from fleetd.mcp.local import LocalBackend
from fleetd.mcp.server import ServerSettings, build_server

DB_TOOLS = {"get_check", "get_trace_stats", "get_causal_chains", "get_latency_breakdown",
            "get_stacks", "run_sql", "graph_lifecycle", "export_timeline",
            "get_gpu_breakdown", "get_cpu_profile", "get_pods"}


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mcp")
    return {name: build(name, d / f"{name}.db") for name in ("cpu_hog", "quiet", "graph_storm")}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exports")


def server(db: Path, export_dir: Path | None = None, max_bytes: int = 64 * 1024) -> Any:
    backend = LocalBackend(db, export_dir or db.parent / "exports")
    return build_server(backend, ServerSettings(max_result_bytes=max_bytes))


def raw_call(srv: Any, tool: str, args: dict[str, Any] | None = None) -> CallToolResult:
    async def go() -> CallToolResult:
        # legacy: the initialize handshake and JSON-RPC framing, as over stdio.
        async with Client(srv, mode="legacy") as client:
            return await client.call_tool(tool, args or {})

    return asyncio.run(go())


def call(srv: Any, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tool's answer; fails on an error result or on a control character anywhere."""
    r = raw_call(srv, tool, args)
    obj = parsed(r)
    assert not r.is_error, obj
    return obj


def error(srv: Any, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    r = raw_call(srv, tool, args)
    obj = parsed(r)
    assert r.is_error, obj
    return dict(obj["error"])


def parsed(r: CallToolResult) -> dict[str, Any]:
    text = r.content[0].text  # type: ignore[union-attr]
    obj = json.loads(text)
    assert r.structured_content == obj  # the same answer for programs and for models
    assert HOSTILE not in text and "IGNORE PREVIOUS INSTRUCTIONS\x1b" not in text
    for s in strings(obj):
        bad = [c for c in s if unicodedata.category(c)[0] == "C"]
        assert not bad, (s, bad)
    return dict(obj)


def strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*strings(k), *strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in strings(v)]
    return []


def sql(db: Path, query: str, *params: Any) -> Any:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(query, params).fetchone()[0]
    finally:
        conn.close()


# ---- discovery --------------------------------------------------------------------------


def test_lists_every_tool_with_typed_documented_parameters(dbs: dict[str, Path]) -> None:
    async def go() -> Any:
        async with Client(server(dbs["quiet"]), mode="legacy") as client:
            return await client.list_tools(), await client.list_prompts()

    tools, prompts = asyncio.run(go())
    by_name = {t.name: t for t in tools.tools}
    assert set(by_name) == DB_TOOLS
    for t in tools.tools:
        assert t.description and "untrusted" in t.description
        props = t.input_schema.get("properties", {})
        assert all(p.get("description") for p in props.values()), t.name
        writes = t.name == "export_timeline"
        assert t.annotations is not None and t.annotations.read_only_hint is (not writes)
    chains = by_name["get_causal_chains"].input_schema["properties"]
    assert chains["top_n"]["maximum"] == 50 and chains["top_n"]["default"] == 5
    assert set(chains["min_severity"]["enum"]) == {"HIGH", "MEDIUM", "LOW"}
    assert by_name["run_sql"].input_schema["required"] == ["sql"]
    assert [p.name for p in prompts.prompts] == ["investigate"]


# ---- overview and stats -----------------------------------------------------------------


def test_trace_stats_counts_match_the_database(dbs: dict[str, Path]) -> None:
    db = dbs["cpu_hog"]
    got = call(server(db), "get_trace_stats", {"per_process": True})
    assert got["nodes"] == ["gpu-01"] and got["warnings"] == []
    assert got["events_by_source"]["cuda"] == sql(
        db, "SELECT count(*) FROM events WHERE source = 'cuda'")
    cols = got["ops"]["columns"]
    rows = [dict(zip(cols, r, strict=True)) for r in got["ops"]["rows"]]
    sync = next(r for r in rows if r["op"] == "cudaStreamSynchronize")
    assert sync["count"] == sql(db, "SELECT count(*) FROM events WHERE op = ?",
                                "cudaStreamSynchronize")
    assert sync["pid"] == MAIN and sync["comm"] == {"untrusted": "python3"}
    assert sync["p99_ns"] > 3 * sync["p50_ns"]  # the hog's spikes
    assert rows == sorted(rows, key=lambda r: -r["total_ns"])


def test_trace_stats_top_n_is_reported_as_truncation(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["cpu_hog"]), "get_trace_stats", {"top_n": 2})
    assert len(got["ops"]["rows"]) == 2 and got["ops_total"] > 2
    assert got["truncated"] is True and "top_n" in got["truncated_reason"][0]


def test_an_empty_window_warns_instead_of_reporting_quiet(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["cpu_hog"]), "get_causal_chains", {"since": "5m"})
    assert got["chains"] == [] and got["verdict"].startswith("no data in the window")
    assert "drop --since" in got["warnings"][0]


# ---- chains -----------------------------------------------------------------------------


def test_causal_chains_blame_the_hog_with_a_sanitized_name(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["cpu_hog"]), "get_causal_chains", {"top_n": 1, "evidence_n": 3})
    assert got["quiet"] is False and got["counts"]["HIGH"] >= 1
    c = got["chains"][0]
    assert c["root_cause"] == "cpu_contention" and c["severity"] == "HIGH"
    assert c["op"] == "cudaStreamSynchronize"
    assert c["victim"]["pid"] == MAIN and c["victim"]["tid"] == MAIN_TID
    assert c["culprit"] == {"pid": STRESS, "comm": {"untrusted": HOSTILE_CLEAN}, "self": False,
                            "tid": STRESS, "thread": {"untrusted": HOSTILE_CLEAN}}
    # fleetd's sentences name the culprit as quoted data.
    assert f"«{HOSTILE_CLEAN}» (pid {STRESS})" in c["summary"]
    assert any(f"«{HOSTILE_CLEAN}»" in f and "renice" in f for f in c["fixes"])
    assert len(c["evidence"]) == 3 and c["evidence_omitted"] > 0
    assert got["chains_total"] == sum(got["counts"].values()) > 1
    assert got["truncated"] is True


def test_causal_chains_filters(dbs: dict[str, Path]) -> None:
    srv = server(dbs["cpu_hog"])
    high = call(srv, "get_causal_chains", {"min_severity": "HIGH", "top_n": 50})
    assert high["chains"] and {c["severity"] for c in high["chains"]} == {"HIGH"}
    assert call(srv, "get_causal_chains", {"pid": STRESS})["chains"] == []  # never a victim
    assert error(srv, "get_causal_chains", {"node": "gpu-99"})["code"] == "bad_request"


def test_a_quiet_recording_is_reported_quiet(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["quiet"]), "get_causal_chains", {})
    assert got["quiet"] is True and got["verdict"].startswith("quiet")
    assert got["counts"]["HIGH"] == 0 and got["counts"]["MEDIUM"] == 0


def test_a_file_with_two_nodes_ranks_them(tmp_path: Path) -> None:
    db = build("quiet", build("cpu_hog", tmp_path / "cluster.db", "gpu-01"), "gpu-02")
    srv = server(db)
    got = call(srv, "get_causal_chains", {"top_n": 10})
    assert got["nodes"] == ["gpu-01", "gpu-02"]
    assert {c["node"] for c in got["chains"]} == {"gpu-01"}
    ranked = got["stragglers"]
    assert [s["node"] for s in ranked] == ["gpu-01", "gpu-02"]  # the slower first
    assert all(set(s) >= {"score", "flagged", "metric", "reason"} for s in ranked)
    one = call(srv, "get_causal_chains", {"node": "gpu-02"})
    assert one["quiet"] is True and "stragglers" not in one
    stats = call(srv, "get_trace_stats", {"node": "gpu-02"})
    assert stats["nodes"] == ["gpu-02"]
    assert stats["events_by_source"]["cuda"] == sql(
        db, "SELECT count(*) FROM events WHERE node = 'gpu-02' AND source = 'cuda'")


# ---- breakdown, stacks, graphs ----------------------------------------------------------


def test_latency_breakdown_matches_the_run_queue_events(dbs: dict[str, Path]) -> None:
    db = dbs["cpu_hog"]
    got = call(server(db), "get_latency_breakdown", {"pid": MAIN})
    [proc] = got["processes"]
    assert proc["pid"] == MAIN and proc["comm"] == {"untrusted": "python3"}
    t = proc["threads"][0]
    assert t["tid"] == MAIN_TID
    queued = sql(db, "SELECT sum(dur_ns) FROM events WHERE op = 'runq_wait' AND tid = ?",
                 MAIN_TID)
    assert t["runq_ns"] == queued > 0
    assert t["share_of_wall"]["runq"] == pytest.approx(queued / t["wall_ns"], abs=1e-4)
    assert t["in_cuda_ns"] > 0 and t["d_state_ns"] == 0


def test_stacks_of_the_victim_op_with_symbols(dbs: dict[str, Path]) -> None:
    db = dbs["cpu_hog"]
    srv = server(db)
    got = call(srv, "get_stacks", {"op": "cudaStreamSynchronize", "pid": MAIN})
    [s] = got["stacks"]
    assert s["frames"] == {"untrusted": SYNC_STACK}
    assert s["events"] == sql(db, "SELECT count(*) FROM events WHERE op = ?",
                              "cudaStreamSynchronize")
    assert s["ops"] == ["cudaStreamSynchronize"]
    assert s["processes"] == [{"pid": MAIN, "comm": {"untrusted": "python3"}}]
    assert s["max_ns"] > 3 * s["mean_ns"] // 2 and got["events_without_stack"] == 0
    # A hostile frame arrives cleaned: no terminal escapes, no bidi override.
    launch = call(srv, "get_stacks", {"op": "cudaLaunchKernel", "frames_n": 2})
    frames = launch["stacks"][0]["frames"]["untrusted"]
    assert frames == LAUNCH_STACK_CLEAN[:2] and launch["stacks"][0]["frames_omitted"] == 1
    everything = call(srv, "get_stacks", {})
    assert everything["stacks"][2:] == [] and {tuple(x["frames"]["untrusted"][:1]) for x in
                                               everything["stacks"]} == {
        (SYNC_STACK[0],), (LAUNCH_STACK_CLEAN[0],)}


def test_stacks_explain_an_unknown_op_and_a_missing_stack(dbs: dict[str, Path]) -> None:
    srv = server(dbs["cpu_hog"])
    err = error(srv, "get_stacks", {"op": "cudaLaunchKernl"})
    assert err["code"] == "bad_request" and "cudaLaunchKernel" in err["hint"]
    none = call(srv, "get_stacks", {"op": "cudaMemcpyAsync"})
    assert none["stacks"] == [] and none["events_without_stack"] == 600 and "note" in none


def test_graph_lifecycle_finds_the_recapture_storms(dbs: dict[str, Path]) -> None:
    db = dbs["graph_storm"]
    got = call(server(db), "graph_lifecycle", {"buckets": 20})
    [p] = got["processes"]
    assert p["pid"] == MAIN
    count = {op: sql(db, "SELECT count(*) FROM events WHERE op = ?", op)
             for op in ("cudaStreamBeginCapture", "cudaGraphInstantiate", "cudaGraphLaunch")}
    assert p["phases"]["begin_capture"]["count"] == count["cudaStreamBeginCapture"] == 31
    assert p["phases"]["instantiate"]["count"] == count["cudaGraphInstantiate"] == 30
    assert p["phases"]["launch"]["count"] == count["cudaGraphLaunch"]
    assert p["phases"]["instantiate"]["p50_ns"] > 20_000_000  # 25-35 ms each
    rates = p["rates"]
    assert rates["launches_per_instantiation"] == round(count["cudaGraphLaunch"] / 30, 1)
    assert rates["launches_per_s_during_captures"] < 0.5 * rates[
        "launches_per_s_outside_captures"]
    assert len(p["episodes"]) == 3  # the three storms of synth.graph_storm
    assert sum(e["instantiations"] for e in p["episodes"]) == 30
    assert p["verdict"].startswith("re-capturing")
    assert len(p["timeline"]["rows"]) == 20
    assert p["timeline"]["columns"][:3] == ["start", "captures", "instantiations"]
    assert call(server(dbs["cpu_hog"]), "graph_lifecycle", {})["processes"] == []


# ---- SQL --------------------------------------------------------------------------------


def test_run_sql_returns_marked_rows(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["cpu_hog"]), "run_sql", {
        "sql": "SELECT pid, comm FROM processes WHERE pid IN (?, ?) ORDER BY pid",
        "params": [MAIN, STRESS]})
    assert got["columns"] == ["pid", "comm"]
    assert got["rows"] == {"untrusted": [[MAIN, "python3"], [STRESS, HOSTILE_CLEAN]]}
    assert got["row_count"] == 2 and got["truncated"] is False


def test_run_sql_row_and_byte_limits_set_truncated(dbs: dict[str, Path]) -> None:
    srv = server(dbs["cpu_hog"])
    rows = call(srv, "run_sql", {"sql": "SELECT id FROM events", "max_rows": 5})
    assert rows["row_count"] == 5 and rows["truncated"] is True
    assert rows["truncated_reason"][0].startswith("rows")
    wide = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 1000) "
            "SELECT i, printf('%.2000c', 'x') AS pad FROM r")
    got = call(srv, "run_sql", {"sql": wide, "max_rows": 1000})
    assert got["truncated"] is True
    assert got["truncated_reason"][0].startswith("bytes")
    # The guard stopped at its byte limit; the answer cap then cut the rows again.
    assert got["row_count"] < 1000 and len(got["rows"]["untrusted"]) < got["row_count"]
    assert any(r.startswith("size") for r in got["truncated_reason"])
    assert got["omitted"]["rows.untrusted"] > 0


@pytest.mark.parametrize("statement", [
    "DELETE FROM event_data",
    "UPDATE process_data SET comm = 'x'",
    "INSERT INTO stacks(hash, frames) VALUES (1, '[]')",
    "DROP TABLE event_data",
    "CREATE TABLE t(x)",
    "ATTACH DATABASE '/tmp/x.db' AS x",
    "PRAGMA query_only = 0",
    "PRAGMA writable_schema = 1",
    "SELECT 1; DELETE FROM event_data",
    "VACUUM",
])
def test_run_sql_refuses_every_write(dbs: dict[str, Path], statement: str) -> None:
    db = dbs["cpu_hog"]
    before = fingerprint(db)
    err = error(server(db), "run_sql", {"sql": statement})
    assert err["code"] == "forbidden", err
    assert fingerprint(db) == before


def test_run_sql_deadline(dbs: dict[str, Path]) -> None:
    endless = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) "
               "SELECT count(*) FROM r")
    err = error(server(dbs["quiet"]), "run_sql", {"sql": endless, "timeout_s": 0.3})
    assert err["code"] == "timeout" and "hint" in err


def test_nothing_writes_the_database(dbs: dict[str, Path], export_dir: Path) -> None:
    db = dbs["cpu_hog"]
    before = fingerprint(db)
    srv = server(db, export_dir)
    args = {"run_sql": {"sql": "SELECT count(*) FROM events"}}
    for tool in DB_TOOLS - {"export_timeline"}:
        call(srv, tool, args.get(tool, {}))
    call(srv, "export_timeline", {})
    assert fingerprint(db) == before


# ---- check, export, prompt, size ------------------------------------------------------


def test_get_check_reports_this_machine_and_the_recording(dbs: dict[str, Path]) -> None:
    got = call(server(dbs["cpu_hog"]), "get_check", {})
    names = {c["name"] for c in got["this_machine"]["checks"]}
    assert {"kernel", "bpf", "tracefs", "bcc", "clock"} <= names
    assert all(c["status"] in ("ok", "warn", "fail") for c in got["this_machine"]["checks"])
    assert got["recording"]["nodes"] == ["gpu-01"]
    assert got["recording"]["db"] == str(dbs["cpu_hog"])


def test_export_timeline_writes_a_perfetto_file(dbs: dict[str, Path], export_dir: Path) -> None:
    db = dbs["cpu_hog"]
    srv = server(db, export_dir)
    got = call(srv, "export_timeline", {"name": "hog.json.gz"})
    path = Path(got["path"])
    assert path == export_dir / "hog.json.gz" and got["bytes"] == path.stat().st_size > 0
    assert got["events"] == sql(db, "SELECT count(*) FROM events")
    assert got["nodes"][0]["node"] == "gpu-01" and got["nodes"][0]["chains"] >= 1
    trace = json.loads(gzip.decompress(path.read_bytes()))
    assert trace["traceEvents"] and trace["otherData"]["exporter"] == "fleetd"
    # Never over an existing file, never outside the export directory.
    assert "exists" in error(srv, "export_timeline", {"name": "hog.json.gz"})["message"]
    for bad in ("../escape.json", "/etc/x.json", "x.txt", ".hidden.json"):
        assert error(srv, "export_timeline", {"name": bad})["code"] == "bad_request", bad
    assert not (export_dir.parent / "escape.json").exists()


def test_answers_fit_the_size_cap(dbs: dict[str, Path]) -> None:
    srv = server(dbs["cpu_hog"], max_bytes=3000)
    r = raw_call(srv, "get_causal_chains", {"top_n": 50, "evidence_n": 100})
    got = parsed(r)
    assert len(r.content[0].text.encode()) <= 3000  # type: ignore[union-attr]
    assert got["truncated"] is True and got["omitted"]
    assert got["chains"][0]["root_cause"] == "cpu_contention"  # the head survives


def test_bad_arguments_are_refused_by_the_schema(dbs: dict[str, Path]) -> None:
    srv = server(dbs["quiet"])
    for tool, args in (("get_causal_chains", {"top_n": 0}), ("run_sql", {}),
                       ("get_stacks", {"pid": -1}), ("graph_lifecycle", {"buckets": 1000})):
        r = raw_call(srv, tool, args)
        assert r.is_error, (tool, args)


def test_investigate_prompt_walks_overview_chains_stacks_fix(dbs: dict[str, Path]) -> None:
    async def go() -> Any:
        async with Client(server(dbs["quiet"]), mode="legacy") as client:
            return await client.get_prompt("investigate", {"focus": "step time doubled",
                                                           "since": "15m"})

    text = asyncio.run(go()).messages[0].content.text
    order = [text.index(t) for t in ("get_trace_stats", "get_causal_chains", "get_stacks",
                                     "Fix:")]
    assert order == sorted(order)
    assert "step time doubled" in text and "since='15m'" in text
    assert "untrusted" in text and "quiet" in text
