"""Serving the MCP server over Streamable HTTP, under the agent's TLS rules.

Nothing here is optional: TLS 1.3 with the SSLContext from :mod:`fleetd.security.tls`
(never one of our own), the agent's listening policy (beyond loopback, client
certificates are mandatory), and on top of that a client certificate or a bearer token
(or both) must be configured, because an MCP endpoint answers questions about the
machine's processes. The token is compared in constant time before a request reaches
the MCP app; a client certificate is verified during the handshake.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from fleetd.errors import ConfigError
from fleetd.security import tls

log = logging.getLogger("fleetd.mcp.https")

MCP_PATH = "/mcp"
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HttpSettings:
    host: str
    port: int
    cert: Path
    key: Path
    client_ca: Path | None = None
    token: str | None = None


def check_settings(s: HttpSettings) -> None:
    """Refuse what the agent would refuse, and an endpoint anyone could call."""
    tls.check_listen_policy(s.host, have_cert=True, have_client_ca=s.client_ca is not None,
                            plain_http=False)
    if s.client_ca is None and s.token is None:
        raise ConfigError(
            "the MCP HTTP endpoint needs client authentication",
            "pass --client-ca (clients present certificates from that CA) and/or "
            "--http-token-file (clients send Authorization: Bearer <token>)")


class BearerGate:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>``."""

    def __init__(self, app: App, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not tls.token_ok(_bearer(scope), self.token):
            await _deny(send)
            return
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"authorization":
            text = bytes(value).decode("latin-1")
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _deny(send: Send) -> None:
    body = orjson.dumps({"error": {"code": "unauthorized",
                                   "message": "missing or wrong bearer token"}})
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(server: MCPServer, s: HttpSettings) -> App:
    loopback = tls.is_loopback(s.host)
    # DNS-rebinding protection checks Host/Origin; on loopback the names are known. Beyond
    # loopback mTLS is mandatory: a page rebound to this host would need a client
    # certificate from the fleet CA, and clients reach the server by names we cannot list.
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=loopback,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"] if loopback else [],
        allowed_origins=(["https://127.0.0.1:*", "https://localhost:*", "https://[::1]:*"]
                         if loopback else []))
    app: App = server.streamable_http_app(streamable_http_path=MCP_PATH,
                                          transport_security=security, host=s.host)
    return BearerGate(app, s.token) if s.token else app


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}",
                          "pick a free port, or port 0 for any") from None
    sock.listen(128)
    return sock


def serve(server: MCPServer, s: HttpSettings) -> None:
    """Serve until interrupted; prints the URL (with the real port) on stderr."""
    import uvicorn

    check_settings(s)
    context = tls.server_context(s.cert, s.key, s.client_ca)
    sock = bind(s.host, s.port)
    port = sock.getsockname()[1]

    def use_ours(_config: uvicorn.Config, _default: Callable[[], ssl.SSLContext]
                 ) -> ssl.SSLContext:
        return context

    config = uvicorn.Config(build_app(server, s), ssl_context_factory=use_ours,
                            log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2)
    shown = f"[{s.host}]" if ":" in s.host else s.host
    auth = " + ".join(x for x in ("client certificate" if s.client_ca else "",
                                  "bearer token" if s.token else "") if x)
    print(f"fleetd mcp: listening on https://{shown}:{port}{MCP_PATH} (TLS 1.3, {auth})",
          file=sys.stderr, flush=True)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
