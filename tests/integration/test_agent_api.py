"""Two agents on loopback, certificates from `fleetd certs`, every endpoint over mTLS."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from agents import Agent, Pki, agent, client_ssl, request
from hostile import HOSTILE_OVER_HTTP

from conftest import build_db


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[Agent]]:
    d = tmp_path_factory.mktemp("fleet")
    dbs = [build_db(d / "gpu-01.db", "gpu-01", 400), build_db(d / "gpu-02.db", "gpu-02", 200)]
    with agent(dbs[0], "gpu-01", pki, "--no-trace") as a1, \
            agent(dbs[1], "gpu-02", pki, "--no-trace") as a2:
        yield [a1, a2]


def test_every_endpoint_answers_over_mtls(fleet: list[Agent], pki: Pki) -> None:
    ctx = client_ssl(pki)
    for a, n in zip(fleet, (400, 200), strict=True):
        status, health, _ = request(a.url, ctx)
        assert status == 200 and health["node"] == a.node and health["status"] == "ok"
        status, clock, _ = request(a.url, ctx, path="/api/v1/time")
        assert status == 200 and abs(clock["t1_ns"] - time.time_ns()) < 5e9
        assert clock["t1_ns"] <= clock["t2_ns"]
        status, res, _ = request(a.url, ctx, "POST", "/api/v1/query",
                                 json={"sql": "SELECT count(*) FROM events"})
        assert status == 200 and res["rows"] == [[n]] and res["truncated"] is False
        status, _, raw = request(a.url, ctx, path="/api/v1/events?limit=250")
        lines = [json.loads(x) for x in raw.splitlines()]
        assert status == 200 and len(lines) == min(250, n)
        assert [e["ts_ns"] for e in lines] == sorted(e["ts_ns"] for e in lines)
        assert lines[0]["id"] == f"{a.node}:1" and lines[0]["node"] == a.node
        status, _, text = request(a.url, ctx, path="/metrics")
        assert status == 200 and b"fleetd_query_seconds_count" in text


def test_events_stream_pages_through_everything(fleet: list[Agent], pki: Pki) -> None:
    status, _, raw = request(fleet[0].url, client_ssl(pki), path="/api/v1/events")
    ids = [json.loads(x)["id"] for x in raw.splitlines()]
    assert status == 200 and len(ids) == 400 and len(set(ids)) == 400


def test_events_window(fleet: list[Agent], pki: Pki) -> None:
    ctx = client_ssl(pki)
    _, _, raw = request(fleet[1].url, ctx, path="/api/v1/events")
    all_ts = [json.loads(x)["ts_ns"] for x in raw.splitlines()]
    lo, hi = all_ts[50], all_ts[150]
    _, _, raw = request(fleet[1].url, ctx, path=f"/api/v1/events?since={lo}&until={hi}")
    assert [json.loads(x)["ts_ns"] for x in raw.splitlines()] == all_ts[50:150]


def test_client_without_certificate_is_refused(fleet: list[Agent], pki: Pki) -> None:
    from fleetd.security import tls

    ctx = tls.client_context(pki.ca, None, None)
    with pytest.raises(aiohttp.ClientError):
        request(fleet[0].url, ctx)


@pytest.mark.parametrize(("body", "status", "code"), HOSTILE_OVER_HTTP,
                         ids=[str(i) for i in range(len(HOSTILE_OVER_HTTP))])
def test_hostile_requests_get_a_clear_4xx(
    fleet: list[Agent], pki: Pki, body: bytes, status: int, code: str
) -> None:
    a = fleet[0]
    db = Path(str(a.log).replace("agent-gpu-01.log", "gpu-01.db"))
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    started = time.monotonic()
    got, err, _ = request(a.url, client_ssl(pki), "POST", "/api/v1/query", data=body,
                          headers={"Content-Type": "application/json"})
    assert time.monotonic() - started < 8.0
    assert got == status, err
    assert err["error"]["code"] == code and err["error"]["message"]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert request(a.url, client_ssl(pki))[0] == 200  # still up


def test_concurrent_flood_is_answered_or_refused_as_busy(fleet: list[Agent], pki: Pki) -> None:
    ctx = client_ssl(pki)
    slow = {"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) "
                   "SELECT count(*) FROM c", "timeout_s": 0.5}

    async def flood() -> list[int]:
        async with aiohttp.ClientSession() as s:
            async def one() -> int:
                async with s.post(fleet[1].url + "/api/v1/query", json=slow, ssl=ctx) as r:
                    await r.read()
                    return r.status
            return await asyncio.gather(*(one() for _ in range(40)))

    statuses = asyncio.run(flood())
    assert set(statuses) <= {408, 429}, statuses
    assert 408 in statuses
    assert request(fleet[1].url, ctx)[0] == 200


def test_sigterm_drains_and_exits_zero(tmp_path: Path, pki: Pki) -> None:
    db = build_db(tmp_path / "gpu-01.db", "gpu-01", 10)
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        assert request(a.url, client_ssl(pki))[0] == 200
        assert a.stop(signal.SIGTERM) == 0
    assert "draining" in a.log.read_text()


def test_loopback_without_certificates_uses_a_pinned_self_signed_cert(tmp_path: Path) -> None:
    from fleetd.security import tls

    db = build_db(tmp_path / "solo.db", "solo", 10)
    with agent(db, "solo", None, "--no-trace") as a:
        text = a.log.read_text()
        fp = text.split("SHA-256 ")[1].split(")")[0]
        status, health, _ = request(a.url, tls.client_context(None, None, None, pinned_sha256=fp))
        assert status == 200 and health["node"] == "solo"


def test_token_is_required_when_configured(tmp_path: Path, pki: Pki) -> None:
    db = build_db(tmp_path / "gpu-02.db", "gpu-02", 10)
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    token.chmod(0o600)
    with agent(db, "gpu-02", pki, "--no-trace", "--token-file", str(token)) as a:
        ctx = client_ssl(pki)
        q = {"sql": "SELECT 1"}
        assert request(a.url, ctx, "POST", "/api/v1/query", json=q)[0] == 401
        bad = {"Authorization": "Bearer s3cret-token-of-enough-lengtX"}
        assert request(a.url, ctx, "POST", "/api/v1/query", json=q, headers=bad)[0] == 401
        good = {"Authorization": "Bearer s3cret-token-of-enough-length"}
        assert request(a.url, ctx, "POST", "/api/v1/query", json=q, headers=good)[0] == 200


def test_non_loopback_listen_without_client_ca_is_refused(tmp_path: Path, pki: Pki) -> None:
    import subprocess

    from conftest import FLEETD

    db = build_db(tmp_path / "x.db", "gpu-01", 10)
    cert, key = pki.pair("gpu-01")
    proc = subprocess.run([FLEETD, "agent", "--no-trace", "--db", str(db), "--node", "gpu-01",
                           "--listen", "0.0.0.0:0", "--tls-cert", str(cert), "--tls-key",
                           str(key)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "requires client certificates" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_analysis_endpoints(tmp_path: Path, pki: Pki) -> None:
    from synth import STRESS, build

    db = build("cpu_hog", tmp_path)  # a database of node gpu-01, served as a copy
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        ctx = client_ssl(pki)
        status, res, _ = request(a.url, ctx, path="/api/v1/chains?top_n=2")
        assert status == 200 and res["node"] == "gpu-01" and 1 <= len(res["chains"]) <= 2
        top = res["chains"][0]
        assert top["root_cause"] == "cpu_contention" and top["culprit"]["pid"] == STRESS
        status, res, _ = request(a.url, ctx, path="/api/v1/ops")
        assert status == 200 and any(r["op"] == "cudaStreamSynchronize" for r in res["ops"])
        status, res, _ = request(a.url, ctx, path="/api/v1/overview")
        assert status == 200 and res["events"] > 0 and res["chains"]["HIGH"] >= 1
        status, res, _ = request(a.url, ctx, path="/api/v1/profile")
        assert status == 200 and res["features"]["cuda_calls_per_s"] > 0
        status, res, _ = request(a.url, ctx, path="/api/v1/chains?since=forever")
        assert status == 400 and "invalid duration" in res["error"]["message"]
        status, res, _ = request(a.url, ctx, path="/api/v1/chains?top_n=-1")
        assert status == 400


def test_served_copy_takes_its_node_name_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    import subprocess

    from conftest import FLEETD

    db = build_db(tmp_path / "copy.db", "gpu-09", 10)
    proc = subprocess.run([FLEETD, "agent", "--no-trace", "--db", str(db), "--node", "gpu-01",
                           "--listen", "127.0.0.1:0"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "holds no node named 'gpu-01'" in proc.stderr
    assert "gpu-09" in proc.stderr


def test_stacks_and_graphs_endpoints(tmp_path: Path, pki: Pki) -> None:
    """The node serves the stack grouping and the graph lifecycle the local MCP tools
    give, over the same analyzer facade, with bounded parameters."""
    from mcp_data import SYNC_STACK
    from mcp_data import build as build_with_stacks
    from synth import MAIN
    from synth import build as build_synth

    db = build_with_stacks("cpu_hog", tmp_path / "stacks.db", "gpu-01")
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        ctx = client_ssl(pki)
        status, res, _ = request(a.url, ctx,
                                 path="/api/v1/stacks?op=cudaStreamSynchronize&frames_n=2")
        assert status == 200 and res["node"] == "gpu-01", res
        [s] = res["stacks"]
        assert s["frames"] == SYNC_STACK[:2] and s["frames_omitted"] == len(SYNC_STACK) - 2
        assert s["processes"][0]["pid"] == MAIN and res["events_without_stack"] == 0
        status, res, _ = request(a.url, ctx, path="/api/v1/stacks?op=cudaLaunchKernl")
        assert status == 400 and "cudaLaunchKernel" in res["error"]["hint"]
        status, res, _ = request(a.url, ctx, path="/api/v1/stacks?top_n=100000")
        assert status == 400 and "no larger than" in res["error"]["message"]
        status, res, _ = request(a.url, ctx, path="/api/v1/graphs")
        assert status == 200 and res["processes"] == [] and "note" in res
    graph_db = build_synth("graph_storm", tmp_path)
    with agent(graph_db, "gpu-01", pki, "--no-trace") as a:
        status, res, _ = request(a.url, client_ssl(pki), path="/api/v1/graphs?buckets=10")
        assert status == 200, res
        [p] = res["processes"]
        assert p["pid"] == MAIN and p["phases"]["instantiate"]["count"] == 30
        assert len(p["timeline"]["rows"]) == 10 and p["verdict"].startswith("re-capturing")
