"""Connections to the agent: accepted by fleetd itself, so that it can count and cap them.

Why not aiohttp's own site: a server made by ``loop.create_server`` only hears of a
connection once its TLS handshake is over, so a silent TCP connection held a file
descriptor for the whole 60 s handshake timeout, unseen and uncounted; 1,100 of them
exhausted the descriptors and locked every legitimate client out. Here the accept loop
sees each connection first and:

* refuses it at once beyond ``max_per_source`` from one address; at ``max_total`` open
  connections, admits it only by closing one of the address that holds the most (one
  still in its handshake, or idle between requests), when that address holds more than
  the newcomer's: a few addresses cannot fill the table and lock every other address
  out before the handshake (:meth:`Gate.admit`);
* gives the TLS handshake ``handshake_timeout_s`` and counts every handshake that fails
  or times out (``fleetd_tls_handshake_failures_total``);
* closes a connection whose request headers are not complete ``header_timeout_s``
  after its first byte (slowloris), see :class:`GuardedHandler`;
* cuts a connection whose client stops reading: once the transport's buffer is over
  its high-water mark, the client must take some of it within ``write_timeout_s``, or
  the connection is aborted (``fleetd_slow_readers_cut_total``). Large answers are
  written in pieces, each awaited, so what waits in a connection's buffers is one piece
  and the transport's high-water mark, and the answers held for clients that have not
  taken them are capped per client and in total (:class:`Outbox`).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

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


class _TlsKwargs(TypedDict, total=False):
    """How a TLS connection is accepted (asyncio's connect_accepted_socket)."""

    ssl: ssl.SSLContext
    ssl_handshake_timeout: float
    ssl_shutdown_timeout: float


@dataclass(frozen=True, slots=True)
class ConnLimits:
    max_total: int = 512
    max_per_source: int = 64
    handshake_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    write_timeout_s: float = 10.0  # a client must take some of a paused answer in this
    max_queued_bytes: int = 128 * 1024 * 1024  # answers held for their clients, in all


@dataclass(slots=True)
class ConnStats:
    open: int = 0
    refused: int = 0  # over a cap, closed unread
    evicted: int = 0  # closed at the total cap to admit an address holding fewer
    handshake_failures: int = 0  # refused or timed-out TLS handshakes
    slow_closed: int = 0  # headers or body not in time
    slow_readers_cut: int = 0  # answers not taken within the write deadline
    queued_bytes: int = 0  # answers held for their clients now (Outbox)
    queue_refusals: int = 0  # requests refused: their client's answers wait unread


@dataclass(eq=False, slots=True)
class Conn:
    """One admitted connection: its source, the task that accepts it (until its
    handshake is over), then its request handler."""

    source: str
    task: asyncio.Task[None] | None = None
    handler: GuardedHandler | None = None
    released: bool = False


class Outbox:
    """Bytes of answers made and not yet taken by their clients, reserved before a large
    answer is made and released once it has left (or its connection was cut). One
    client (certificate identity, else address) may hold half of ``total``, so that
    clients that do not read cannot hold the agent's memory, nor every other client's
    share of it."""

    def __init__(self, total: int, stats: ConnStats) -> None:
        self.total = total
        self.per_client = max(1, total // 2)
        self.stats = stats
        self._held: dict[str, int] = {}

    def reserve(self, client: str, size: int) -> str | None:
        """Hold ``size`` bytes for ``client``; or say why not (nothing held then)."""
        mine = self._held.get(client, 0)
        if mine and mine + size > self.per_client:
            why = (f"{mine} bytes of answers to {client} wait unread, and this one may take "
                   f"{size} more, over one client's {self.per_client}")
        elif self.stats.queued_bytes and self.stats.queued_bytes + size > self.total:
            why = (f"{self.stats.queued_bytes} bytes of answers wait for their clients, and "
                   f"this one may take {size} more, over the node's {self.total}")
        else:
            self.hold(client, size)
            return None
        self.stats.queue_refusals += 1
        return why

    def hold(self, client: str, size: int) -> None:
        """Count ``size`` more bytes for ``client``, cap or not."""
        self._held[client] = self._held.get(client, 0) + size
        self.stats.queued_bytes += size

    def release(self, client: str, size: int) -> None:
        left = self._held.get(client, 0) - size
        if left > 0:
            self._held[client] = left
        else:
            self._held.pop(client, None)
        self.stats.queued_bytes -= size


class Gate:
    """Caps, counts and accepts the agent's connections; see the module docstring."""

    def __init__(self, limits: ConnLimits, ssl_ctx: ssl.SSLContext | None) -> None:
        self.limits = limits
        self.ssl = ssl_ctx
        self.stats = ConnStats()
        self.outbox = Outbox(limits.max_queued_bytes, self.stats)
        # Per source, its connections oldest first (dicts keep insertion order).
        self._by_source: dict[str, dict[Conn, None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, source: str) -> Conn | None:
        """The new connection's record, or None when it is refused (counted)."""
        mine = len(self._by_source.get(source, ()))
        if mine >= self.limits.max_per_source or (
                self.stats.open >= self.limits.max_total and not self._evict_for(mine)):
            self.stats.refused += 1
            return None
        conn = Conn(source)
        self._by_source.setdefault(source, {})[conn] = None
        self.stats.open += 1
        return conn

    def _evict_for(self, holding: int) -> bool:
        """At the total cap: close one connection of the address holding the most, if it
        holds at least two more than the newcomer's address (so that evictions cannot
        go back and forth between equals), preferring its oldest that is still in its
        handshake or idle between requests. False when there is none to close."""
        if not self._by_source:
            return False
        biggest = max(self._by_source.values(), key=len)
        if len(biggest) < holding + 2:
            return False
        victim = next((c for c in biggest if c.handler is None or not c.handler.busy()),
                      None)
        if victim is None:
            return False
        self.stats.evicted += 1
        self.release(victim)
        if victim.task is not None:  # still in its handshake
            victim.task.cancel()
        elif victim.handler is not None:
            victim.handler.cut()
        return True

    def release(self, conn: Conn) -> None:
        if conn.released:
            return
        conn.released = True
        self.stats.open -= 1
        held = self._by_source.get(conn.source)
        if held is not None:
            held.pop(conn, None)
            if not held:
                del self._by_source[conn.source]

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
            record = self.admit(source)
            if record is None:
                _drop(conn)
                continue
            task = record.task = loop.create_task(self._open(conn, record, factory))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _open(self, conn: socket.socket, record: Conn,
                    factory: Callable[[], GuardedHandler]) -> None:
        loop = asyncio.get_running_loop()

        def make() -> GuardedHandler:
            handler = record.handler = factory()
            handler.gate_attach(self, record)
            return handler

        conn.setblocking(False)
        kwargs: _TlsKwargs = {}
        if self.ssl is not None:
            kwargs = {"ssl": self.ssl, "ssl_handshake_timeout": self.limits.handshake_timeout_s,
                      "ssl_shutdown_timeout": self.limits.handshake_timeout_s}
        try:
            await loop.connect_accepted_socket(make, conn, **kwargs)
        except asyncio.CancelledError:  # evicted, or the agent stops
            _drop(conn)
            self.release(record)
            raise
        except Exception as exc:  # a refused, broken or timed-out handshake
            self.stats.handshake_failures += 1
            log.debug("TLS handshake from %s failed: %s", record.source, exc)
            conn.close()  # a no-op when the transport closed it already
            if record.handler is not None:
                record.handler.gate_release()
            self.release(record)
        finally:
            record.task = None  # the handshake is over: the handler is the connection

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


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a header deadline, connection accounting, the
    peer's identity cached for the connection, and parser errors answered as JSON."""

    def gate_attach(self, gate: Gate, record: Conn) -> None:
        self.gate: Gate | None = gate
        self.record = record
        self.source = record.source
        self.peer: str | None = None  # who the client is, once asked (see api.py)
        self.refusal: str | None = None
        self._in_request = False
        self._deadline: asyncio.TimerHandle | None = None
        self._write_check: asyncio.TimerHandle | None = None
        self._write_backlog = 0

    def gate_release(self) -> None:
        if self.gate is not None:
            self.gate.release(self.record)
        self._disarm()
        self._disarm_write()

    def busy(self) -> bool:
        """In a request (its answer included): not to be closed to make room."""
        return getattr(self, "_in_request", False)

    def cut(self) -> None:
        """Close at once, unsent data dropped."""
        if self.transport is not None:
            self.transport.abort()
        self.force_close()

    def pause_writing(self) -> None:
        # The transport's buffer is over its high-water mark: the client must take
        # some of it within the write deadline.
        super().pause_writing()
        self._arm_write()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _arm_write(self) -> None:
        if getattr(self, "gate", None) is None or self.transport is None:
            return
        assert self.gate is not None
        self._disarm_write()
        self._write_backlog = self.transport.get_write_buffer_size()
        self._write_check = asyncio.get_running_loop().call_later(
            self.gate.limits.write_timeout_s, self._write_expired)

    def _disarm_write(self) -> None:
        _cancel(getattr(self, "_write_check", None))
        self._write_check = None

    def _write_expired(self) -> None:
        self._write_check = None
        if self.transport is None or not self.writing_paused:
            return
        if self.transport.get_write_buffer_size() < self._write_backlog:
            self._arm_write()  # a slow reader, but a reader: another period
            return
        if self.gate is not None:
            self.gate.stats.slow_readers_cut += 1
            log.info("cutting a connection from %s: it took nothing of its answer for "
                     "%g s", self.source, self.gate.limits.write_timeout_s)
        self.cut()

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
        _cancel(getattr(self, "_deadline", None))
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
