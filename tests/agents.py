"""Real agents for tests: `fleetd agent` subprocesses on loopback with certificates
from the fleet CA (made by the code behind `fleetd certs`; the session's one CA is
conftest's ``pki`` fixture), an mTLS client that talks to them, and stand-in nodes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509

from fleetd.security import certs, tls

from conftest import FLEETD, build_db

LISTEN_RE = re.compile(r"listening on (https?)://([\d.]+):(\d+)")


@dataclass
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def pair(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"

    def client_flags(self, client: str = "laptop") -> list[str]:
        """The fleet commands' TLS flags for ``client``."""
        cert, key = self.pair(client)
        return ["--ca-cert", str(self.ca), "--client-cert", str(cert), "--client-key", str(key)]

    def copy_to(self, d: Path) -> Pki:
        """The same CA and certificates in ``d``: for a module that adds certificates of
        its own without writing them into the session's directory."""
        shutil.copytree(self.dir, d)
        return Pki(d)


def make_pki(d: Path, nodes: Iterable[str], clients: Iterable[str]) -> Pki:
    """A new CA in ``d`` with node certificates (SANs 127.0.0.1 and localhost) and
    client certificates; in-process (`fleetd certs` runs these same calls, and
    tests/unit/test_certs.py runs the command)."""
    certs.init_ca(d)
    for n in nodes:
        certs.issue_node(d, n, ["127.0.0.1", "localhost"])
    for c in clients:
        certs.issue_client(d, c)
    return Pki(d)


def issue_odd(pki: Pki, name: str, subject: x509.Name,
              usages: Sequence[x509.ObjectIdentifier] = ()) -> None:
    """A certificate from ``pki``'s CA, valid for a day, with a subject and EKU that
    `fleetd certs` never issues (a test of how the agent takes it)."""
    ca_cert, ca_key = certs.load_ca(pki.dir)
    key = certs.generate_key()
    now = datetime.now(UTC)
    cert = certs.build_certificate(
        subject=subject, public_key=key.public_key(), issuer=ca_cert.subject,
        issuer_key=ca_key, issuer_public=ca_key.public_key(),
        window=(now - timedelta(minutes=1), now + timedelta(days=1)), is_ca=False,
        usages=usages)
    certs.write_pair(*pki.pair(name), cert, key, force=True)


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


@contextmanager
def serving(d: Path, node: str, pki: Pki | None, n: int, *extra: str) -> Iterator[Agent]:
    """An agent, not tracing, serving conftest's synthetic database of ``n`` events for
    ``node``, made in ``d``."""
    with agent(build_db(d / f"{node}.db", node, n), node, pki, "--no-trace", *extra) as a:
        yield a


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


@dataclass
class AnsweringNode:
    """A stand-in node's address, and what it answers: ``answers[PATH]`` for a GET of
    PATH, read at each request so that a test may change it between asks."""

    address: str
    answers: dict[str, Any]


@contextmanager
def answering_node(pki: Pki, name: str) -> Iterator[AnsweringNode]:
    """A stand-in node ``name`` (see :func:`stand_in_node`) whose /api/v1/health and
    /api/v1/time answer as an agent's would, and every other GET PATH with
    ``answers[PATH]`` (``{}`` until the test sets it): a node that lies on purpose."""
    node = AnsweringNode("", {})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node": name, "version": "0",
                                  "schema_version": 2})

    async def clock(_: web.Request) -> web.Response:
        now = time.time_ns()
        return web.json_response({"node": name, "t1_ns": now, "t2_ns": now})

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(node.answers.get(request.path, {}))

    with stand_in_node(pki, name, [web.get("/api/v1/health", health),
                                   web.get("/api/v1/time", clock),
                                   web.get("/{tail:.*}", answer)]) as address:
        node.address = address
        yield node


class RawListener:
    """A plain TCP listener on loopback, served on a thread: counts connections and
    keeps every byte they send. With ``greeting`` it sends that at once and hangs up
    (something that is not a node, an SSH server say); else it reads one request's
    headers and answers ``answer`` (a web server that is not a node)."""

    def __init__(self, greeting: bytes = b"", answer: bytes = b"") -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.greeting, self.answer = greeting, answer
        self.connections = 0
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                if self.greeting:
                    conn.sendall(self.greeting)
                else:
                    self._answer(conn)
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        while piece := conn.recv(65536):
            self.received += piece
            if b"\r\n\r\n" in self.received:
                conn.sendall(self.answer)
                return

    def close(self) -> None:
        self.sock.close()
