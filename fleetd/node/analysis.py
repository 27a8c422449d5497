"""The analysis endpoints: one GET route per question of the registry
(:mod:`fleetd.questions`: chains, ops, stacks, on-CPU stacks, graphs, gpu, overview,
profile, collectives, pods).

Each runs the analyzer facade (:class:`fleetd.analyze.facade.Analysis`) on a reader
thread, on a guarded read-only connection, under a deadline, over the node's own
database. Windows come as query parameters: ``since=5m`` or ``from=T&to=T`` (ISO 8601,
epoch seconds or ns; ``to`` inclusive), the same words the CLI takes, read once into a
:class:`fleetd.store.bounds.Bounds` (:meth:`fleetd.questions.spec.Question.window`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from fleetd.analyze.facade import ANALYSIS_TIMEOUT_S, Analysis
from fleetd.analyze.reading.window import resolve_request
from fleetd.node.api import READERS, STATE, client_of, encode, held_answer
from fleetd.questions.catalog import QUESTIONS
from fleetd.questions.spec import Question
from fleetd.store.bounds import Bounds

Job = Callable[[Analysis, str], Mapping[str, Any]]


async def _run(request: web.Request, job: Job, bounds: Bounds) -> web.StreamResponse:
    """Run ``job`` over the node's database in the window ``bounds``."""
    readers = request.app[READERS]
    node = request.app[STATE].node

    def go(conn: sqlite3.Connection) -> bytes:
        # Encoded on the reader thread: a large answer's JSON would stall the loop,
        # and with it every light request (health, time, metrics).
        return encode(job(Analysis(conn, resolve_request(conn, bounds), node), node))

    async def made() -> bytes:
        return await readers.run(lambda db: db.analyze(go, ANALYSIS_TIMEOUT_S),
                                 client_of(request))

    # Held for its client like a query's answer until it has left (docs/security.md
    # "Connections and memory").
    return await held_answer(request, readers.limits.max_bytes, made)


def question_route(question: Question) -> web.RouteDef:
    """The GET route of a registry question: its parameters parsed (a bad one refused
    with ``bad_request``, the value quoted), then its answer over the node's database
    in the request's window."""
    async def handle(request: web.Request) -> web.StreamResponse:
        params = question.parse(request.query)
        return await _run(request, lambda a, node: question.on_node(a, node, params),
                          question.window(request.query))

    return web.get(question.route, handle)


ROUTES = [question_route(q) for q in QUESTIONS]
