"""The fleet client against real agents on loopback: merged rows, --reduce, every way a
node can fail (each with its reason), usage mistakes, and ops/overview/explain fan-out.

No namespaces needed: agents listen on 127.0.0.1 with certificates from `fleetd certs`.
"""

from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Pki, agent, make_pki

from conftest import FLEETD, REPO, build_db

NODES = ["gpu-01", "gpu-02", "gpu-03"]
ROWS = {"gpu-01": 120, "gpu-02": 200, "gpu-03": 280}


def fleetd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


@pytest.fixture(scope="module")
def pki(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The fleet's, plus "mallory" and "other-ca.pem" from a second fleet: its client
    certificate must be refused by ours."""
    tmp = tmp_path_factory.mktemp("client-pki")
    ours = pki.copy_to(tmp / "certs")
    other = make_pki(tmp / "other", [], ["mallory"])
    for src, dst in zip(other.pair("mallory"), ours.pair("mallory"), strict=True):
        shutil.copy2(src, dst)  # the key keeps its 0600
    shutil.copy2(other.ca, ours.dir / "other-ca.pem")
    return ours


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[Agent]]:
    tmp = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        agents = [stack.enter_context(agent(build_db(tmp / f"{n}.db", node=n, n=ROWS[n]), n,
                                            pki, "--no-trace")) for n in NODES]
        yield agents


def nodes(agents: list[Agent]) -> str:
    return ",".join(a.url.removeprefix("https://") for a in agents)


def ask(pki: Pki, agents: list[Agent], *args: str) -> subprocess.CompletedProcess[str]:
    return fleetd(*args, "--nodes", nodes(agents), *pki.client_flags())


# ---- merged rows and --reduce ---------------------------------------------------------


def test_rows_are_merged_with_a_leading_node_column(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "query", "SELECT op, count(*) AS n FROM events GROUP BY op",
               "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert set(obj) == {"columns", "rows", "truncated", "warnings", "skew"}
    assert obj["columns"] == ["node", "op", "n"] and obj["warnings"] == []
    assert set(obj["skew"]) == set(NODES)
    assert all(set(v) == {"offset_ms", "error_ms"} for v in obj["skew"].values())
    per_node = {n: sum(r[2] for r in obj["rows"] if r[0] == n) for n in NODES}
    assert per_node == ROWS
    assert [r[0] for r in obj["rows"]] == sorted(r[0] for r in obj["rows"])  # node order


def test_a_node_column_of_the_result_leads_instead_of_doubling(pki: Pki,
                                                               fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "query", "--op", "cudaLaunchKernel", "--since", "1d",
               "--limit", "3", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["columns"][:3] == ["node", "id", "ts_ns"] and obj["columns"].count("node") == 1
    assert obj["truncated"] is True and len(obj["rows"]) == 9
    assert {w["kind"] for w in obj["warnings"]} == {"truncated"}


def test_reduce_computes_fleet_wide_aggregates_from_per_node_rows(
        pki: Pki, fleet: list[Agent], tmp_path: Path) -> None:
    proc = ask(pki, fleet, "query", "SELECT dur_ns FROM events",
               "--reduce", "SELECT count(*) AS n, avg(dur_ns) AS mean, count(DISTINCT node) "
               "AS nodes FROM merged", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    n, mean, node_count = obj["rows"][0]
    # The same average straight from the three databases: the mean of all rows, not
    # the mean of three per-node means.
    total, count = 0, 0
    for a in fleet:
        db = Path(a.log).parent / f"{a.node}.db"
        with sqlite3.connect(db) as c:
            s, k = c.execute("SELECT sum(dur_ns), count(*) FROM event_data").fetchone()
        total, count = total + s, count + k
    assert (n, node_count) == (count, 3)
    assert mean == pytest.approx(total / count)


def test_reduce_mistakes_are_usage_errors(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "query", "SELECT op FROM events", "--reduce", "SELECT nope FROM merged")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--reduce" in proc.stderr and "merged(node, op)" in proc.stderr
    attach = ask(pki, fleet, "query", "SELECT op FROM events", "--reduce",
                 "ATTACH DATABASE '/tmp/x.db' AS x")
    assert attach.returncode == 2 and "not authorized" in attach.stderr


def test_every_node_refusing_the_sql_is_a_usage_error(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "query", "SELECT nope FROM events")
    assert proc.returncode == 2
    assert proc.stderr.startswith("fleetd: error: every node refused the request")
    assert "no such column: nope" in proc.stderr


# ---- ops, overview, explain -----------------------------------------------------------


def test_ops_overview_and_explain_fan_out(pki: Pki, fleet: list[Agent]) -> None:
    ops = json.loads(ask(pki, fleet, "ops", "--format", "json").stdout)
    assert ops["columns"][:2] == ["node", "op"] and set(ops["skew"]) == set(NODES)
    launches = {r[0]: r[ops["columns"].index("count")] for r in ops["rows"]
                if r[1] == "cudaLaunchKernel"}
    assert launches == {n: ROWS[n] // 4 for n in NODES}
    over = ask(pki, fleet, "overview")
    assert over.returncode == 0, over.stderr
    lines = over.stdout.splitlines()
    assert lines[0].split()[:3] == ["node", "events", "lost_events"]
    assert [ln.split()[:2] for ln in lines[2:5]] == [[n, str(ROWS[n])] for n in NODES]
    exp = json.loads(ask(pki, fleet, "explain", "--format", "json").stdout)
    assert set(exp) >= {"stragglers", "chains", "warnings", "skew"}
    assert sorted(s["node"] for s in exp["stragglers"]) == NODES
    assert not any(s["flagged"] for s in exp["stragglers"])


# ---- failures, each with its reason ---------------------------------------------------


def _warning(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    obj = json.loads(proc.stdout)
    assert len(obj["warnings"]) == 1, obj["warnings"]
    w: dict[str, str] = obj["warnings"][0]
    return w


def test_refused_port_is_a_refused_warning(pki: Pki, fleet: list[Agent]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the query: nobody listens
    proc = fleetd("query", "SELECT 1 AS one", "--nodes", f"{nodes(fleet[:1])},127.0.0.1:{port}",
                  *pki.client_flags(), "--format", "json")
    assert proc.returncode == 3, proc.stderr
    w = _warning(proc)
    assert w["node"] == f"127.0.0.1:{port}" and w["kind"] == "refused"
    assert "refused" in w["error"] and "is the agent running" in w["error"]


def test_missing_client_certificate_says_how_to_fix(pki: Pki, fleet: list[Agent]) -> None:
    proc = fleetd("query", "SELECT 1 AS one", "--nodes", nodes(fleet[:1]),
                  "--ca-cert", str(pki.ca), "--format", "json")
    assert proc.returncode == 4, proc.stderr
    w = _warning(proc)
    assert w["kind"] in ("tls", "disconnected"), w
    assert "client-cert" in w["error"], w


def test_client_certificate_from_another_ca_is_refused(pki: Pki, fleet: list[Agent]) -> None:
    proc = fleetd("query", "SELECT 1 AS one", "--nodes", nodes(fleet[:1]),
                  *pki.client_flags("mallory"), "--format", "json")
    assert proc.returncode == 4, proc.stderr
    w = _warning(proc)
    assert w["kind"] in ("tls", "disconnected"), w
    assert "client" in w["error"] and "certificate" in w["error"], w


def test_agent_certificate_from_another_ca_is_not_trusted(pki: Pki, fleet: list[Agent]) -> None:
    cert, key = pki.pair("laptop")
    proc = fleetd("query", "SELECT 1 AS one", "--nodes", nodes(fleet[:1]),
                  "--ca-cert", str(pki.dir / "other-ca.pem"), "--client-cert", str(cert),
                  "--client-key", str(key), "--format", "json")
    assert proc.returncode == 4, proc.stderr
    w = _warning(proc)
    assert w["kind"] == "tls" and "certificate was not accepted" in w["error"], w
    assert "not from the CA in --ca-cert" in w["error"]
    assert "Traceback" not in proc.stderr


def test_plain_http_agent_is_a_tls_failure(pki: Pki, tmp_path: Path) -> None:
    db = build_db(tmp_path / "plain.db", node="plain")
    with agent(db, "plain", None, "--no-trace", "--plain-http") as a:
        proc = fleetd("query", "SELECT 1 AS one", "--nodes", a.url.removeprefix("http://"),
                      *pki.client_flags(), "--format", "json")
    assert proc.returncode == 4, proc.stderr
    w = _warning(proc)
    assert w["kind"] == "tls" and "does not speak TLS" in w["error"], w


def test_missing_token_is_an_http_error_with_a_hint(pki: Pki, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-that-is-long-enough-1234\n")
    token.chmod(0o600)
    db = build_db(tmp_path / "gpu-01.db", node="gpu-01")
    with agent(db, "gpu-01", pki, "--no-trace", "--token-file", str(token)) as a:
        target = a.url.removeprefix("https://")
        proc = fleetd("query", "SELECT 1 AS one", "--nodes", target, *pki.client_flags(),
                      "--format", "json")
        good = fleetd("query", "SELECT 1 AS one", "--nodes", target, *pki.client_flags(),
                      "--token-file", str(token), "--format", "json")
    assert proc.returncode == 4
    w = _warning(proc)
    assert w["kind"] == "http" and "HTTP 401" in w["error"], w
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["rows"] == [["gpu-01", 1]]


@contextmanager
def not_an_agent(pki: Pki) -> Iterator[str]:
    """A TLS web server with the node certificate that answers HTML, not fleetd JSON."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer()

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer()

        def _answer(self) -> None:
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*pki.pair(NODES[0]))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_that_is_not_json_is_bad_json(pki: Pki) -> None:
    with not_an_agent(pki) as target:
        proc = fleetd("query", "SELECT 1 AS one", "--nodes", target, *pki.client_flags(),
                      "--format", "json")
    assert proc.returncode == 4, proc.stderr
    w = _warning(proc)
    assert w["kind"] == "bad_json" and "not JSON" in w["error"], w


# ---- usage mistakes -------------------------------------------------------------------


@pytest.mark.parametrize(("args", "needle"), [
    (["query", "SELECT 1", "--nodes", "127.0.0.1:1", "--db", "x.db"], "--db reads a local"),
    (["query", "SELECT 1", "--reduce", "SELECT 1"], "--reduce runs over the merged rows"),
    (["query", "SELECT 1", "--show-skew"], "--show-skew only apply to a fleet query"),
    (["query", "SELECT 1", "--nodes", "127.0.0.1:1"], "needs the fleet CA"),
    (["query", "SELECT 1", "--nodes", "nohost"], "invalid node address 'nohost'"),
    (["query", "SELECT 1", "--nodes", "a:1,a:1"], "listed twice"),
    (["explain", "--nodes", "127.0.0.1:1", "--ca-cert", "x.pem", "--store"], "--store"),
    (["query", "SELECT 1", "--nodes", "127.0.0.1:1", "--timeout", "soon"], "invalid duration"),
])
def test_usage_mistakes_exit_2_with_a_message(args: list[str], needle: str) -> None:
    proc = fleetd(*args)
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("fleetd: error: ") and "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr
