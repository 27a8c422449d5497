"""``fleetd pods --nodes``, ``GET /api/v1/pods`` and the MCP fleet tool ``get_pods``: the
question added through the registry (fleetd.questions), over three mTLS agents (placed
pods, a schema-5 file without pods, a schema-4 file from before pods were recorded)."""

from __future__ import annotations

import json

from agents import Agent, Pki, client_ssl, request
from test_fleet_pods import LOADER, NODES, TRAINER, ask, fleet  # noqa: F401 (fixtures)


def test_every_node_answers_its_pods(pki: Pki, fleet: list[Agent]) -> None:  # noqa: F811
    proc = ask(pki, fleet, "pods", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert "nodes" not in got and got["warnings"] == [] and set(got["skew"]) == set(NODES)
    node, ns, pod, container, pid = (got["columns"].index(c) for c in (
        "node", "namespace", "pod", "container", "pid"))
    assert {(r[node], r[ns], r[pod], r[container], r[pid]) for r in got["rows"]} == {
        (NODES[0], "ml", "trainer-0", "trainer", TRAINER),
        (NODES[0], "ml", "loader-0", "loader", LOADER)}
    assert {(g["node"], g["pod"], tuple(g["pids"])) for g in got["pods"]} == {
        (NODES[0], "trainer-0", (TRAINER,)), (NODES[0], "loader-0", (LOADER,))}
    table = ask(pki, fleet, "pods")
    assert table.returncode == 0 and "trainer-0" in table.stdout, table.stderr


def test_the_node_route_answers_without_a_window(pki: Pki, fleet: list[Agent]  # noqa: F811
                                                 ) -> None:
    ctx = client_ssl(pki)
    status, body, _ = request(fleet[0].url, ctx, path="/api/v1/pods?since=nonsense")
    assert status == 200, body
    assert body["node"] == NODES[0] and {p["pid"] for p in body["processes"]} == {TRAINER,
                                                                                 LOADER}
    status, old, _ = request(fleet[2].url, ctx, path="/api/v1/pods")
    assert status == 200 and old["processes"] == [] and old["note"]


def test_the_mcp_fleet_tool(pki: Pki, fleet: list[Agent]) -> None:  # noqa: F811
    from test_mcp_fleet import call, fleet_server

    srv = fleet_server(pki, ",".join(a.url.removeprefix("https://") for a in fleet))
    got = call(srv, "get_pods", {})
    assert got["status"] == "complete" and len(got["processes"]) == 2
    only = call(srv, "get_pods", {"node": NODES[1]})
    assert only["processes"] == []
