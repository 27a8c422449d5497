"""``fleetd gpu --nodes``, ``GET /api/v1/gpu`` and MCP ``query_fleet gpu`` on real agents.

Two ``fleetd agent --no-trace`` processes on loopback, with certificates made by ``fleetd
certs``, each serve one imported rank of the shared PyTorch trace (tests/data/gpu) as its
own node. A third "node" is a stand-in HTTPS server with a valid node certificate that
answers ``/api/v1/gpu`` with whatever a test puts in it, so a lying or broken node can be
shown to be bounded: it becomes a warning and the partial exit code, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, AnsweringNode, Pki, agent, answering_node, client_ssl
from mcp import Client

from fleetd.cli.main import main
from fleetd.fleet.client import ClientOptions
from fleetd.fleet.fanout import FleetOptions
from fleetd.fleet.targets import parse_nodes
from fleetd.mcp.fleet import FleetBackend
from fleetd.mcp.server import build_server

from conftest import FLEETD

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
RANKS = {"gpu-01": DATA / "sampled_rank-0.json.gz", "gpu-02": DATA / "sampled_rank-1.json.gz"}
EXIT_PARTIAL = 3
# Everything of a rank that does not depend on the clock it is read on.
FIGURES = ("pid", "rank", "device", "window_ns", "idle_ns", "idle_pct", "compute_pct",
           "comm_pct", "memcpy_pct", "kernels", "nccl_kernels", "nccl_ns", "launches",
           "tklqt_ns", "launch_delay_ns", "queue_delay_ns", "tklqt_reading")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory,
          pki: Pki) -> Iterator[tuple[Pki, dict[str, Path], list[Agent]]]:
    d = tmp_path_factory.mktemp("gpufleet")
    dbs = {}
    for node, src in RANKS.items():
        dbs[node] = d / f"{node}.db"
        assert main(["import", str(src), "--db", str(dbs[node]), "--node", node]) == 0
    with ExitStack() as stack:
        yield pki, dbs, [stack.enter_context(agent(db, node, pki, "--no-trace"))
                         for node, db in dbs.items()]


@pytest.fixture(scope="module")
def liar(setup: Any) -> Iterator[AnsweringNode]:
    """A node with a valid certificate whose /api/v1/gpu answer is set by the test."""
    with answering_node(setup[0], "liar") as server:
        yield server


def nodes(agents: list[Agent], *extra: str) -> str:
    return ",".join([*(a.url.removeprefix("https://") for a in agents), *extra])


def fleet_gpu(pki: Pki, node_list: str, *extra: str) -> subprocess.CompletedProcess[str]:
    # stdout goes to a file, not a pipe: after a uvloop run, a large write to a pipe whose
    # reader lags can come back short (seen with every fleet command; reported).
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run([FLEETD, "gpu", "--nodes", node_list, *pki.client_flags(),
                               "--timeout", "10", *extra], stdout=out, stderr=subprocess.PIPE,
                              text=True, timeout=120)
        out.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), proc.stderr)


def local(capsys: pytest.CaptureFixture[str], db: Path) -> dict[str, Any]:
    assert main(["gpu", "--db", str(db), "--format", "json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def expected_straggler(ranks: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The straggler scoring of ``explain`` (docs/explain.md), by hand: per metric each
    rank's speed over the best rank's (latency: 1/(value + 1 us); share: 1 - value);
    the lowest score names the slowest rank and the metric."""
    def step(r: dict[str, Any]) -> float:
        return sum(s["step_ns"] for s in r["steps"]) / len(r["steps"])

    speeds = {"step_ns": {n: 1 / (step(r) + 1000) for n, r in ranks.items()},
              "idle_share": {n: 1 - r["idle_pct"] / 100 for n, r in ranks.items()}}
    scores = [(v / max(by.values()), metric, n) for metric, by in speeds.items()
              for n, v in by.items()]
    _, metric, node = min(scores)
    return node, metric


def test_per_rank_figures_equal_the_local_ones_and_the_slowest_is_named(
        setup: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pki, dbs, agents = setup
    proc = fleet_gpu(pki, nodes(agents), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["warnings"] == []
    by_node = {r["node"]: r for r in got["ranks"]}
    assert set(by_node) == set(RANKS)
    want = {}
    for node, db in dbs.items():
        mine = local(capsys, db)
        (rank,) = mine["ranks"]
        want[node] = rank
        for key in FIGURES:
            assert by_node[node][key] == rank[key], (node, key)
        assert by_node[node]["verdict"]["metrics"] == rank["verdict"]["metrics"]
        assert by_node[node]["verdict"]["host_overhead"] == rank["verdict"]["host_overhead"]
        assert [s["step_ns"] for s in by_node[node]["steps"]] == [
            s["step_ns"] for s in rank["steps"]]
        names = {k["name"] for k in got["kernels"] if k["node"] == node}
        assert names == {k["name"] for k in mine["kernels"]}
    node, metric = expected_straggler(want)
    assert (got["straggler"]["node"], got["straggler"]["metric"]) == (node, metric)
    table = fleet_gpu(pki, nodes(agents))
    assert table.returncode == 0 and f"SLOWEST RANK {node}" in table.stdout


def test_the_node_route_itself(setup: Any) -> None:
    from agents import request

    pki, dbs, agents = setup
    status, body, _ = request(agents[0].url, client_ssl(pki), path="/api/v1/gpu?steps=1")
    assert status == 200 and body["node"] == "gpu-01" and len(body["ranks"]) == 1
    status, body, _ = request(agents[0].url, client_ssl(pki),
                              path="/api/v1/gpu?thresholds=M9%3D1")
    assert status == 400 and body["error"]["code"] == "bad_request"


def test_a_dead_node_is_a_warning_and_the_partial_exit_code(setup: Any) -> None:
    pki, _, agents = setup
    dead = dead_address()
    proc = fleet_gpu(pki, nodes(agents, dead), "--format", "json")
    assert proc.returncode == EXIT_PARTIAL, proc.stderr
    got = json.loads(proc.stdout)
    assert {r["node"] for r in got["ranks"]} == set(RANKS)
    assert [w["node"] for w in got["warnings"]] == [dead]
    assert "Traceback" not in proc.stderr
    table = fleet_gpu(pki, nodes(agents, dead))
    assert table.returncode == EXIT_PARTIAL and dead in table.stderr
    assert "Traceback" not in table.stderr


def _good_rank(setup: Any, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return dict(local(capsys, setup[1]["gpu-01"])["ranks"][0])


GARBAGE: list[tuple[str, Any]] = [
    ("not an object", ["ranks"]),
    ("ranks not a list", {"node": "liar", "ranks": "everything"}),
    ("too many ranks", {"node": "liar", "ranks": [{}] * 5000}),
    ("idle above 100 %", {"idle_pct": 250.0}),
    ("infinite window", {"window_ns": 1e400}),
    ("negative kernels", {"kernels": -3}),
    ("a verdict that is neither", {"verdict": {"host_overhead": "MAYBE", "metrics": {}}}),
    ("steps as a string", {"steps": "many"}),
    ("a step without a time", {"steps": [{"name": "ProfilerStep#1"}]}),
    ("metrics as a list", {"verdict": {"host_overhead": "NO", "metrics": [1, 2]}}),
]


@pytest.mark.parametrize(("what", "garbage"), GARBAGE, ids=[g[0] for g in GARBAGE])
def test_a_node_answering_garbage_is_bounded(setup: Any, liar: AnsweringNode, what: str,
                                             garbage: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pki, _, agents = setup
    if isinstance(garbage, dict) and "ranks" not in garbage:
        rank = {**_good_rank(setup, capsys), **garbage}
        garbage = {"node": "liar", "ranks": [rank], "kernels": [], "warnings": []}
    liar.answers = {"/api/v1/gpu": garbage}
    for fmt in ("json", "table"):
        proc = fleet_gpu(pki, nodes(agents, liar.address), "--format", fmt)
        assert proc.returncode == EXIT_PARTIAL, (what, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert "bad_json" in proc.stderr or fmt == "json"
        if fmt == "json":
            got = json.loads(proc.stdout)
            assert {r["node"] for r in got["ranks"]} == set(RANKS), what
            assert [w["kind"] for w in got["warnings"]] == ["bad_json"], what


def test_control_characters_from_a_node_are_cleaned(setup: Any, liar: AnsweringNode,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pki, _, agents = setup
    rank = _good_rank(setup, capsys)
    liar.answers = {"/api/v1/gpu": {
        "node": "liar", "ranks": [dict(rank, pid=99)], "warnings": [],
        "kernels": [{"name": "evil\x1b[2J\x07kernel", "count": 1, "total_ns": 5, "mean_ns": 5,
                     "p50_ns": 5, "p99_ns": 5, "share_pct": 100}]}}
    proc = fleet_gpu(pki, nodes(agents, liar.address), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert {r["node"] for r in got["ranks"]} == {*RANKS, "liar"}
    assert "evil?[2J?kernel" in {k["name"] for k in got["kernels"]}


def test_mcp_query_fleet_gpu(setup: Any) -> None:
    pki, dbs, agents = setup
    opts = FleetOptions(tuple(parse_nodes(nodes(agents, dead_address()))),
                        ClientOptions(ssl=client_ssl(pki), timeout_s=20))
    srv = build_server(FleetBackend(opts))

    async def go() -> Any:
        async with Client(srv, mode="legacy") as client:
            return await client.call_tool("query_fleet", {"action": "gpu", "top_n": 3})

    result = asyncio.run(go())
    got = json.loads(result.content[0].text)
    assert result.is_error is False, got
    assert got["status"] == "partial" and got["answered"] == "2 of 3 node(s)"
    assert len(got["warnings"]) == 1
    assert {r["node"] for r in got["ranks"]} == set(RANKS)
    assert all(r["verdict"]["host_overhead"] in ("YES", "NO") for r in got["ranks"])
    assert got["straggler"]["node"] in RANKS
    assert len(got["kernels"]) == 3 and got["truncated"] is True
    assert all(set(k["name"]) == {"untrusted"} for k in got["kernels"])
    assert got["kernels_total"] == sum(
        len(json.loads(subprocess.run([FLEETD, "gpu", "--db", str(db), "--format", "json"],
                                      capture_output=True, text=True, check=True).stdout)
                       ["kernels"]) for db in dbs.values())
