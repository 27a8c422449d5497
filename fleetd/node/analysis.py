"""The analysis endpoints: chains, ops, overview, profile, stacks, graphs and gpu.

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
from fleetd.analyze.stacks import op_code
from fleetd.analyze.window import WindowSpec
from fleetd.errors import FleetdError, QueryError
from fleetd.node.api import READERS, STATE, client_of, encode
from fleetd.wire import paths
from fleetd.wire.limits import INT64_MAX
from fleetd.wire.pods import read_params
from fleetd.wire.shapes import ChainsReply, OpsReply

MAX_TOP_N = 1000  # stacks per answer
MAX_FRAMES = 128  # frames per stack
MAX_BUCKETS = 500  # graph timeline buckets
MAX_CPU_STACKS = 5000  # (thread, stack) counts per on-CPU profile answer
OPS_BY = ("op", "kernel")  # /api/v1/ops?by=


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


def _bad_request(exc: FleetdError) -> QueryError:
    return QueryError(exc.message, exc.hint, code="bad_request")


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


async def _run(request: web.Request, job: Job) -> web.StreamResponse:
    """Run ``job`` over the node's database in the request's window."""
    readers = request.app[READERS]
    node = request.app[STATE].node
    spec = WindowSpec.from_params(request.query)

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


async def ops(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid = _int_param(q, "pid")
    per_process = q.get("per_process", "") in ("1", "true", "yes")
    by = q.get("by", "op")
    if by not in OPS_BY:
        raise QueryError(f"by={by[:40]!r} is not one of {'|'.join(OPS_BY)}",
                         "by=op (the default) or by=kernel", code="bad_request")
    selected = _pod_selector(q, pid)

    def go(a: Analysis, node: str) -> OpsReply:
        pids = selected(a)
        if pids is None:
            rows = a.op_stats(pid, per_process, by)
        else:
            # A pod's processes: per process, each row with its pod (as fleetd ops --pod).
            found = pods.placements(a.conn)
            rows = []
            for sl in a.slices:
                every = (sl.kernel_stats(None, True) if by == "kernel"
                         else sl.op_stats(None, True))
                part = [r for r in every if r.get("pid") in pids]
                pods.annotate(part, sl.node.key, found)
                rows += part
        return {"node": node, "window": a.window.to_json(), "warnings": list(a.window.warnings),
                "ops": rows}

    return await _run(request, go)


async def node_profile(request: web.Request) -> web.StreamResponse:
    return await _run(request, lambda a, node: a.profile(node))


async def node_overview(request: web.Request) -> web.StreamResponse:
    return await _run(request, lambda a, node: a.overview(node))


async def stacks(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid = _int_param(q, "pid")
    top_n = _int_param(q, "top_n", MAX_TOP_N) or 10
    frames_n = _int_param(q, "frames_n", MAX_FRAMES) or 16
    min_dur_ns = _int_param(q, "min_dur_ns") or 0
    op = q.get("op") or None
    if op is not None:
        try:
            op_code(op)
        except FleetdError as exc:
            raise _bad_request(exc) from None

    def go(a: Analysis, node: str) -> dict[str, Any]:
        out = a.stacks(op, pid, top_n, frames_n, min_dur_ns=min_dur_ns)
        out["stacks"] = out["stacks"][:top_n]
        return {"node": node, **out}

    return await _run(request, go)


async def cpu_stacks(request: web.Request) -> web.StreamResponse:
    """The window's on-CPU samples per (thread, stack), heaviest first (fleetd profile)."""
    from fleetd.analyze.profile import stack_counts, stacks_json

    q = request.query
    pid, tid = _int_param(q, "pid"), _int_param(q, "tid")
    top_n = _int_param(q, "top_n", MAX_CPU_STACKS) or MAX_CPU_STACKS
    frames_n = _int_param(q, "frames_n", MAX_FRAMES) or MAX_FRAMES

    def go(a: Analysis, node: str) -> dict[str, Any]:
        counts, period = [], 0
        for sl in a.slices:
            got, p = stack_counts(sl.conn, sl.node, sl.window, pid, tid)
            counts += got
            period = max(period, p)
        found, left = stacks_json(counts, top_n, frames_n)
        return {"node": node, "window": a.window.to_json(), "period_ns": period,
                "stacks": found, "stacks_omitted": left, "warnings": list(a.window.warnings)}

    return await _run(request, go)


async def graphs(request: web.Request) -> web.StreamResponse:
    q = request.query
    pid = _int_param(q, "pid")
    buckets = _int_param(q, "buckets", MAX_BUCKETS) or 20
    return await _run(request, lambda a, node: {"node": node, **a.graphs(pid, buckets)})


async def gpu(request: web.Request) -> web.StreamResponse:
    from fleetd.analyze.gpu import parse_thresholds

    q = request.query
    pid = _int_param(q, "pid")
    steps = q.get("steps") in ("1", "true")
    try:
        limits = parse_thresholds(t for t in q.get("thresholds", "").split(",") if t)
    except FleetdError as exc:
        raise _bad_request(exc) from None
    return await _run(request, lambda a, node: {"node": node, **a.gpu(pid, steps, limits)})


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
    web.get(paths.OPS, ops),
    web.get(paths.OVERVIEW, node_overview),
    web.get(paths.PROFILE, node_profile),
    web.get(paths.STACKS, stacks),
    web.get(paths.CPU_STACKS, cpu_stacks),
    web.get(paths.GRAPHS, graphs),
    web.get(paths.GPU, gpu),
    web.get(paths.COLLECTIVES, collectives),
]
