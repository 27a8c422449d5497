"""The node API's core: the application, its rules, and the routes that need no analyzer.

:func:`make_app` builds the aiohttp application with its three middlewares (who asks:
certificate role and relay rights, :func:`peer_middleware`; the bearer token,
:func:`token_middleware`; every failure as a JSON error with its status, never a
traceback, :func:`errors_middleware`) and serves ``health``, ``time``, ``query`` (the
guarded SQL of :class:`~fleetd.store.guard.SafeDB`, as JSON or streamed NDJSON) and
``events``. Every other route is handed in as ``extra_routes`` by
:func:`fleetd.node.agent.build_app` (``/metrics``, one route per question from
:mod:`fleetd.node.analysis`, ``ranks``, ``detail``) and by the CLI (``relay``), so this
module imports neither the analyzers nor the registry.

It also holds what those routes share: :class:`NodeState` (the node's counters), the
JSON encoding and error answers, and the room an answer takes in its connection's
outbox (:class:`AnswerRoom`, :func:`held_answer`, :func:`send_paced`: held before the
answer is made, sent a piece at a time). Every database touch runs on a thread of the
:class:`~fleetd.node.readers.ReaderPool`, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from fleetd import __version__
from fleetd.errors import FleetdError, QueryError
from fleetd.node import stamps
from fleetd.node.conns import GuardedHandler, Outbox
from fleetd.node.readers import ReaderPool
from fleetd.security.certs import peer_role
from fleetd.security.tls import client_refusal, token_ok
from fleetd.store.guard import STREAM_CHUNK_BYTES, Limits, Params, QueryResult, SafeDB
from fleetd.store.health import NodeStatus
from fleetd.store.schema import SCHEMA_VERSION
from fleetd.wire import paths
from fleetd.wire.limits import INT64_MAX, INT64_MIN
from fleetd.wire.shapes import (
    ErrorDetail,
    HealthReply,
    QueryReply,
    StreamHeader,
    StreamTrailer,
    TimeReply,
)

log = logging.getLogger("fleetd.node.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS = {
    "bad_request": 400, "bad_query": 400, "forbidden": 403, "unauthorized": 401,
    "not_found": 404, "method_not_allowed": 405, "timeout": 408, "too_large": 413,
    "busy": 429, "unavailable": 503, "internal": 500,
}
EVENT_COLUMNS = (
    "id, node, ts_ns, dur_ns, pid, tid, comm, thread, source, op, ret, bytes, peer, "
    "peer_comm, a0, a1, stack, args, rank, rowkey"
)
EVENTS_PAGE = 2_000
# A large answer is handed to its connection this much at a time, each piece once the
# last has left (docs/security.md "Connections and memory").
ANSWER_PIECE = 256 * 1024
_CLOSE = "fleetd.close"  # request key: answer, then close the connection
CLIENT = "fleetd.client"  # request key: who asks, for the per-client reader share
QUERY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class NodeState:
    """What the handlers need to know about the running node."""

    node: str
    started: float = field(default_factory=time.time)
    tracing: bool = False
    token: str | None = None
    queries: int = 0
    query_errors: int = 0
    query_seconds: float = 0.0
    query_hist: list[int] = field(default_factory=lambda: [0] * len(QUERY_BUCKETS_S))
    status: Callable[[], NodeStatus] = NodeStatus  # nothing more while it does not trace
    relay_nodes: frozenset[str] = frozenset()  # node certificates allowed to query
    client_refusals: int = 0  # certificates refused as clients (node, no role, no EKU)
    body_timeout_s: float = 30.0  # a request body must arrive within this
    max_body_bytes: int = 64 * 1024


READERS = web.AppKey("readers", ReaderPool)
STATE = web.AppKey("state", NodeState)


def encode(obj: Any) -> bytes:
    """An answer's JSON body (blobs as hex)."""
    return orjson.dumps(obj, default=_plain)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(obj), status=status, content_type="application/json")


def error_response(code: str, message: str, hint: str | None = None) -> web.Response:
    err: ErrorDetail = {"code": code, "message": message}
    if hint:
        err["hint"] = hint
    return json_response({"error": err}, _STATUS.get(code, 400))


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(f"cannot encode {type(value).__name__}")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as a JSON error with a fitting status; nothing leaks a traceback."""
    resp = await _answer_errors(request, handler)
    if request.get(_CLOSE) or resp.status == 413:
        # Do not read (or linger over) the rest of a body we refused or gave up on.
        resp.force_close()
        if isinstance(request.protocol, GuardedHandler):
            request.protocol.abort_soon()
    return resp


async def _answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except QueryError as exc:
        return error_response(exc.code, exc.message, exc.hint)
    except FleetdError as exc:
        return error_response("bad_request", exc.message, exc.hint)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response("too_large", f"request body too large ({exc.text})",
                              "send a smaller body; the SQL text limit is in the error above")
    except web.HTTPNotFound:
        return error_response("not_found", f"no such endpoint: {request.path}",
                              f"see {paths.HEALTH}; endpoints are documented in docs/api.md")
    except web.HTTPMethodNotAllowed as exc:
        return error_response("method_not_allowed",
                              f"{request.method} is not allowed on {request.path}",
                              f"use {', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response("bad_request" if exc.status < 500 else "internal", exc.reason)
    except (ConnectionResetError, web.HTTPClientError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal", "internal error; see the agent's log")


def token_middleware(token: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None or request.path == paths.HEALTH:
            return await handler(request)
        auth = request.headers.get("Authorization", "")
        presented = auth[7:] if auth.startswith("Bearer ") else None
        if not token_ok(presented, token):  # constant-time comparison
            return error_response("unauthorized", "missing or wrong bearer token",
                                  "send Authorization: Bearer <token from the agent's token file>")
        return await handler(request)

    return check


def peer_middleware(state: NodeState) -> Any:
    """Marks each request's start and end for the connection's header deadline, names
    the client (certificate CN, else address) and refuses certificates not issued for
    client use (a node's, unless it may relay)."""
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        conn = request.protocol if isinstance(request.protocol, GuardedHandler) else None
        if conn is not None:
            conn.request_started()
        try:
            refusal = _identify(request, conn, state.relay_nodes)
            if refusal is not None:
                state.client_refusals += 1
                resp = error_response("forbidden", f"refused: {refusal}",
                                      "query with a client certificate: fleetd certs "
                                      "issue-client NAME (or list the node under "
                                      "tls.relay_nodes in the agent's fleetd.yaml)")
                resp.force_close()
                return resp
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()

    return check


def _identify(request: web.Request, conn: GuardedHandler | None,
              relay: frozenset[str]) -> str | None:
    """Set request[CLIENT]; return why this client is refused, or None."""
    if conn is not None and conn.peer is not None:
        request[CLIENT] = conn.peer
        return conn.refusal
    peer, refusal = f"addr:{request.remote or '?'}", None
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if der:
        peer, refusal = _judge(der, relay)
    if conn is not None:
        conn.peer, conn.refusal = peer, refusal
    request[CLIENT] = peer
    return refusal


@functools.lru_cache(maxsize=256)
def _judge(der: bytes, relay: frozenset[str]) -> tuple[str, str | None]:
    """(who, why refused or None) for a certificate the handshake verified. Cached by
    its bytes: parsing it is about 0.2 ms a time, paid by every new connection, and the
    verdict depends on nothing else."""
    refusal = client_refusal(der, relay)
    try:
        name = peer_role(der).name
    except ValueError:
        name = "?"
    return f"cert:{name}", refusal


def client_of(request: web.Request) -> str:
    return str(request.get(CLIENT) or f"addr:{request.remote or '?'}")


# ---- handlers -------------------------------------------------------------------------


async def health(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    answer: HealthReply = {
        "status": "ok", "node": st.node, "version": __version__,
        "schema_version": SCHEMA_VERSION, "tracing": st.tracing,
        "uptime_s": round(time.time() - st.started, 3)}
    return json_response({**answer, **st.status()})


async def clock(request: web.Request) -> web.StreamResponse:
    # t1: when the request reached us; t2: just before the answer leaves (NTP's t1, t2).
    t1 = time.time_ns()
    node = request.app[STATE].node
    body: TimeReply = {"node": node, "t1_ns": t1, "t2_ns": time.time_ns()}
    return json_response(body)


async def _json_body(request: web.Request) -> dict[str, object]:
    """A client's JSON object, unchecked: each handler checks the fields it reads."""
    st = request.app[STATE]
    declared = request.content_length
    if declared is not None and declared > st.max_body_bytes:
        # Refuse on the header alone: reading 100 MB to say "too large" is the attack.
        raise QueryError(f"request body of {declared} bytes is over the limit of "
                         f"{st.max_body_bytes}", "send a smaller body", code="too_large")
    try:
        async with asyncio.timeout(st.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        request[_CLOSE] = True
        if isinstance(request.protocol, GuardedHandler) and request.protocol.gate:
            request.protocol.gate.stats.slow_closed += 1
        raise QueryError(f"request body not received within {st.body_timeout_s:g} s",
                         "send the whole body at once", code="timeout") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise QueryError(f"request body is not valid JSON ({exc})",
                         'send {"sql": "SELECT ..."}', code="bad_request") from None
    if not isinstance(body, dict):
        raise QueryError("request body must be a JSON object", 'send {"sql": "SELECT ..."}',
                         code="bad_request")
    return body


def _limits_from(body: dict[str, object], ceiling: Limits) -> Limits:
    try:
        return ceiling.lowered(
            timeout_s=body.get("timeout_s"), max_rows=body.get("max_rows"),
            max_bytes=body.get("max_bytes"),
        )
    except FleetdError as exc:
        raise QueryError(exc.message, "limits may only be lowered, with positive numbers",
                         code="bad_request") from None


async def query(request: web.Request) -> web.StreamResponse:
    st, readers = request.app[STATE], request.app[READERS]
    body = await _json_body(request)
    unknown = set(body) - {"sql", "params", "timeout_s", "max_rows", "max_bytes"}
    if unknown:
        raise QueryError(f"unknown field(s) {sorted(unknown)} in the query request",
                         "fields: sql, params, timeout_s, max_rows, max_bytes", code="bad_request")
    sql, params = body.get("sql"), body.get("params", [])
    if not isinstance(sql, str):
        raise QueryError('field "sql" must be a string', 'send {"sql": "SELECT ..."}',
                         code="bad_request")
    if not isinstance(params, list | dict):
        raise QueryError('field "params" must be a list or an object', None, code="bad_request")
    limits = _limits_from(body, readers.limits)
    if paths.NDJSON in request.headers.get("Accept", ""):
        return await _query_stream(request, sql, params, limits)
    started = time.perf_counter()
    node = st.node

    def answer(db: SafeDB) -> bytes:
        # Encoded on the reader thread too: a 16 MB answer is tens of milliseconds of
        # orjson that would otherwise stall every other request on the loop.
        result: QueryResult = db.query(sql, params, limits)
        reply: QueryReply = {
            "node": node, "columns": result.columns, "rows": result.rows,
            "truncated": result.truncated, "truncated_reason": result.truncated_reason,
            "elapsed_ms": round(result.elapsed_ms, 3)}
        return encode(reply)

    async def made() -> bytes:
        try:
            return await readers.run(answer, client_of(request))
        except QueryError:
            st.query_errors += 1
            raise
        finally:
            _observe(st, time.perf_counter() - started)

    return await held_answer(request, limits.max_bytes, made)


async def _query_stream(request: web.Request, sql: str, params: Params,
                        limits: Limits) -> web.StreamResponse:
    """The query's answer as NDJSON (docs/api.md): a header object, one array per row,
    a trailer object. An error before the first row is an ordinary JSON error; one
    after it is the trailer's ``error``, since the status has left by then. Lines are
    sent in pieces of about STREAM_CHUNK_BYTES, so a small answer leaves in one write."""
    st, readers = request.app[STATE], request.app[READERS]
    started = time.perf_counter()
    resp: web.StreamResponse | None = None
    pending = b""  # lines not sent yet: a small answer leaves in one write, with its end
    end: StreamTrailer = {"end": True, "rows": 0, "truncated": False,
                          "truncated_reason": None}
    try:
        async with contextlib.aclosing(readers.stream(
                lambda db: db.stream(sql, params, limits), client_of(request))) as items:
            async for last, item in items:
                if last:
                    end.update({"rows": item.rows, "truncated": item.truncated,
                                "truncated_reason": item.truncated_reason,
                                "elapsed_ms": round(item.elapsed_ms, 3)})
                elif resp is None:
                    resp = web.StreamResponse(headers={"Content-Type": paths.NDJSON})
                    await resp.prepare(request)
                    header: StreamHeader = {
                        "node": st.node, "columns": item,
                        "limits": {"max_rows": limits.max_rows, "max_bytes": limits.max_bytes,
                                   "timeout_s": limits.timeout_s}}
                    pending = orjson.dumps(header) + b"\n"
                else:
                    end["rows"] += item.count(b"\n")  # for the trailer of a failed stream
                    pending += item
                    if len(pending) >= STREAM_CHUNK_BYTES:
                        # Awaits room in the connection: a client that stops reading
                        # is cut by its write deadline, and the reader slot it held with
                        # it (conns.GuardedHandler).
                        await resp.write(pending)
                        pending = b""
    except QueryError as exc:
        st.query_errors += 1
        if resp is None:
            raise
        end["error"] = {"code": exc.code, "message": exc.message, "hint": exc.hint}
    finally:
        _observe(st, time.perf_counter() - started)
    assert resp is not None  # the generator yields its columns before anything else
    end.setdefault("elapsed_ms", round((time.perf_counter() - started) * 1000, 3))
    await resp.write_eof(pending + orjson.dumps(end) + b"\n")
    return resp


class AnswerRoom:
    """Room in the connections' :class:`~fleetd.node.conns.Outbox` for one answer: the
    most it may take is held before it is made (a refusal is 429 busy, nothing run),
    what it took once it is made, and nothing once it has left or its connection was
    cut. Without a gate (an app not served by :func:`fleetd.node.agent.serve`) there is
    nothing to hold."""

    def __init__(self, request: web.Request, most: int) -> None:
        conn = request.protocol if isinstance(request.protocol, GuardedHandler) else None
        self.outbox: Outbox | None = conn.gate.outbox if conn and conn.gate else None
        self.client = client_of(request)
        self.held = 0
        self.most = most

    def __enter__(self) -> AnswerRoom:
        if self.outbox is not None:
            why = self.outbox.reserve(self.client, self.most)
            if why is not None:
                raise QueryError(f"the node is busy: {why}", "take the answers already "
                                 "asked for (a client that takes nothing of an answer for "
                                 "limits.write_timeout_s is cut), then ask again",
                                 code="busy")
            self.held = self.most
        return self

    def keep(self, size: int) -> None:
        """Hold what the answer took: less than reserved is given back; more (an answer
        without a byte limit of its own, an analysis) is counted, the work being done."""
        if self.outbox is None or size == self.held:
            return
        if size < self.held:
            self.outbox.release(self.client, self.held - size)
        else:
            self.outbox.hold(self.client, size - self.held)
        self.held = size

    def __exit__(self, *exc: object) -> None:
        if self.outbox is not None and self.held:
            self.outbox.release(self.client, self.held)
            self.held = 0


async def held_answer(request: web.Request, most: int,
                      make: Callable[[], Awaitable[bytes]]) -> web.StreamResponse:
    """The JSON answer ``make()`` encodes (at most ``most`` bytes expected), with room
    held for it in the outbox from before it is made until it has left, sent paced."""
    with AnswerRoom(request, most) as room:
        raw = await make()
        room.keep(len(raw))
        return await send_paced(request, raw)


async def send_paced(request: web.Request, raw: bytes,
                     content_type: str = "application/json") -> web.StreamResponse:
    """An answer handed to the connection a piece at a time, each once the last has left:
    what waits in the connection's buffers is about one piece, whatever the answer's
    size, and a client that takes nothing is cut by the connection's write deadline
    (:class:`~fleetd.node.conns.GuardedHandler`)."""
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    resp.content_length = len(raw)
    await resp.prepare(request)
    view = memoryview(raw)
    for at in range(0, len(view), ANSWER_PIECE):
        await resp.write(view[at:at + ANSWER_PIECE])
    await resp.write_eof()
    return resp


def _observe(st: NodeState, seconds: float) -> None:
    st.queries += 1
    st.query_seconds += seconds
    for i, edge in enumerate(QUERY_BUCKETS_S):
        if seconds <= edge:
            st.query_hist[i] += 1


def _int_arg(request: web.Request, name: str, default: int | None,
             low: int = INT64_MIN) -> int | None:
    text = request.query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise QueryError(f"query parameter {name}={text[:40]!r} is not an integer",
                         f"pass {name} as an integer (nanoseconds for times)",
                         code="bad_request") from None
    if not low <= value <= INT64_MAX:
        raise QueryError(f"query parameter {name}={text[:40]!r} is out of range",
                         f"pass {name} between {low} and {INT64_MAX}", code="bad_request")
    return value


async def events(request: web.Request) -> web.StreamResponse:
    """All events in [since, until) as NDJSON, streamed page by page in time order."""
    readers = request.app[READERS]
    since = _int_arg(request, "since", 0, low=0) or 0
    until = _int_arg(request, "until", INT64_MAX, low=0) or INT64_MAX
    limit = _int_arg(request, "limit", None)
    pid = _int_arg(request, "pid", None)
    who = client_of(request)
    if limit is not None and limit <= 0:
        raise QueryError(f"limit={limit} must be positive", None, code="bad_request")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    cursor: tuple[int, int] = (since, -1)
    sent = 0
    while limit is None or sent < limit:
        page = EVENTS_PAGE if limit is None else min(EVENTS_PAGE, limit - sent)
        fetch = functools.partial(_events_page, cursor=cursor, until=until, page=page, pid=pid)
        n, cursor, lines = await readers.run(fetch, who)
        if not n:
            break
        await resp.write(lines)
        sent += n
        if n < page:
            break
    await resp.write_eof()
    return resp


def _events_page(
    db: SafeDB, cursor: tuple[int, int], until: int, page: int, pid: int | None
) -> tuple[int, tuple[int, int], bytes]:
    """(rows, the cursor after them, their NDJSON lines), encoded on the reader thread."""
    # Keyset paging on (ts_ns, rowkey); the range on ts_ns keeps it on the index.
    where = "ts_ns >= ? AND ts_ns < ? AND (ts_ns > ? OR rowkey > ?)"
    params: list[Any] = [cursor[0], until, cursor[0], cursor[1]]
    if pid is not None:
        where += " AND pid = ?"
        params.append(pid)
    sql = f"SELECT {EVENT_COLUMNS} FROM events WHERE {where} ORDER BY ts_ns, rowkey LIMIT ?"
    params.append(page)
    res = db.query(sql, params, db.limits.lowered(max_rows=page))
    if not res.rows:
        return 0, cursor, b""
    cols = res.columns
    lines = b"".join(encode(dict(zip(cols, r, strict=True))) + b"\n"
                     for r in res.rows)
    last = res.rows[-1]
    return len(res.rows), (last[2], last[-1]), lines  # (ts_ns, rowkey) of the last row


async def not_found(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


def make_app(
    state: NodeState,
    readers: ReaderPool,
    *,
    max_body_bytes: int = 64 * 1024,
    extra_routes: list[web.RouteDef] | None = None,
) -> web.Application:
    state.max_body_bytes = max_body_bytes
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[peer_middleware(state), errors_middleware, token_middleware(state.token)],
    )
    app[STATE] = state
    app[READERS] = readers
    stamps.install(app)  # clock headers on every answer, resumed-handshake count
    app.add_routes([
        web.get(paths.HEALTH, health),
        web.get(paths.TIME, clock),
        web.post(paths.QUERY, query),
        web.get(paths.EVENTS, events),
        *(extra_routes or []),
    ])
    return app
