"""Issue 21, agent side: each attack of the attack run, through a real `fleetd agent` on
loopback with certificates from `fleetd certs`, under lowered limits (fleetd.yaml) so
that every bound is reached in a second or two."""

from __future__ import annotations

import asyncio
import resource
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from agents import Agent, Pki, agent, client_ssl, issue_odd, mem_mb, metric_value, request
from cryptography import x509

from fleetd.security import tls

from conftest import build_db

MAX_BYTES = 1024 * 1024
CONFIG = f"""
limits:
  max_bytes: {MAX_BYTES}
  query_timeout_s: 3
  max_concurrent_queries: 4
  max_connections: 40
  max_connections_per_source: 20
  handshake_timeout_s: 1
  header_timeout_s: 1
  body_timeout_s: 1
tls:
  relay_nodes: [gpu-02]
"""
RUNAWAY = {"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                  "SELECT count(*) FROM c", "timeout_s": 3}


@pytest.fixture(scope="module")
def pki(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The fleet's, plus "bare": a certificate from the fleet CA without any EKU or
    role (what the run found)."""
    ours = pki.copy_to(tmp_path_factory.mktemp("hard-pki") / "certs")
    issue_odd(ours, "bare", x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "bare")]))
    return ours


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("hard")
    (d / "fleetd.yaml").write_text(CONFIG)
    db = build_db(d / "gpu-01.db", "gpu-01", 300)
    with agent(db, "gpu-01", pki, "--no-trace", "--config", str(d / "fleetd.yaml")) as a:
        # The descriptor limit of a small machine, above the connection cap (40).
        resource.prlimit(a.proc.pid, resource.RLIMIT_NOFILE, (96, 96))
        yield a


def _metric(a: Agent, pki: Pki, name: str) -> float:
    _, _, text = request(a.url, client_ssl(pki), path="/metrics")
    return metric_value(text.decode(), name)


def _hostport(a: Agent) -> tuple[str, int]:
    host, port = a.url.removeprefix("https://").split(":")
    return host, int(port)


def _tls_socket(a: Agent, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(_hostport(a), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def _read_all(s: ssl.SSLSocket, timeout: float) -> tuple[bytes, float]:
    """What the server sends until it closes; and when it closed (inf: never)."""
    s.settimeout(timeout)
    got, t0 = b"", time.monotonic()
    try:
        while True:
            piece = s.recv(65536)
            if not piece:
                return got, time.monotonic() - t0
            got += piece
    except (TimeoutError, ssl.SSLError, OSError):
        return got, float("inf") if not got else time.monotonic() - t0


# ---- 1. connection flood ---------------------------------------------------------------


async def _get_from(url: str, ctx: ssl.SSLContext, local: str, path: str) -> tuple[int, float]:
    conn = aiohttp.TCPConnector(local_addr=(local, 0), ssl=ctx)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=conn) as s, s.get(url + path) as r:
        await r.read()
        return r.status, time.monotonic() - t0


def test_a_flood_of_silent_connections_does_not_lock_clients_out(node: Agent,
                                                                  pki: Pki) -> None:
    refused0 = _metric(node, pki, "connections_refused_total")
    failed0 = _metric(node, pki, "tls_handshake_failures_total")
    flood: list[socket.socket] = []
    missed: list[str] = []
    reset = 0
    for _ in range(150):  # beyond the cap (40) and the descriptor limit (96)
        try:
            flood.append(socket.create_connection(_hostport(node), timeout=2))
        except ConnectionResetError:
            # The server refuses a connection over its cap with an RST (linger 0); when it
            # does so before connect() has looked at the socket, the refusal shows here
            # (CI saw it from the 53rd on). It still counts as a refused flood connection.
            reset += 1
        except OSError as exc:
            # A connect can time out when one SYN is lost (its retry comes after 1 s,
            # CI saw one at the 53rd): go on, the flood only has to reach its size.
            missed.append(repr(exc))
            if len(missed) >= 5:
                break
    tried = len(flood) + reset
    try:
        time.sleep(0.2)
        # Another source is served at once, while the flood still holds its connections.
        status, took = asyncio.run(_get_from(node.url, client_ssl(pki), "127.0.0.2",
                                             "/api/v1/health"))
        assert status == 200 and took < 3, (status, took)
    finally:
        for s in flood:
            s.close()
    # Every flood connection ends as refused (over a cap) or as a failed handshake (it
    # was held, or still queued for accept when the flood closed, then sent nothing);
    # which of the two depends on how far the accept loop got, so the test bounds each
    # side and checks the sum. Handshakes time out after 1 s.
    deadline = time.monotonic() + 5
    while True:
        refused = _metric(node, pki, "connections_refused_total") - refused0
        failed = _metric(node, pki, "tls_handshake_failures_total") - failed0
        if refused + failed >= tried - 5 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert tried >= 100, (len(flood), reset, missed)
    assert refused >= 50 and failed >= 15, (refused, failed)
    assert refused + failed >= tried - 5, (refused, failed, tried)
    assert _metric(node, pki, "connections_open") <= 2


# ---- 2. memory per query -----------------------------------------------------------------


def test_huge_values_are_refused_or_cut_at_the_byte_limit_on_the_wire(node: Agent,
                                                                     pki: Pki) -> None:
    ctx = client_ssl(pki)
    q = {"sql": "SELECT zeroblob(4000000) FROM events", "max_rows": 1}
    status, res, _ = request(node.url, ctx, "POST", "/api/v1/query", json=q)
    assert status == 413 and res["error"]["code"] == "too_large"
    for sql in ("SELECT zeroblob(300000) FROM events",  # 600 kB as hex
                "SELECT CAST(zeroblob(200000) AS TEXT) FROM events"):  # NULs: 6x escaped
        status, res, raw = request(node.url, ctx, "POST", "/api/v1/query", json={"sql": sql})
        assert status == 200 and res["truncated_reason"] == "bytes", sql
        assert len(raw) <= MAX_BYTES + 1024 and len(res["rows"]) <= 1


def test_blob_queries_at_once_keep_the_agent_small_and_health_quick(node: Agent,
                                                                   pki: Pki) -> None:
    ctx = client_ssl(pki)
    before = mem_mb(node.proc.pid)["VmRSS"]

    async def go() -> float:
        # Ten connections (under the per-source cap of 20) carry the twenty queries.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=10)) as s, \
                aiohttp.ClientSession() as h:
            async def blob() -> int:
                async with s.post(node.url + "/api/v1/query", ssl=ctx, json={
                        "sql": "SELECT zeroblob(500000) FROM events"}) as r:
                    await r.read()
                    return r.status
            jobs = [asyncio.create_task(blob()) for _ in range(20)]
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            async with h.get(node.url + "/api/v1/health", ssl=ctx) as r:
                await r.read()
            took = time.monotonic() - t0
            statuses = await asyncio.gather(*jobs)
            assert set(statuses) <= {200, 429}, statuses
            return took

    health_s = asyncio.run(go())
    mem = mem_mb(node.proc.pid)
    assert health_s < 1.0
    assert mem["VmHWM"] - before < 150, (before, mem)  # was +1 GB for a single query


# ---- 3. fairness -------------------------------------------------------------------------


def test_one_clients_flood_leaves_readers_for_others(node: Agent, pki: Pki) -> None:
    flooder, other = client_ssl(pki, "laptop"), client_ssl(pki, "desk")

    async def go() -> None:
        async with aiohttp.ClientSession() as s1, aiohttp.ClientSession() as s2:
            async def ask(s: aiohttp.ClientSession, ctx: ssl.SSLContext,
                          body: dict[str, Any]) -> int:
                async with s.post(node.url + "/api/v1/query", ssl=ctx, json=body) as r:
                    await r.read()
                    return r.status
            flood = [asyncio.create_task(ask(s1, flooder, RUNAWAY)) for _ in range(4)]
            await asyncio.sleep(0.4)
            t0 = time.monotonic()
            assert await ask(s2, other, {"sql": "SELECT count(*) FROM events"}) == 200
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            async with s2.get(node.url + "/api/v1/health", ssl=other) as r:
                assert r.status == 200 and time.monotonic() - t0 < 0.5
            # Two ran into their time limit; the other two waited for their own share.
            assert sorted(await asyncio.gather(*flood)) == [408, 408, 429, 429]

    asyncio.run(go())


# ---- 4. slow headers and bodies, big bodies ----------------------------------------------


def test_slow_headers_are_closed(node: Agent, pki: Pki) -> None:
    s = _tls_socket(node, client_ssl(pki))
    s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    closed = None
    for _ in range(8):
        time.sleep(0.5)
        try:
            s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            closed = time.monotonic() - t0
            break
        s.settimeout(0.01)
        try:
            if s.recv(100) == b"":
                closed = time.monotonic() - t0
                break
        except (TimeoutError, ssl.SSLWantReadError):
            pass
    assert closed is not None and closed < 3.5


def test_slow_body_gets_408_and_a_closed_connection(node: Agent, pki: Pki) -> None:
    s = _tls_socket(node, client_ssl(pki))
    s.sendall(b"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{")
    got, closed_after = _read_all(s, 5)
    assert got.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in got
    assert closed_after < 4


def test_body_over_the_limit_is_refused_unread(node: Agent, pki: Pki) -> None:
    s = _tls_socket(node, client_ssl(pki))
    s.sendall(b"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 104857600\r\n\r\n")
    got, closed_after = _read_all(s, 5)
    assert got.startswith(b"HTTP/1.1 413") and b'"too_large"' in got and closed_after < 2
    time.sleep(0.5)  # the close has reached the agent's socket, on a loaded machine too
    sent, cut = 0, False
    try:
        for _ in range(1600):  # 100 MB if the agent kept reading
            s.sendall(b" " * 65536)
            sent += 65536
    except OSError:
        cut = True
    assert cut and sent < 100 * 1024 * 1024, sent


# ---- 5. out-of-range input ---------------------------------------------------------------

OUT_OF_RANGE = [
    ("POST", "/api/v1/query", {"sql": "SELECT ?", "params": [9223372036854775808]}),
    ("POST", "/api/v1/query", {"sql": "SELECT :a", "params": {"a": 2**64 - 1}}),
    ("GET", "/api/v1/ops?pid=9223372036854775808", None),
    ("GET", "/api/v1/chains?since=99999999999999999999d", None),
    ("GET", "/api/v1/overview?from=0001-01-01", None),
    ("GET", "/api/v1/overview?to=99999999999999999999", None),
    ("GET", "/api/v1/events?since=9223372036854775808", None),
    ("GET", "/api/v1/events?until=-1", None),
    ("GET", "/api/v1/stacks?top_n=99999999999999999999999", None),
]


@pytest.mark.parametrize(("method", "path", "body"), OUT_OF_RANGE)
def test_out_of_range_input_is_a_json_400(node: Agent, pki: Pki, method: str, path: str,
                                          body: Any) -> None:
    status, res, raw = request(node.url, client_ssl(pki), method, path, json=body)
    assert status == 400 and res["error"]["code"] == "bad_request", raw


def test_malformed_http_is_a_json_400_without_a_traceback(node: Agent, pki: Pki) -> None:
    s = _tls_socket(node, client_ssl(pki))
    s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
    got, _ = _read_all(s, 5)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head and b"application/json" in head
    assert orjson.loads(body)["error"]["code"] == "bad_request"
    assert "Traceback" not in node.log.read_text()


def test_undecodable_token_is_a_401(tmp_path: Path, pki: Pki) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    token.chmod(0o600)
    db = build_db(tmp_path / "t.db", "gpu-01", 10)
    with agent(db, "gpu-01", pki, "--no-trace", "--token-file", str(token)) as a:
        raw = socket.create_connection(_hostport(a), timeout=10)
        s = client_ssl(pki).wrap_socket(raw, server_hostname="127.0.0.1")
        s.sendall(b"GET /api/v1/ops HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                  b"Connection: close\r\n\r\n")
        got, _ = _read_all(s, 5)
        assert got.startswith(b"HTTP/1.1 401") and b'"unauthorized"' in got
        assert "Traceback" not in a.log.read_text()


# ---- 8. who may query --------------------------------------------------------------------


def _as(pki: Pki, name: str) -> ssl.SSLContext:
    cert, key = pki.pair(name)
    return tls.client_context(pki.ca, cert, key)


def test_node_certificates_and_roleless_ones_are_refused_as_clients(node: Agent,
                                                                    pki: Pki) -> None:
    before = _metric(node, pki, "client_cert_refusals_total")
    q = {"sql": "SELECT 1"}
    for name, why in (("gpu-03", "node certificate"), ("bare", "not issued for client use")):
        status, res, _ = request(node.url, _as(pki, name), "POST", "/api/v1/query", json=q)
        assert status == 403 and res["error"]["code"] == "forbidden" and why in \
            res["error"]["message"], res
    # gpu-02 is listed under tls.relay_nodes: its node certificate may forward a client's
    # query (marked with the client it forwards for), never ask on its own behalf.
    status, res, _ = request(node.url, _as(pki, "gpu-02"), "POST", "/api/v1/query", json=q)
    assert status == 403 and "may only forward" in res["error"]["message"], res
    assert request(node.url, _as(pki, "gpu-02"), "POST", "/api/v1/query", json=q,
                   headers={"X-Fleetd-Relayed-For": "cert:laptop"})[0] == 200
    assert request(node.url, client_ssl(pki), "POST", "/api/v1/query", json=q)[0] == 200
    assert _metric(node, pki, "client_cert_refusals_total") - before == 2
