"""Issue 21, client side: the real fleet client (`fleetd query --nodes`) against hostile
fake nodes (aiohttp test servers speaking the node API over TLS with a node certificate
from `fleetd certs`) next to a real agent, whose rows must survive every attack."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
from agents import Agent, Pki, serving, stand_in_node
from aiohttp import web

from conftest import FLEETD, REPO

Handler = Callable[[web.Request], object]
EVIL_NAME = "\x1b]0;pwned\x07evil\nnode-1: forged line\x1b[2J"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    with serving(tmp_path_factory.mktemp("good"), "gpu-01", pki, 50) as a:
        yield a


def _clock(t1: object) -> Handler:
    async def clock(request: web.Request) -> web.Response:
        return web.json_response({"node": EVIL_NAME, "t1_ns": t1, "t2_ns": time.time_ns()})
    return clock


def hostile_node(pki: Pki, query: Handler, t1: object = None) -> AbstractContextManager[str]:
    """A test server speaking the node API over TLS: yields HOST:PORT."""
    return stand_in_node(pki, "hostile", [
        web.get("/api/v1/time", _clock(t1 if t1 is not None else time.time_ns())),
        web.post("/api/v1/query", query)])  # type: ignore[arg-type]


_PEAK_OF_CHILD = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "sys.stderr.write('\\nPEAK_KB=%d' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n")


def ask(pki: Pki, good: Agent, evil: str, *args: str,
        timeout_s: str = "10") -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run the real client; (its result, seconds, peak MB of the client)."""
    nodes = f"{good.url.removeprefix('https://')},{evil}"
    t0 = time.monotonic()
    # This process's RUSAGE_CHILDREN covers every child it ever waited for (agents,
    # browsers of earlier tests): a one-line wrapper reports the client's own peak.
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_CHILD, FLEETD, "query",
         "SELECT node, op FROM events LIMIT 5", "--nodes", nodes,
         *pki.client_flags(), "--timeout", timeout_s, *args],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    took = time.monotonic() - t0
    err, _, peak_kb = proc.stderr.rpartition("\nPEAK_KB=")
    proc.stderr = err
    return proc, took, int(peak_kb) / 1024


def _good_rows_kept(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 3, proc.stderr  # partial: the hostile node is a warning
    obj = json.loads(proc.stdout)
    assert [r[0] for r in obj["rows"]] == ["gpu-01"] * 5
    return obj


async def _chunked_forever(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await resp.write(b'{"node":"x","columns":["a"],"rows":[')
    piece = b'["' + b"A" * 65000 + b'"],'
    for _ in range(32_000):  # 2 GB if the client kept reading
        await resp.write(piece)
    return resp


def test_a_chunked_answer_without_end_is_cut_at_the_byte_cap(pki: Pki, good: Agent) -> None:
    with hostile_node(pki, _chunked_forever) as evil:
        proc, took, peak = ask(pki, good, evil, "--format", "json")
    obj = _good_rows_kept(proc)
    assert any("byte limit" in json.dumps(w) for w in obj["warnings"]), obj["warnings"]
    assert took < 15 and peak < 400, (took, peak)


async def _many_rows(request: web.Request) -> web.Response:
    rows = b",".join([b"[1]"] * 2_000_000)
    return web.Response(body=b'{"node":"x","columns":["n"],"rows":[' + rows + b"]}",
                        content_type="application/json")


def test_limit_is_applied_to_each_nodes_rows(pki: Pki, good: Agent) -> None:
    with hostile_node(pki, _many_rows) as evil:
        proc, took, peak = ask(pki, good, evil, "--format", "json", "--limit", "100")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert len(obj["rows"]) <= 200 and obj["truncated"] is True
    assert took < 15 and peak < 800, (took, peak)


async def _rows_with_escapes(request: web.Request) -> web.Response:
    return web.json_response({"node": EVIL_NAME, "columns": ["\x1b[2Jcol", "op"],
                              "rows": [["a", "b"]]})


def test_node_strings_reach_the_terminal_sanitized(pki: Pki, good: Agent) -> None:
    with hostile_node(pki, _rows_with_escapes) as evil:
        proc, _, _ = ask(pki, good, evil)
    out = proc.stdout + proc.stderr
    assert "\x1b" not in out and "\x07" not in out
    assert not any(line.startswith("node-1:") for line in out.splitlines())


async def _bad_value(request: web.Request) -> web.Response:
    return web.Response(body=b'{"node":"x","columns":["n"],"rows":[[1e999999],[2]]}',
                        content_type="application/json")


async def _fine(request: web.Request) -> web.Response:
    return web.json_response({"node": "fake", "columns": ["node", "op"],
                              "rows": [["fake", 1]]})


def test_a_clock_of_1e300_is_a_warning_and_json_output_survives(pki: Pki,
                                                                good: Agent) -> None:
    with hostile_node(pki, _fine, t1=1e300) as evil:
        proc, _, _ = ask(pki, good, evil, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert {r[0] for r in obj["rows"]} >= {"gpu-01"}
    assert any(w["kind"] == "skew" for w in obj["warnings"]), obj["warnings"]


def test_values_json_cannot_carry_fail_only_their_node(pki: Pki, good: Agent) -> None:
    with hostile_node(pki, _bad_value) as evil:
        proc, _, _ = ask(pki, good, evil, "--format", "json")
    # orjson refuses 1e999999 (not finite): a bad_json warning, gpu-01's rows kept.
    obj = _good_rows_kept(proc)
    assert obj["warnings"]


_ND_HEAD = b'{"node":"x","columns":["n"],"limits":{"max_rows":10000}}\n'


def _ndjson(*pieces: bytes, forever: bytes = b"") -> Handler:
    """A node streaming NDJSON (docs/api.md) that breaks it in one way."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
        for _ in range(32_000 if forever else 0):  # 2 GB if the client kept reading
            await resp.write(forever)
        await resp.write_eof()
        return resp
    return handler


@pytest.mark.parametrize(("handler", "said"), [
    (_ndjson(_ND_HEAD, b"[1]\n[2]\n"), "without its trailer"),
    (_ndjson(_ND_HEAD, b"[1]\n[2,\x1b[2J\n"), "not JSON"),
    (_ndjson(_ND_HEAD, b"[1]\n", b'{"end":true,"rows":1}\n', b"[3]\n"), "after the trailer"),
    (_ndjson(_ND_HEAD, b'["' + b"A" * 100, forever=b"A" * 65000), "byte limit"),
], ids=["cut", "garbled", "after-end", "endless-line"])
def test_a_broken_ndjson_stream_fails_only_its_node(pki: Pki, good: Agent, handler: Handler,
                                                    said: str) -> None:
    with hostile_node(pki, handler) as evil:
        proc, took, peak = ask(pki, good, evil, "--format", "json")
    obj = _good_rows_kept(proc)
    assert any(said in w["error"] for w in obj["warnings"]), obj["warnings"]
    assert "\x1b" not in proc.stdout + proc.stderr
    assert took < 15 and peak < 400, (took, peak)


def test_certs_issues_node_and_client_kinds_distinctly(pki: Pki) -> None:
    # The fleet CA issues the two kinds distinctly: the role is in the subject.
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    from fleetd.security.certs import ROLE_CLIENT, ROLE_NODE, peer_role

    def role(name: str) -> str | None:
        cert = x509.load_pem_x509_certificate(pki.pair(name)[0].read_bytes())
        return peer_role(cert.public_bytes(Encoding.DER)).role

    assert role("n1") == ROLE_NODE and role("laptop") == ROLE_CLIENT
