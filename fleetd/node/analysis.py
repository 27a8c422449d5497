"""The analysis endpoints: chains, ops, overview and profile, over the node's own database.

Each runs the analyzer on a reader thread, on a guarded read-only connection, under a
deadline. Windows come as query parameters: ``since=5m`` or ``from=T&to=T`` (ISO 8601,
epoch seconds or ns), the same words the CLI takes.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from aiohttp import web

from fleetd.analyze.explain import explain, profile
from fleetd.analyze.opstats import op_stats
from fleetd.analyze.overview import overview
from fleetd.analyze.window import Window, resolve_window
from fleetd.errors import FleetdError, QueryError
from fleetd.node.api import READERS, STATE, json_response

ANALYSIS_TIMEOUT_S = 60.0


def _window(conn: sqlite3.Connection, q: Any) -> Window:
    try:
        return resolve_window(conn, q.get("since") or None, q.get("from") or None,
                              q.get("to") or None)
    except FleetdError as exc:
        raise QueryError(exc.message, exc.hint, code="bad_request") from None


def _int_param(q: Any, name: str) -> int | None:
    text = q.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise QueryError(f"{name}={text!r} must be a positive integer", None, code="bad_request")
    return value


async def _run(request: web.Request, fn: Any) -> web.StreamResponse:
    readers = request.app[READERS]
    node = request.app[STATE].node
    result = await readers.run(lambda db: db.analyze(lambda c: fn(c, node), ANALYSIS_TIMEOUT_S))
    return json_response(result)


async def chains(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid, top_n = _int_param(q, "pid"), _int_param(q, "top_n")

    def go(conn: sqlite3.Connection, node: str) -> dict[str, Any]:
        win = _window(conn, q)
        report = explain(conn, win, pid, node=node)
        found = report["chains"][:top_n] if top_n else report["chains"]
        return {"node": node, "window": report["window"], "verdict": report["verdict"],
                "chains": found, "processes": report["processes"],
                "warnings": report["warnings"]}

    return await _run(request, go)


async def ops(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid = _int_param(q, "pid")
    per_process = q.get("per_process", "") in ("1", "true", "yes")

    def go(conn: sqlite3.Connection, node: str) -> dict[str, Any]:
        win = _window(conn, q)
        return {"node": node, "window": win.to_json(), "warnings": list(win.warnings),
                "ops": op_stats(conn, win, pid, per_process, node=node)}

    return await _run(request, go)


async def node_profile(request: web.Request) -> web.StreamResponse:
    q = request.query

    def go(conn: sqlite3.Connection, node: str) -> dict[str, Any]:
        return profile(conn, _window(conn, q), node)

    return await _run(request, go)


async def node_overview(request: web.Request) -> web.StreamResponse:
    q = request.query

    def go(conn: sqlite3.Connection, node: str) -> dict[str, Any]:
        return overview(conn, _window(conn, q), node)

    return await _run(request, go)


ROUTES = [
    web.get("/api/v1/chains", chains),
    web.get("/api/v1/ops", ops),
    web.get("/api/v1/overview", node_overview),
    web.get("/api/v1/profile", node_profile),
]
