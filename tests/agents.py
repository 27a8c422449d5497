"""Real agents for tests: `fleetd agent` subprocesses on loopback with certificates
made by `fleetd certs`, and an mTLS client that talks to them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from fleetd.security import tls

from conftest import FLEETD

LISTEN_RE = re.compile(r"listening on (https?)://([\d.]+):(\d+)")


@dataclass
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def pair(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"


def make_pki(d: Path, nodes: list[str], clients: list[str]) -> Pki:
    def certs(*args: str) -> None:
        subprocess.run([FLEETD, "certs", "--dir", str(d), *args], check=True,
                       capture_output=True, text=True)

    certs("init-ca")
    for n in nodes:
        certs("issue-node", n, "--san", "127.0.0.1", "--san", "localhost")
    for c in clients:
        certs("issue-client", c)
    return Pki(d)


@dataclass
class Agent:
    proc: subprocess.Popen[str]
    url: str
    node: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@contextmanager
def agent(
    db: Path, node: str, pki: Pki | None, *extra: str, env: dict[str, str] | None = None
) -> Iterator[Agent]:
    """Start `fleetd agent` on an ephemeral loopback port; yield once it listens."""
    args = [FLEETD, "agent", "--db", str(db), "--node", node, "--listen", "127.0.0.1:0"]
    if pki is not None:
        cert, key = pki.pair(node)
        args += ["--tls-cert", str(cert), "--tls-key", str(key), "--client-ca", str(pki.ca)]
    log = db.parent / f"agent-{node}.log"
    fh = log.open("w")
    proc = subprocess.Popen([*args, *extra], stdout=fh, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    try:
        url = _wait_listening(proc, log)
        yield Agent(proc, url, node, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        fh.close()


def _wait_listening(proc: subprocess.Popen[str], log: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = LISTEN_RE.search(log.read_text())
        if m:
            return f"{m.group(1)}://{m.group(2)}:{m.group(3)}"
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited {proc.returncode}: {log.read_text()}")
        time.sleep(0.05)
    raise RuntimeError(f"agent did not start listening: {log.read_text()}")


def mem_mb(pid: int) -> dict[str, float]:
    """A process's resident memory now (VmRSS) and at its peak (VmHWM), MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def metric_value(text: str, name: str) -> float:
    """The value of series ``fleetd_<name>`` in a /metrics answer."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"fleetd_{name}":
                return float(sample.value)
    raise AssertionError(f"no series {name}")


def client_ssl(pki: Pki, client: str = "laptop") -> Any:
    cert, key = pki.pair(client)
    return tls.client_context(pki.ca, cert, key)


def request(
    url: str, ssl_ctx: Any, method: str = "GET", path: str = "/api/v1/health",
    json: Any = None, data: bytes | None = None, headers: dict[str, str] | None = None,
    timeout: float = 15,
) -> tuple[int, Any, bytes]:
    """One HTTPS request; returns (status, parsed JSON or None, raw body)."""
    async def go() -> tuple[int, Any, bytes]:
        limit = aiohttp.ClientTimeout(total=timeout)
        async with (
            aiohttp.ClientSession(timeout=limit) as s,
            s.request(method, url + path, ssl=ssl_ctx, json=json, data=data,
                      headers=headers) as r,
        ):
            body = await r.read()
            parsed = await r.json() if r.content_type == "application/json" else None
            return r.status, parsed, body
    return asyncio.run(go())


@contextmanager
def stand_in_node(pki: Pki, name: str, routes: list[web.RouteDef]) -> Iterator[str]:
    """A test server speaking (some of) the node API over TLS with node ``name``'s
    certificate, on its own loop in a thread: yields HOST:PORT."""
    cert, key = pki.pair(name)
    ctx = tls.server_context(cert, key, pki.ca)
    ready: list[str] = []
    loop = asyncio.new_event_loop()

    async def start() -> web.AppRunner:
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        ready.append(f"127.0.0.1:{runner.addresses[0][1]}")
        return runner

    runner = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
