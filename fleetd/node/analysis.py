"""The analysis endpoints: chains and collectives here, and one route per question of
the registry (:mod:`fleetd.questions`: ops, overview, profile, stacks, on-CPU stacks,
graphs, gpu, pods).

Each runs the analyzer facade (:class:`fleetd.analyze.facade.Analysis`) on a reader
thread, on a guarded read-only connection, under a deadline, over the node's own
database. Windows come as query parameters: ``since=5m`` or ``from=T&to=T`` (ISO 8601,
epoch seconds or ns), the same words the CLI takes (:class:`WindowSpec`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from fleetd.analyze import pods
from fleetd.analyze.facade import ANALYSIS_TIMEOUT_S, Analysis
from fleetd.analyze.window import WindowSpec
from fleetd.errors import QueryError
from fleetd.node.api import READERS, STATE, client_of, encode
from fleetd.questions.catalog import QUESTIONS
from fleetd.questions.spec import Question
from fleetd.wire import paths
from fleetd.wire.limits import INT64_MAX
from fleetd.wire.pods import read_params
from fleetd.wire.shapes import ChainsReply


def _int_param(q: Any, name: str, limit: int | None = None) -> int | None:
    text = q.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    top = INT64_MAX if limit is None else limit  # beyond 64 bits SQLite cannot bind it
    if value <= 0 or value > top:
        bound = f" no larger than {top}"
        raise QueryError(f"{name}={text[:40]!r} must be a positive integer{bound}", None,
                         code="bad_request")
    return value


Job = Callable[[Analysis, str], Mapping[str, Any]]


PodSelector = Callable[[Analysis], set[int] | None]


def _pod_selector(q: Any, pid: int | None) -> PodSelector:
    """The ``pod`` / ``namespace`` parameters as the pids they select in the analyzed
    file (None: neither asked), as ``--pod`` selects them from a local database. A pod
    that ran nowhere here selects nothing: the answer has no rows, not an error."""
    try:
        pod, ns = read_params(q)
    except ValueError as exc:
        raise QueryError(str(exc), None, code="bad_request") from exc
    if not pod and not ns:
        return lambda a: None
    if pid:
        raise QueryError("pid and pod/namespace both select processes", "give one of them",
                         code="bad_request")
    return lambda a: pods.select(a.conn, pod, ns)


async def _run(request: web.Request, job: Job, windowed: bool = True) -> web.StreamResponse:
    """Run ``job`` over the node's database in the request's window (the whole file for
    a question that takes none)."""
    readers = request.app[READERS]
    node = request.app[STATE].node
    spec = WindowSpec.from_params(request.query) if windowed else WindowSpec()

    def go(conn: sqlite3.Connection) -> bytes:
        # Encoded on the reader thread: a large answer's JSON would stall the loop,
        # and with it every light request (health, time, metrics).
        return encode(job(Analysis(conn, spec.resolve_request(conn), node), node))

    raw = await readers.run(lambda db: db.analyze(go, ANALYSIS_TIMEOUT_S), client_of(request))
    return web.Response(body=raw, content_type="application/json")


async def chains(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid, top_n = _int_param(q, "pid"), _int_param(q, "top_n")
    selected = _pod_selector(q, pid)

    def go(a: Analysis, node: str) -> ChainsReply:
        report = a.explain(pid, pids=selected(a))
        found = report["chains"][:top_n] if top_n else report["chains"]
        return {"node": node, "window": report["window"], "verdict": report["verdict"],
                "chains": found, "processes": report["processes"],
                "warnings": report["warnings"]}

    return await _run(request, go)


def question_route(question: Question) -> web.RouteDef:
    """The GET route of a registry question: its parameters parsed (a bad one refused
    with ``bad_request``, the value quoted), then its answer over the node's database."""
    async def handle(request: web.Request) -> web.StreamResponse:
        params = question.parse(request.query)
        return await _run(request, lambda a, node: question.on_node(a, node, params),
                          windowed=question.windowed)

    return web.get(question.route, handle)


async def collectives(request: web.Request) -> web.StreamResponse:
    """The node's NCCL collective calls in the window, newest ``max_rows`` (bounded by
    rows and bytes), for the fleet client to compare arrivals across nodes."""
    from fleetd.analyze.collectives import DEFAULT_ROWS, MAX_BYTES, MAX_ROWS, NodeArrivals

    max_rows = _int_param(request.query, "max_rows", MAX_ROWS) or DEFAULT_ROWS

    def go(a: Analysis, node: str) -> dict[str, Any]:
        parts = a.arrivals(max_rows, MAX_BYTES)
        body = (parts[0] if parts else NodeArrivals(node, [], {})).to_json()
        return {"node": node, "window": a.window.to_json(), **body,
                "warnings": list(a.window.warnings)}

    return await _run(request, go)


ROUTES = [
    web.get(paths.CHAINS, chains),
    web.get(paths.COLLECTIVES, collectives),
    *(question_route(q) for q in QUESTIONS),
]
