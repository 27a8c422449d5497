"""Issue 40, point 3: nodes must not steer the client. A TLS stand-in node (a node
certificate from `fleetd certs`) answers every request with a 307 to a plain-HTTP
listener on loopback that records whatever reaches it. The real client (`fleetd query
--nodes`, `fleetd explain --nodes`) and a real relay agent get the redirect as that
node's error, and the listener receives nothing: neither the request body nor the
bearer token leaves for an address that is not configured."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest
from agents import Agent, Pki, RawListener, agent, stand_in_node
from aiohttp import web

from conftest import FLEETD, REPO, build_db

SECRET_SQL = "SELECT 'the-body-must-stay-home' AS marker"
TOKEN = "a-bearer-token-that-must-stay-home-0123"


# A web server that is not a node: keeps every byte any connection sends it.
HTTP_OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
           b"Connection: close\r\n\r\n{}")


def redirecting_node(pki: Pki, to: str) -> AbstractContextManager[str]:
    """A node-API stand-in over TLS that answers every request with a 307 to ``to``."""
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"{to}{request.path}")

    return stand_in_node(pki, "hostile", [web.route("*", "/{tail:.*}", redirect)])


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[dict[str, object]]:
    d = tmp_path_factory.mktemp("redirects")
    token = d / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    recorder = RawListener(answer=HTTP_OK)
    with redirecting_node(pki, f"http://{recorder.address}") as evil:
        (d / "relay.yaml").write_text(
            f"relay:\n  enabled: true\n  peers: [evil={evil}]\n"
            f"  token_file: {token}\n")
        db = build_db(d / "gpu-01.db", "gpu-01", 30)
        with agent(db, "gpu-01", pki, "--no-trace") as good, \
                agent(build_db(d / "relay.db", "relay", 5), "relay", pki, "--no-trace",
                      "--config", str(d / "relay.yaml")) as relay:
            yield {"good": good, "relay": relay, "evil": evil, "recorder": recorder,
                   "token": token}


def _address(a: object) -> str:
    assert isinstance(a, Agent)
    return a.url.removeprefix("https://")


def _fleetd(pki: Pki, bed: dict[str, object], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FLEETD, *args, *pki.client_flags(), "--token-file", str(bed["token"]),
         "--timeout", "10"],
        capture_output=True, text=True, cwd=REPO, timeout=60)


def _nothing_reached(recorder: object) -> None:
    assert isinstance(recorder, RawListener)
    assert recorder.connections == 0 and recorder.received == b"", recorder.received[:300]


def _redirect_named(text: str, bed: dict[str, object]) -> None:
    recorder = bed["recorder"]
    assert isinstance(recorder, RawListener)
    assert f"node answered a redirect to http://{recorder.address}/api/v1/" in text, text
    assert "not followed" in text, text


def test_query_reports_the_redirect_and_sends_nothing_there(pki: Pki,
                                                           bed: dict[str, object]) -> None:
    nodes = f"gpu-01={_address(bed['good'])},evil={bed['evil']}"
    proc = _fleetd(pki, bed, "query", SECRET_SQL, "--nodes", nodes, "--format", "json")
    assert proc.returncode == 3, proc.stderr  # partial: the redirecting node failed
    obj = json.loads(proc.stdout)
    assert obj["rows"] == [["gpu-01", "the-body-must-stay-home"]], obj
    _redirect_named(json.dumps(obj["warnings"]) + proc.stderr, bed)
    _nothing_reached(bed["recorder"])


def test_explain_reports_the_redirect_and_sends_nothing_there(pki: Pki,
                                                             bed: dict[str, object]) -> None:
    proc = _fleetd(pki, bed, "explain", "--nodes", f"evil={bed['evil']}")
    assert proc.returncode == 4, (proc.stdout, proc.stderr)  # no node answered
    _redirect_named(proc.stdout + proc.stderr, bed)
    assert "Traceback" not in proc.stderr
    _nothing_reached(bed["recorder"])


def test_a_relay_reports_the_redirect_and_sends_nothing_there(pki: Pki,
                                                             bed: dict[str, object]) -> None:
    nodes = f"relay={_address(bed['relay'])},evil={bed['evil']}"
    proc = _fleetd(pki, bed, "query", SECRET_SQL, "--nodes", nodes, "--relay-via", "relay",
                   "--format", "json")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    obj = json.loads(proc.stdout)
    assert obj["rows"] == [["relay", "the-body-must-stay-home"]], obj
    text = json.dumps(obj["warnings"]) + proc.stderr
    assert "via relay relay" in text, text
    _redirect_named(text, bed)
    _nothing_reached(bed["recorder"])
    relay = bed["relay"]
    assert isinstance(relay, Agent) and "Traceback" not in relay.log.read_text()


def test_the_client_would_have_been_heard(bed: dict[str, object]) -> None:
    """The listener does record: a plain request reaches it (so 'nothing reached' above
    is a finding, not a deaf listener)."""
    recorder = bed["recorder"]
    assert isinstance(recorder, RawListener)
    host, port = recorder.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")
    assert b"GET /probe" in recorder.received
    recorder.connections, recorder.received = 0, b""

