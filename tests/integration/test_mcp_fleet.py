"""`fleetd mcp` against a real loopback fleet, and as a real process.

Two `fleetd agent --no-trace` processes serve scenario databases over mTLS: gpu-01 has
a CPU hog with a hostile name, gpu-02 is quiet. The fleet tools are driven through the
MCP SDK's client in-process; then `fleetd mcp` itself is driven over stdio (database and
fleet mode) and over Streamable HTTP (TLS 1.3 with a bearer token or a client
certificate, and refused without them).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sqlite3
import ssl
import subprocess
import time
import unicodedata
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx2
import perfetto_check
import pytest
from agents import Agent, Pki, agent, client_ssl
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult
from mcp_data import HOSTILE, HOSTILE_CLEAN, build, fingerprint
from synth import MAIN, STRESS

from fleetd.cli.main import main
from fleetd.fleet.client import ClientOptions
from fleetd.fleet.fanout import FleetOptions
from fleetd.fleet.targets import parse_nodes
from fleetd.mcp.fleet import FleetBackend
from fleetd.mcp.server import build_server
from fleetd.security import tls

from conftest import FLEETD, REPO

FLEET_TOOLS = {"get_check", "query_fleet", "check_hang", "get_cpu_profile",
               "export_timeline", "get_pods"}
HTTP_RE = re.compile(r"listening on (https://127\.0\.0\.1:\d+/mcp)")


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dbs")
    return {"gpu-01": build("cpu_hog", d / "gpu-01.db", "gpu-01"),
            "gpu-02": build("quiet", d / "gpu-02.db", "gpu-02")}


@pytest.fixture(scope="module")
def fleet(pki: Pki, dbs: dict[str, Path]) -> Iterator[list[Agent]]:
    with ExitStack() as stack:
        yield [stack.enter_context(agent(db, node, pki, "--no-trace"))
               for node, db in dbs.items()]


def nodes_arg(agents: list[Agent], *extra: str) -> str:
    return ",".join([*(a.url.removeprefix("https://") for a in agents), *extra])


def fleet_server(pki: Pki, nodes: str, export_dir: Path | None = None) -> Any:
    opts = FleetOptions(tuple(parse_nodes(nodes)), ClientOptions(ssl=client_ssl(pki),
                                                                 timeout_s=20))
    if export_dir is None:
        return build_server(FleetBackend(opts))
    return build_server(FleetBackend(opts, export_dir))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _call(client: Client, tool: str, args: dict[str, Any]) -> CallToolResult:
    return await client.call_tool(tool, args)


def call(srv: Any, tool: str, args: dict[str, Any] | None = None,
         ok: bool = True) -> dict[str, Any]:
    async def go() -> CallToolResult:
        async with Client(srv, mode="legacy") as client:
            return await _call(client, tool, args or {})

    return checked(run(go()), ok)


def checked(r: CallToolResult, ok: bool = True) -> dict[str, Any]:
    text = r.content[0].text  # type: ignore[union-attr]
    obj = json.loads(text)
    assert r.is_error is (not ok), obj
    assert HOSTILE not in text
    for s in _strings(obj):
        assert not [c for c in s if unicodedata.category(c)[0] == "C"], s
    return dict(obj)


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def dead_address() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---- fleet mode, in process -------------------------------------------------------------


def test_fleet_tools_and_health(pki: Pki, fleet: list[Agent]) -> None:
    srv = fleet_server(pki, nodes_arg(fleet))

    async def go() -> Any:
        async with Client(srv, mode="legacy") as client:
            return await client.list_tools()

    assert {t.name for t in run(go()).tools} == FLEET_TOOLS
    got = call(srv, "get_check")
    assert got["status"] == "complete" and got["warnings"] == []
    assert [(n["node"], n["status"], n["tracing"]) for n in got["nodes"]] == [
        ("gpu-01", "ok", False), ("gpu-02", "ok", False)]
    assert got["this_machine"]["checks"]


def test_check_hang_without_ranks_and_with_a_dead_node(pki: Pki, fleet: list[Agent]) -> None:
    got = call(fleet_server(pki, nodes_arg(fleet, dead_address())), "check_hang",
               {"hang_after_s": 5})
    assert list(got)[:3] == ["status", "answered", "warnings"]
    assert got["status"] == "partial" and got["hang_status"] == "ok"
    assert got["hangs"] == [] and got["ranks"] == 0 and got["hang_after_s"] == 5
    assert got["verdict"] == "no hang: no traced process has made NCCL calls"
    assert any("refused" in w for w in got["warnings"])


def test_overview_prepends_status_warnings_and_skew(pki: Pki, fleet: list[Agent],
                                                    dbs: dict[str, Path]) -> None:
    got = call(fleet_server(pki, nodes_arg(fleet)), "query_fleet", {"action": "overview"})
    assert list(got)[:4] == ["status", "answered", "warnings", "skew"]
    assert got["status"] == "complete" and got["answered"] == "2 of 2 node(s)"
    assert len(got["skew"]) == 2 and all("clock" in line for line in got["skew"])
    by_node = {n["node"]: n for n in got["nodes"]}
    assert by_node["gpu-01"]["chains"]["HIGH"] >= 1 and by_node["gpu-02"]["chains"]["HIGH"] == 0
    assert by_node["gpu-02"]["verdict"].startswith("quiet")
    # The verdict names the hog: quoted, cleaned.
    assert f"«{HOSTILE_CLEAN}» (pid {STRESS})" in by_node["gpu-01"]["verdict"]
    for node, db in dbs.items():
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            assert by_node[node]["events"] == conn.execute(
                "SELECT count(*) FROM events").fetchone()[0]
        finally:
            conn.close()


def test_chains_and_stragglers_name_the_hog_node(pki: Pki, fleet: list[Agent]) -> None:
    srv = fleet_server(pki, nodes_arg(fleet))
    chains = call(srv, "query_fleet", {"action": "chains", "top_n": 3, "evidence_n": 2})
    top = chains["chains"][0]
    assert top["node"] == "gpu-01" and top["root_cause"] == "cpu_contention"
    assert top["culprit"]["pid"] == STRESS
    assert top["culprit"]["comm"] == {"untrusted": HOSTILE_CLEAN}
    assert len(top["evidence"]) == 2
    assert chains["verdicts"]["gpu-02"].startswith("quiet")
    strag = call(srv, "query_fleet", {"action": "stragglers"})
    ranked = strag["stragglers"]
    assert {s["node"] for s in ranked} == {"gpu-01", "gpu-02"}
    assert ranked[0]["node"] == "gpu-01"  # slowest relative to the best first
    assert all(set(s) >= {"score", "flagged", "metric", "reason"} for s in ranked)
    assert set(strag["why"]) == set(strag["flagged"])


def test_ops_and_sql_fan_out(pki: Pki, fleet: list[Agent], dbs: dict[str, Path]) -> None:
    srv = fleet_server(pki, nodes_arg(fleet))
    ops = call(srv, "query_fleet", {"action": "ops", "top_n": 500, "per_process": True})
    cols = ops["columns"]
    assert cols[0] == "node" and "comm" in cols
    rows = [dict(zip(cols, r, strict=True)) for r in ops["rows"]]
    sync = {r["node"]: r for r in rows if r["op"] == "cudaStreamSynchronize"}
    assert sync["gpu-01"]["pid"] == MAIN and sync["gpu-01"]["comm"] == {"untrusted": "python3"}
    assert sync["gpu-01"]["p99_ns"] > 3 * sync["gpu-02"]["p99_ns"]
    got = call(srv, "query_fleet", {
        "action": "sql", "sql": "SELECT comm, count(*) AS n FROM events WHERE pid = ? "
        "GROUP BY comm", "params": [MAIN]})
    assert got["columns"] == ["node", "comm", "n"]
    counted = {r[0]: r[2] for r in got["rows"]["untrusted"]}
    assert set(counted) == {"gpu-01", "gpu-02"} and all(n > 0 for n in counted.values())
    hog = call(srv, "query_fleet", {"action": "sql",
                                    "sql": "SELECT comm FROM processes WHERE pid = ?",
                                    "params": [STRESS]})
    assert [HOSTILE_CLEAN] in [r[1:] for r in hog["rows"]["untrusted"]]
    limited = call(srv, "query_fleet", {"action": "sql", "sql": "SELECT id FROM events",
                                        "max_rows": 3})
    assert limited["truncated"] is True and limited["row_count"] == 6
    err = call(srv, "query_fleet", {"action": "sql", "sql": "SELECT 1", "since": "5m"},
               ok=False)["error"]
    assert err["code"] == "bad_request" and "WHERE" in err["hint"]


def test_fleet_refuses_writes_and_nothing_changes(pki: Pki, fleet: list[Agent],
                                                  dbs: dict[str, Path]) -> None:
    before = {n: fingerprint(db) for n, db in dbs.items()}
    err = call(fleet_server(pki, nodes_arg(fleet)), "query_fleet",
               {"action": "sql", "sql": "DELETE FROM event_data"}, ok=False)["error"]
    assert err["code"] == "forbidden" and "every node refused" in err["message"]
    assert {n: fingerprint(db) for n, db in dbs.items()} == before


def test_a_dead_node_is_a_warning_not_a_healthy_node(pki: Pki, fleet: list[Agent]) -> None:
    dead = dead_address()
    got = call(fleet_server(pki, nodes_arg(fleet, dead)), "query_fleet",
               {"action": "overview"})
    assert got["status"] == "partial" and got["answered"] == "2 of 3 node(s)"
    [line] = [w for w in got["warnings"] if dead in w]
    assert "refused" in line
    assert {n["node"] for n in got["nodes"]} == {"gpu-01", "gpu-02"}


def _event_count(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return int(c.execute("SELECT count(*) FROM event_data").fetchone()[0])


def test_fleet_export_writes_every_live_node(pki: Pki, fleet: list[Agent], dbs: dict[str, Path],
                                            tmp_path: Path) -> None:
    dead = dead_address()
    srv = fleet_server(pki, nodes_arg(fleet, dead), tmp_path)
    got = call(srv, "export_timeline", {"name": "fleet.json.gz"})
    # How the fan-out went comes first, as in every fleet answer: the dead node is named.
    assert list(got)[:4] == ["status", "answered", "warnings", "skew"]
    assert got["status"] == "partial" and got["answered"] == "2 of 3 node(s)"
    assert any(dead in w and "refused" in w for w in got["warnings"])
    path = Path(got["path"])
    assert path.parent == tmp_path and path.name == "fleet.json.gz"
    assert got["bytes"] == path.stat().st_size and got["format"].endswith("(gzip)")
    counts = {n["node"]: n["events"] for n in got["nodes"]}
    assert counts == {n: _event_count(db) for n, db in dbs.items()}
    assert got["events"] == sum(counts.values())
    # The file itself: a valid timeline, one process per node, gpu-01's hog as a chain
    # with its arrows, both clocks corrected by the measured skew.
    trace = perfetto_check.load(path)
    summary = perfetto_check.validate(trace)
    nodes = {n["name"]: n for n in trace["otherData"]["nodes"]}
    assert sorted(nodes) == ["gpu-01", "gpu-02"] and len(summary.processes) == 2
    assert {n: v["events"] for n, v in nodes.items()} == counts
    [hog] = [m for m in summary.markers if "cpu_contention" in m["name"]]
    assert hog["name"].startswith("HIGH cpu_contention (gpu-01)")
    assert hog["args"]["culprit"]["pid"] == STRESS and summary.flows >= 1
    assert all(n["clock"]["source"].startswith("fleet") for n in nodes.values())
    assert trace["otherData"]["fleet"]["status"] == "partial"
    # Never over an existing file; a node list with nobody home is an error, no file.
    again = call(srv, "export_timeline", {"name": "fleet.json.gz"}, ok=False)["error"]
    assert again["code"] == "bad_request" and "exists already" in again["message"]
    none = call(fleet_server(pki, dead, tmp_path), "export_timeline", {"name": "none.json"},
                ok=False)["error"]
    assert none["code"] == "network" and "no node sent its timeline" in none["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.json.gz"]


# ---- `fleetd mcp` as a process ------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def stdio(*args: str) -> StdioServerParameters:
    return StdioServerParameters(command=FLEETD, args=["mcp", *args], env=_env(), cwd=str(REPO))


def test_stdio_database_mode(dbs: dict[str, Path], tmp_path: Path) -> None:
    async def go() -> tuple[set[str], CallToolResult]:
        async with Client(stdio("--db", str(dbs["gpu-01"]), "--export-dir", str(tmp_path)),
                          mode="legacy") as client:
            names = {t.name for t in (await client.list_tools()).tools}
            return names, await client.call_tool("get_causal_chains", {"top_n": 1})

    names, r = run(go())
    assert "run_sql" in names and "query_fleet" not in names
    c = checked(r)["chains"][0]
    assert c["root_cause"] == "cpu_contention" and c["culprit"]["pid"] == STRESS


def test_stdio_fleet_mode(pki: Pki, fleet: list[Agent]) -> None:
    async def go() -> CallToolResult:
        async with Client(stdio("--nodes", nodes_arg(fleet), *pki.client_flags()),
                          mode="legacy") as client:
            return await client.call_tool("query_fleet", {"action": "chains", "top_n": 1})

    got = checked(run(go()))
    assert got["status"] == "complete" and got["chains"][0]["node"] == "gpu-01"


@contextmanager
def http_server(*args: str) -> Iterator[str]:
    proc = subprocess.Popen([FLEETD, "mcp", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=REPO)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            m = HTTP_RE.search(line)
            if m:
                yield m.group(1)
                return
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"fleetd mcp --http did not start: {proc.stderr.read()}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _over_http(url: str, verify: Any, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async def go() -> CallToolResult:
        async with httpx2.AsyncClient(verify=verify, headers=headers, timeout=30) as hc:
            transport = streamable_http_client(url, http_client=hc)
            async with Client(transport, mode="legacy") as client:
                return await client.call_tool("get_causal_chains", {"top_n": 1})

    return checked(run(go()))


def _status(url: str, verify: Any, headers: dict[str, str] | None = None) -> int:
    async def go() -> int:
        async with httpx2.AsyncClient(verify=verify, headers=headers, timeout=10) as hc:
            r = await hc.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                              headers={"Accept": "application/json, text/event-stream"})
            return int(r.status_code)

    return int(run(go()))


def test_http_with_a_bearer_token(pki: Pki, dbs: dict[str, Path], tmp_path: Path) -> None:
    token = "t0ken-" + "x" * 32
    tok = tmp_path / "mcp.token"
    tok.write_text(token + "\n")
    tok.chmod(0o600)
    cert, key = pki.pair("mcp")
    server_only = tls.client_context(pki.ca, None, None)
    with http_server("--db", str(dbs["gpu-01"]), "--http", "127.0.0.1:0", "--tls-cert",
                     str(cert), "--tls-key", str(key), "--http-token-file", str(tok)) as url:
        got = _over_http(url, server_only, {"Authorization": f"Bearer {token}"})
        assert got["chains"][0]["culprit"]["comm"] == {"untrusted": HOSTILE_CLEAN}
        assert _status(url, server_only) == 401
        assert _status(url, server_only, {"Authorization": "Bearer wrong"}) == 401
        with pytest.raises(httpx2.HTTPError):  # no plain HTTP on the TLS port
            _status(url.replace("https://", "http://"), False)
        old_tls = ssl.create_default_context(cafile=str(pki.ca))
        old_tls.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(httpx2.HTTPError):  # TLS 1.3 only
            _status(url, old_tls, {"Authorization": f"Bearer {token}"})


def test_http_with_client_certificates(pki: Pki, dbs: dict[str, Path]) -> None:
    cert, key = pki.pair("mcp")
    with http_server("--db", str(dbs["gpu-02"]), "--http", "127.0.0.1:0", "--tls-cert",
                     str(cert), "--tls-key", str(key), "--client-ca", str(pki.ca)) as url:
        got = _over_http(url, client_ssl(pki))
        assert got["quiet"] is True
        with pytest.raises(httpx2.HTTPError):  # no client certificate: no handshake
            _status(url, tls.client_context(pki.ca, None, None))


@pytest.mark.parametrize(("extra", "message"), [
    (["--http", "127.0.0.1:0"], "--http needs --tls-cert and --tls-key"),
    (["--http", "127.0.0.1:0", "--tls-cert", "C", "--tls-key", "K"],
     "needs client authentication"),
    (["--http", "0.0.0.0:0", "--tls-cert", "C", "--tls-key", "K", "--http-token-file", "T"],
     "requires client certificates"),
    (["--tls-cert", "C"], "only applies with --http"),
])
def test_http_refuses_unsafe_setups(pki: Pki, dbs: dict[str, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str], extra: list[str],
                                    message: str) -> None:
    cert, key = pki.pair("mcp")
    tok = tmp_path / "t"
    tok.write_text("y" * 32)
    tok.chmod(0o600)
    subst = {"C": str(cert), "K": str(key), "T": str(tok)}
    # In process: the refusals come before anything is served, so main() returns.
    code = main(["mcp", "--db", str(dbs["gpu-02"]), *(subst.get(a, a) for a in extra)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "hint:" in err


def test_cli_refuses_db_with_nodes_and_a_missing_db(pki: Pki, dbs: dict[str, Path],
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert main(["mcp", "--db", str(dbs["gpu-02"]), "--nodes", "127.0.0.1:1",
                 *pki.client_flags()]) == 2
    assert "--db reads a local database" in capsys.readouterr().err
    assert main(["mcp", "--db", "/nonexistent.db"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_stacks_and_graphs_fan_out(pki: Pki, fleet: list[Agent]) -> None:
    """The fleet MCP has the stacks and graphs the local one has, node by node."""
    srv = fleet_server(pki, nodes_arg(fleet))
    got = call(srv, "query_fleet", {"action": "stacks", "op": "cudaStreamSynchronize"})
    assert got["status"] == "complete" and got["stacks"], got
    assert {s["node"] for s in got["stacks"]} == {"gpu-01", "gpu-02"}
    assert all(s["ops"] == ["cudaStreamSynchronize"] for s in got["stacks"])
    launch = call(srv, "query_fleet", {"action": "stacks", "op": "cudaLaunchKernel"})
    frames = [f for s in launch["stacks"] for f in s["frames"]["untrusted"]]
    assert frames and all("\x1b" not in f and "\u202e" not in f for f in frames)
    err = call(srv, "query_fleet", {"action": "stacks", "op": "cudaLaunchKernl"},
               ok=False)["error"]
    assert err["code"] == "bad_request" and "cudaLaunchKernel" in err["hint"]
    graphs = call(srv, "query_fleet", {"action": "graphs"})
    assert graphs["status"] == "complete" and graphs["processes"] == [] and "note" in graphs


# ---- get_cpu_profile over the fleet ----------------------------------------------------

CPU_PERIOD = 1_000_000_000 // 49
HOT = ["collate (/w/data.py:40)", "Workload.step (/w/train_loop.py:302)"]
EVIL = [f"{HOSTILE} (/w/evil.py:1)", "Workload.step (/w/train_loop.py:302)"]


def _with_samples(path: Path, node: str, stacks: list[tuple[list[str], int, int]]) -> Path:
    """synth's quiet loop as ``node``, plus on-CPU sample rows of its feeding thread
    (frames innermost first, samples, of them in the collector)."""
    from synth import T0

    from fleetd.store.writer import BatchWriter
    from fleetd.trace.enrich.oncpu import OP_CPU_SAMPLE
    from fleetd.trace.enrich.stacks import stack_hash

    build("quiet", path, node)
    with BatchWriter(path, node) as w:
        w.add_stacks([(stack_hash(f), f) for f, _, _ in stacks])
        w.add_events([(T0, 6 * 10**9, MAIN, MAIN, OP_CPU_SAMPLE, 0, CPU_PERIOD, 0, n, gc,
                       stack_hash(f)) for f, n, gc in stacks])  # type: ignore[arg-type]
    return path


def test_get_cpu_profile_merges_the_nodes_samples(pki: Pki, tmp_path: Path) -> None:
    """Two agents' samples merged per stack (as fleetd profile --nodes), each heavy stack
    with its node, frames wrapped as untrusted, the fan-out's status first; ``node``
    keeps one node's."""
    a = _with_samples(tmp_path / "a.db", "gpu-01", [(HOT, 150, 0), (EVIL, 20, 0)])
    b = _with_samples(tmp_path / "b.db", "gpu-02", [(HOT, 50, 0), (["[garbage collection]",
                                                                   *HOT], 30, 30)])
    with agent(a, "gpu-01", pki, "--no-trace") as one, \
            agent(b, "gpu-02", pki, "--no-trace") as two:
        srv = fleet_server(pki, nodes_arg([one, two]))
        got = call(srv, "get_cpu_profile", {"pid": MAIN, "top_n": 5, "stacks_n": 3})
        only = call(srv, "get_cpu_profile", {"node": "gpu-02"})
    assert got["status"] == "complete"
    assert got["samples"] == 250 and got["gc_samples"] == 30 and got["threads"] == 2
    assert got["on_cpu_ns"] == 250 * CPU_PERIOD and got["period_ns"] == CPU_PERIOD
    top = {t["frame"]["untrusted"]: t for t in got["top"]}
    # collate is the innermost frame of 150 + 50 samples over the two nodes.
    assert top["collate (/w/data.py:40)"]["self_samples"] == 200
    assert top["collate (/w/data.py:40)"]["total_samples"] == 230
    assert [(s["node"], s["samples"]) for s in got["stacks"]] == [
        ("gpu-01", 150), ("gpu-02", 50), ("gpu-02", 30)]
    assert got["stacks"][0]["frames"] == {"untrusted": HOT}
    assert got["stacks_total"] == 4 and got["truncated"] is True
    assert any(t["frame"]["untrusted"] == f"{HOSTILE_CLEAN} (/w/evil.py:1)"
               for t in got["top"]), got["top"]
    assert only["samples"] == 80 and {s["node"] for s in only["stacks"]} == {"gpu-02"}
