"""Connections to the agent: accepted by fleetd itself, so that it can count and cap them.

Why not aiohttp's own site: a server made by ``loop.create_server`` only hears of a
connection once its TLS handshake is over, so a silent TCP connection held a file
descriptor for the whole 60 s handshake timeout, unseen and uncounted; 1,100 of them
exhausted the descriptors and locked every legitimate client out. Here the accept loop
sees each connection first and:

* refuses it at once beyond ``max_total`` open connections, or beyond
  ``max_per_source`` from one address, so one source cannot take every descriptor;
* gives the TLS handshake ``handshake_timeout_s`` and counts every handshake that fails
  or times out (``fleetd_tls_handshake_failures_total``);
* closes a connection whose request headers are not complete ``header_timeout_s``
  after its first byte (slowloris), see :class:`GuardedHandler`.

The per-connection request handler is aiohttp's, subclassed so that even errors of the
HTTP parser itself leave as JSON (docs/api.md) and without a traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger("fleetd.node.conns")

ACCEPT_PAUSE_S = 0.05  # after EMFILE: let connections close before accepting again
# A refused request's connection is cut this long after its answer: time for the
# answer to leave, but not for TLS's orderly shutdown, which keeps reading (and
# discarding) whatever the peer still sends, 100 MB of refused body included.
ABORT_AFTER_S = 0.3


@dataclass(frozen=True, slots=True)
class ConnLimits:
    max_total: int = 512
    max_per_source: int = 64
    handshake_timeout_s: float = 5.0
    header_timeout_s: float = 10.0


@dataclass(slots=True)
class ConnStats:
    open: int = 0
    refused: int = 0  # over a cap, closed unread
    handshake_failures: int = 0  # refused or timed-out TLS handshakes
    slow_closed: int = 0  # headers or body not in time


class Gate:
    """Caps, counts and accepts the agent's connections; see the module docstring."""

    def __init__(self, limits: ConnLimits, ssl_ctx: ssl.SSLContext | None) -> None:
        self.limits = limits
        self.ssl = ssl_ctx
        self.stats = ConnStats()
        self._by_source: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, source: str) -> bool:
        if (self.stats.open >= self.limits.max_total
                or self._by_source[source] >= self.limits.max_per_source):
            self.stats.refused += 1
            return False
        self.stats.open += 1
        self._by_source[source] += 1
        return True

    def release(self, source: str) -> None:
        self.stats.open -= 1
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]

    async def accept_forever(self, lsock: socket.socket,
                             factory: Callable[[], GuardedHandler]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a connection (%s); the descriptor limit is "
                                "below the connection cap", exc.strerror)
                    await asyncio.sleep(ACCEPT_PAUSE_S)
                    continue
                raise
            source = str(addr[0]) if isinstance(addr, tuple) else "local"
            if not self.admit(source):
                _drop(conn)
                continue
            task = loop.create_task(self._open(conn, source, factory))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _open(self, conn: socket.socket, source: str,
                    factory: Callable[[], GuardedHandler]) -> None:
        loop = asyncio.get_running_loop()
        made: list[GuardedHandler] = []

        def make() -> GuardedHandler:
            handler = factory()
            handler.gate_attach(self, source)
            made.append(handler)
            return handler

        conn.setblocking(False)
        kwargs: dict[str, Any] = {}
        if self.ssl is not None:
            kwargs = {"ssl": self.ssl, "ssl_handshake_timeout": self.limits.handshake_timeout_s,
                      "ssl_shutdown_timeout": self.limits.handshake_timeout_s}
        try:
            await loop.connect_accepted_socket(make, conn, **kwargs)
        except asyncio.CancelledError:
            conn.close()
            raise
        except Exception as exc:  # a refused, broken or timed-out handshake
            self.stats.handshake_failures += 1
            log.debug("TLS handshake from %s failed: %s", source, exc)
            conn.close()  # a no-op when the transport closed it already
            if made:
                made[0].gate_release()
            else:
                self.release(source)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _drop(conn: socket.socket) -> None:
    # Linger 0: the descriptor and the kernel's socket go at once (a RST), rather than
    # lingering in FIN_WAIT for a peer that is flooding anyway.
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a header deadline, connection accounting, the
    peer's identity cached for the connection, and parser errors answered as JSON."""

    def gate_attach(self, gate: Gate, source: str) -> None:
        self.gate: Gate | None = gate
        self.source = source
        self.peer: str | None = None  # who the client is, once asked (see api.py)
        self.refusal: str | None = None
        self._in_request = False
        self._deadline: asyncio.TimerHandle | None = None
        self._released = False

    def gate_release(self) -> None:
        if not self._released and self.gate is not None:
            self._released = True
            self.gate.release(self.source)
        self._disarm()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # the client must send its first request in time, too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gate_release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._deadline is None:
            self._arm()  # the first bytes of a request: its headers are now on the clock
        super().data_received(data)

    def request_started(self) -> None:
        self._in_request = True
        self._disarm()

    def request_done(self) -> None:
        self._in_request = False

    def close_slow(self, what: str) -> None:
        if self.gate is not None:
            self.gate.stats.slow_closed += 1
        log.info("closing a connection from %s: %s", getattr(self, "source", "?"), what)
        if self.transport is not None:
            self.transport.close()
        self.force_close()

    def abort_soon(self) -> None:
        """Cut the connection shortly after the answer now being sent."""
        transport = self.transport
        if transport is not None:
            asyncio.get_running_loop().call_later(ABORT_AFTER_S, transport.abort)

    def _arm(self) -> None:
        if self.gate is None:
            return
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(
            self.gate.limits.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            assert self._deadline is not None
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self._in_request:
            self.close_slow("request headers not complete in time")

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # The parser refused the request before any handler saw it: one log line, and
        # the JSON error docs/api.md promises instead of aiohttp's text/plain page.
        if request.writer.output_size > 0:
            raise ConnectionError("the answer was already begun; cannot send an error")
        code = "bad_request" if status < 500 else "internal"
        if status == 413:
            code = "too_large"
        text = message or (str(exc) if exc is not None else "bad request")
        log.info("refused a malformed request from %s: %s", getattr(self, "source", "?"),
                 text.splitlines()[0][:200] if text else status)
        body = {"error": {"code": code, "message": f"malformed HTTP request: {text[:300]}",
                          "hint": "send a well-formed HTTP/1.1 request"}}
        resp = web.Response(body=orjson.dumps(body), status=status,
                            content_type="application/json")
        resp.force_close()
        return resp
