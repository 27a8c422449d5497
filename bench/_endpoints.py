"""A TEST DOUBLE of a thousand agents, for measuring the fleet client's cost alone.

One process holds every endpoint: one mTLS (TLS 1.3) listening socket per "node" on
loopback, all answering ``POST /api/v1/query`` and ``GET /api/v1/time`` the way an agent
does (same JSON shape, same ``X-Fleetd-Recv-Ns`` / ``X-Fleetd-Send-Ns`` clock stamps,
through ``fleetd.node.stamps``), from canned rows: no database, no SQL. It is not an
agent and is never used as one; bench/fanout.py uses it to put 1,000 endpoints in front
of the client on a 2-core machine, where 1,000 real agents would not fit.

Three kinds of endpoint:

* good: answers at once (the canned rows, tagged with its node name);
* dead: a port bound but not listening, so connecting is refused;
* hung: completes TCP and TLS and reads the request, then never answers.

    python bench/_endpoints.py --cert N.pem --key N.key --ca ca.pem --good 990 --dead 50 --hung 10

prints one JSON line ``{"good": [ports], "dead": [ports], "hung": [ports]}`` once every
socket listens, and runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import sys
import time
from pathlib import Path

import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.node import stamps  # noqa: E402
from fleetd.security import tls  # noqa: E402

PORT_OF = web.AppKey("port_of", dict)
COLUMNS = ["op", "n", "mean_ns"]
ROWS = [["cudaLaunchKernel", 500, 7450.0], ["cudaMemcpyAsync", 500, 7550.0],
        ["cudaStreamSynchronize", 500, 7350.0], ["off_cpu", 500, 7650.0]]


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _name(request: web.Request) -> tuple[str, bool]:
    # A connection the client already closed has no address left: its answer is moot.
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    port = sockname[1] if sockname else 0
    kind, index = request.app[PORT_OF].get(port, ("good", -1))
    return f"ep{index:04d}", kind == "hung"


async def query(request: web.Request) -> web.StreamResponse:
    name, hung = _name(request)
    await request.read()
    if hung:
        await asyncio.Event().wait()  # accepted, read, never answered
    body = {"node": name, "columns": COLUMNS, "rows": ROWS, "truncated": False,
            "truncated_reason": None, "elapsed_ms": 0.05}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def clock(request: web.Request) -> web.StreamResponse:
    name, hung = _name(request)
    if hung:
        await asyncio.Event().wait()
    t1 = time.time_ns()
    body = {"node": name, "t1_ns": t1, "t2_ns": time.time_ns()}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


_HELD: list[socket.socket] = []


def _dead_ports(n: int) -> list[int]:
    """Ports nobody listens on: bound and kept (so no other process can take one, as a
    closed port could be) but never listening, so a connection is refused."""
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        _HELD.append(s)
    return [s.getsockname()[1] for s in _HELD[-n:]] if n else []


async def serve(a: argparse.Namespace) -> None:
    ctx = tls.server_context(a.cert, a.key, a.ca)
    app = web.Application()
    app.add_routes([web.post("/api/v1/query", query), web.get("/api/v1/time", clock)])
    stamps.install(app)
    port_of: dict[int, tuple[str, int]] = {}
    app[PORT_OF] = port_of
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    got: dict[str, list[int]] = {"good": [], "dead": _dead_ports(a.dead), "hung": []}
    index = 0
    for kind, count in (("good", a.good), ("hung", a.hung)):
        for _ in range(count):
            sock = _listening()
            await web.SockSite(runner, sock, ssl_context=ctx, backlog=256).start()
            port = sock.getsockname()[1]
            port_of[port] = (kind, index)
            got[kind].append(port)
            index += 1
    sys.stdout.write(orjson.dumps(got).decode() + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def _listening() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(256)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cert", type=Path, required=True)
    p.add_argument("--key", type=Path, required=True)
    p.add_argument("--ca", type=Path, required=True)
    p.add_argument("--good", type=int, default=990)
    p.add_argument("--dead", type=int, default=50)
    p.add_argument("--hung", type=int, default=10)
    a = p.parse_args()
    _raise_fd_limit()
    import uvloop
    uvloop.run(serve(a))


if __name__ == "__main__":
    main()
