"""One handshake per node per command, then none: `fleetd query` twice against real
agents on loopback. The agents count, per TLS connection, whether its handshake resumed a
session (``fleetd_tls_handshakes`` / ``fleetd_tls_resumed_handshakes`` in /metrics), so
both claims are checked from the server side. Every answer carries the clock stamps the
client's skew estimate is made from, errors included.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agents import Agent, Pki, agent, client_ssl, request

from conftest import FLEETD, REPO, build_db

NODES = ["rs-01", "rs-02"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory,
        pki: Pki) -> Iterator[tuple[Pki, list[Agent], Path]]:
    tmp = tmp_path_factory.mktemp("resume")
    with ExitStack() as stack:
        agents = [stack.enter_context(agent(build_db(tmp / f"{n}.db", node=n, n=50), n, pki,
                                            "--no-trace")) for n in NODES]
        yield pki, agents, tmp / "cache"


def _query(pki: Pki, agents: list[Agent], cache: Path) -> dict[str, Any]:
    cert, key = pki.pair("laptop")
    nodes = ",".join(a.url.removeprefix("https://") for a in agents)
    proc = subprocess.run(
        [FLEETD, "query", "--nodes", nodes, "--ca-cert", str(pki.ca), "--client-cert",
         str(cert), "--client-key", str(key), "--format", "json",
         "SELECT count(*) AS n FROM events"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
        env={**os.environ, "FLEETD_TLS_SESSION_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    obj: dict[str, Any] = json.loads(proc.stdout)
    return obj


def _handshakes(pki: Pki, a: Agent) -> tuple[float, float]:
    """(handshakes, resumed) so far; the scrape's own connection is one full handshake."""
    status, _, body = request(a.url, client_ssl(pki), path="/metrics")
    assert status == 200
    values = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        if name in ("fleetd_tls_handshakes_total", "fleetd_tls_resumed_handshakes_total"):
            values[name] = float(value)
    return values["fleetd_tls_handshakes_total"], values["fleetd_tls_resumed_handshakes_total"]


def test_a_second_command_resumes_with_one_connection_per_node(
        bed: tuple[Pki, list[Agent], Path]) -> None:
    pki, agents, cache = bed
    before = [_handshakes(pki, a) for a in agents]
    first = _query(pki, agents, cache)
    after_first = [_handshakes(pki, a) for a in agents]
    second = _query(pki, agents, cache)
    after_second = [_handshakes(pki, a) for a in agents]
    for b, f, s in zip(before, after_first, after_second, strict=True):
        # Each command: one connection per node (the +1 is the scrape's own).
        assert f[0] - b[0] == 2 and s[0] - f[0] == 2, (b, f, s)
        assert f[1] - b[1] == 0, "the first command had no ticket to resume with"
        assert s[1] - f[1] == 1, "the second command did not resume its session"
    for obj in (first, second):
        assert sorted(r[0] for r in obj["rows"]) == NODES
        # The clock offset comes from the answers' own stamps: known, and small here.
        for n in NODES:
            assert abs(obj["skew"][n]["offset_ms"]) <= obj["skew"][n]["error_ms"] + 5, obj


def test_every_answer_carries_clock_stamps(bed: tuple[Pki, list[Agent], Path]) -> None:
    pki, agents, _ = bed

    async def go() -> list[tuple[int, str | None, str | None]]:
        out = []
        async with aiohttp.ClientSession() as s:
            for path in ("/api/v1/health", "/api/v1/no-such-endpoint"):
                async with s.get(agents[0].url + path, ssl=client_ssl(pki)) as r:
                    out.append((r.status, r.headers.get("X-Fleetd-Recv-Ns"),
                                r.headers.get("X-Fleetd-Send-Ns")))
        return out

    for status, recv, send in asyncio.run(go()):
        assert recv is not None and send is not None, status
        assert 0 < int(recv) <= int(send)
