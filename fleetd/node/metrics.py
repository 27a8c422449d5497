"""``GET /metrics``: the agent observing itself, in Prometheus text format."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleetd.node.api import QUERY_BUCKETS_S, STATE, NodeState
from fleetd.node.conns import ConnStats


@dataclass
class Sources:
    """Callables the agent wires in; each returns the current numbers of one part."""

    writer: Callable[[], dict[str, Any]] = field(default=lambda: {})
    tracer: Callable[[], dict[str, Any]] = field(default=lambda: {})
    db_bytes: Callable[[], int] = field(default=lambda: 0)
    conns: ConnStats = field(default_factory=ConnStats)
    client_refusals: Callable[[], int] = field(default=lambda: 0)


SOURCES = web.AppKey("metric_sources", Sources)


def _line(out: list[str], name: str, kind: str, help_: str, value: float,
          labels: str = "") -> None:
    out.append(f"# HELP fleetd_{name} {help_}")
    out.append(f"# TYPE fleetd_{name} {kind}")
    out.append(f"fleetd_{name}{labels} {value}")


def render(state: NodeState, src: Sources) -> str:
    out: list[str] = []
    node = f'{{node="{state.node}"}}'
    w, t = src.writer(), src.tracer()
    _line(out, "events_written_total", "counter", "events committed to the database",
          w.get("events_written", 0), node)
    _line(out, "events_per_second", "gauge", "events/s recorded over the last interval",
          t.get("events_per_s", 0.0), node)
    _line(out, "events_lost_total", "counter",
          "events lost: ring buffers full, writer queue full, failed writes",
          t.get("lost", 0) + w.get("queue_dropped", 0) + w.get("failed_rows", 0), node)
    _line(out, "writer_queue_rows", "gauge", "rows waiting for the writer thread",
          w.get("queue_rows", 0), node)
    _line(out, "events_pruned_total", "counter", "oldest events deleted to bound the size",
          w.get("pruned_events", 0), node)
    _line(out, "db_bytes", "gauge", "bytes of the database holding data", src.db_bytes(), node)
    _line(out, "tls_handshake_failures_total", "counter",
          "TLS handshakes that failed or timed out", src.conns.handshake_failures, node)
    _line(out, "client_cert_refusals_total", "counter",
          "verified certificates refused as clients (node certificates, no client role)",
          src.client_refusals(), node)
    _line(out, "connections_open", "gauge", "connections open, handshakes included",
          src.conns.open, node)
    _line(out, "connections_refused_total", "counter",
          "connections closed unread: over the total or per-source cap",
          src.conns.refused, node)
    _line(out, "slow_requests_closed_total", "counter",
          "connections closed because headers or a body did not arrive in time",
          src.conns.slow_closed, node)
    _line(out, "queries_failed_total", "counter", "queries refused or failed",
          state.query_errors, node)
    out.append("# HELP fleetd_query_seconds time to answer a query")
    out.append("# TYPE fleetd_query_seconds histogram")
    # query_hist is cumulative already: each bucket counts the queries <= its edge.
    for edge, n in zip(QUERY_BUCKETS_S, state.query_hist, strict=True):
        out.append(f'fleetd_query_seconds_bucket{{node="{state.node}",le="{edge}"}} {n}')
    out.append(f'fleetd_query_seconds_bucket{{node="{state.node}",le="+Inf"}} {state.queries}')
    out.append(f"fleetd_query_seconds_sum{node} {state.query_seconds:.6f}")
    out.append(f"fleetd_query_seconds_count{node} {state.queries}")
    return "\n".join(out) + "\n"


async def metrics(request: web.Request) -> web.StreamResponse:
    text = render(request.app[STATE], request.app[SOURCES])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")
