"""Clock stamps on every answer, and a count of resumed TLS handshakes.

Every API answer carries two headers, wall-clock nanoseconds of this node
(``time.time_ns()``):

* ``X-Fleetd-Recv-Ns``: when the request reached the application (the first middleware,
  right after its headers were parsed): NTP's t1.
* ``X-Fleetd-Send-Ns``: when the answer's headers are about to be written (the
  ``on_response_prepare`` signal, after the body of a plain answer is built; for a
  streamed answer, before its first piece): NTP's t2.

So the exchange a client makes anyway (its query) is also a clock sample, and the fleet
client needs no separate ``/api/v1/time`` requests (docs/api.md, "Clock headers").

Each TLS connection's first request also counts the connection's handshake, full or
resumed (``SSLObject.session_reused``): ``fleetd_tls_handshakes`` and
``fleetd_tls_resumed_handshakes`` in ``/metrics`` say whether clients resume.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from fleetd.wire.headers import RECV_NS, SEND_NS

_RECV = "fleetd.recv_ns"  # request key
_COUNTED = "_fleetd_handshake_counted"  # attribute set on a connection's SSLObject

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Handshakes:
    total: int = 0  # TLS connections that made a request
    resumed: int = 0  # of which resumed a session (no certificate exchange)


HANDSHAKES = web.AppKey("tls_handshakes", Handshakes)


def install(app: web.Application) -> None:
    """Stamp every answer of ``app``: call before the app is frozen."""
    app[HANDSHAKES] = Handshakes()
    app.middlewares.insert(0, _recv_middleware)
    app.on_response_prepare.append(_stamp_send)


@web.middleware
async def _recv_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[_RECV] = time.time_ns()
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is not None and not getattr(ssl_object, _COUNTED, False):
        setattr(ssl_object, _COUNTED, True)
        counts = request.app[HANDSHAKES]
        counts.total += 1
        counts.resumed += bool(ssl_object.session_reused)
    return await handler(request)


async def _stamp_send(request: web.Request, response: web.StreamResponse) -> None:
    recv = request.get(_RECV)
    if recv is None:  # answered before the middleware ran (e.g. by aiohttp itself)
        return
    response.headers[RECV_NS] = str(recv)
    response.headers[SEND_NS] = str(time.time_ns())
