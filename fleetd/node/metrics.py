"""``GET /metrics``: the agent observing itself, for Prometheus.

The text comes from ``prometheus_client``: one custom collector (:class:`AgentCollector`)
and the library's process collector, registered in a registry of the agent's own (never
the library's global one, which would mix in whatever else the process imported).
Counters are counters (``rate()`` makes the per-second figures); no series carries a
``node`` label, since the scrape target says which node it is (docs/deploy.md).

The CUDA and NCCL latency histograms are the tracer's in-kernel ones (``aggregate_data``:
log2 buckets per op, written once per aggregation window). :class:`OpLatency` keeps
their running totals since the agent started: each scrape reads only the rows written
since the previous one (a range of rowids), on a reader thread of the agent's pool,
never on the event loop, and on its light lane, never behind the clients' queries.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fleetd import __version__
from fleetd.errors import FleetdError
from fleetd.node.api import QUERY_BUCKETS_S, READERS, STATE, NodeState
from fleetd.node.conns import ConnStats
from fleetd.node.ranks import RANKBOOK, RankBook, local_late
from fleetd.node.readers import ReaderPool
from fleetd.node.stamps import HANDSHAKES, Handshakes
from fleetd.store.catalog import BY_CODE, CALLS
from fleetd.store.health import TraceStats
from fleetd.store.schema import SCHEMA_VERSION
from fleetd.store.writer import WriterStats

log = logging.getLogger("fleetd.node.metrics")

# The ops whose in-kernel histograms are call latencies (host ops are not: page_alloc's
# buckets are orders, and off-CPU time is no call).
CALL_CODES = CALLS.codes
# The kernel's bucket b holds [2**b, 2**(b+1)) ns. The edges exposed: 2**8 ns (256 ns)
# to 2**35 ns (34 s), each `le` the upper edge of the buckets below it; longer calls
# count in +Inf only.
LE_POWERS = range(8, 36)
READ_TIMEOUT_S = 2.0


class OpLatency:
    """Per op, the totals of the in-kernel latency histograms written since the agent
    started: counts per log2 bucket and the summed nanoseconds."""

    def __init__(self) -> None:
        self.counts: dict[int, dict[int, int]] = {}  # op code -> bucket -> calls
        self.sums: dict[int, int] = {}  # op code -> ns
        self.failures = 0  # scrapes that could not read the new rows (busy, timeout)
        self._after: int | None = None  # rows up to this rowid are counted
        self._node_key: int | None = None
        self._lock: asyncio.Lock | None = None

    async def refresh(self, readers: ReaderPool, node: str, since_ns: int) -> None:
        """Add the rows written since the last refresh, on the pool's light lane (a
        scrape never waits for a query's slot). On failure the totals stay as they
        were (a counter that lags one scrape is still a counter)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            after, key = self._after, self._node_key

            def read(conn: sqlite3.Connection) -> tuple[int, int | None, list[Any]]:
                return _read_new(conn, node, key, after, since_ns)

            try:
                hi, key, rows = await readers.run_light(
                    lambda db: db.analyze(read, READ_TIMEOUT_S))
            except (FleetdError, sqlite3.Error) as exc:
                self.failures += 1
                level = logging.WARNING if self.failures == 1 else logging.DEBUG
                log.log(level, "latency histograms not refreshed: %s", exc)
                return
            if key is not None:
                self._after, self._node_key = hi, key
                self.add(rows)

    def add(self, rows: Sequence[tuple[int, int, int, int]]) -> None:
        """(op code, bucket, count, sum ns) rows, buckets >= 0."""
        for op, bucket, count, total in rows:
            per_op = self.counts.setdefault(int(op), {})
            per_op[int(bucket)] = per_op.get(int(bucket), 0) + int(count)
            self.sums[int(op)] = self.sums.get(int(op), 0) + int(total)

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(
            "fleetd_cuda_call_duration_seconds",
            "CUDA runtime, graph, driver and NCCL call latency per op, from the in-kernel "
            "histograms (every call, sampled or not), since the agent started",
            labels=["source", "op"])
        for code in sorted(self.counts):
            op = BY_CODE.get(code)
            per_bucket = self.counts[code]
            buckets: list[tuple[str, float]] = []
            for k in LE_POWERS:
                below = sum(n for b, n in per_bucket.items() if b < k)
                buckets.append((repr(2**k / 1e9), float(below)))
            buckets.append(("+Inf", float(sum(per_bucket.values()))))
            fam.add_metric([op.source if op else "unknown", op.name if op else f"op{code}"],
                           buckets, self.sums.get(code, 0) / 1e9)
        return fam


def _read_new(conn: sqlite3.Connection, node: str, key: int | None, after: int | None,
              since_ns: int) -> tuple[int, int | None, list[Any]]:
    """(highest rowid read, node key, rows) for the rows after ``after``; the first time,
    the rows of windows that began since the agent started (through the op index)."""
    if key is None:
        found = conn.execute("SELECT id FROM nodes WHERE name = ?", (node,)).fetchone()
        if found is None:  # nothing of this node yet: read from the start next time
            return 0, None, []
        key = int(found[0])
    hi = int(conn.execute("SELECT coalesce(max(rowid), 0) FROM aggregate_data").fetchone()[0])
    codes = ", ".join(map(str, CALL_CODES))
    group = "AND bucket >= 0 GROUP BY op, bucket"
    if after is not None and hi < after:
        # The table was emptied (pruned) and rowids start again: everything is new.
        log.info("aggregate rows were pruned below the last one read; reading anew")
        after = 0
    if after is None:
        rows = conn.execute(
            "SELECT op, bucket, sum(count), sum(sum) FROM aggregate_data "
            f"WHERE node = ? AND op IN ({codes}) AND ts_ns >= ? AND rowid <= ? {group}",
            (key, since_ns, hi)).fetchall()
    elif hi > after:
        # '+' keeps SQLite on the rowid range instead of the (node, op) index.
        rows = conn.execute(
            "SELECT op, bucket, sum(count), sum(sum) FROM aggregate_data "
            f"WHERE rowid > ? AND rowid <= ? AND +node = ? AND +op IN ({codes}) {group}",
            (after, hi, key)).fetchall()
    else:
        rows = []
    return hi, key, rows


@dataclass
class Sources:
    """Callables the agent wires in; each returns the current numbers of one part."""

    writer: Callable[[], WriterStats] = WriterStats
    tracer: Callable[[], TraceStats] = TraceStats
    db_bytes: Callable[[], int] = field(default=lambda: 0)
    conns: ConnStats = field(default_factory=ConnStats)
    client_refusals: Callable[[], int] = field(default=lambda: 0)
    nccl_ranks: Callable[[], int] = field(default=lambda: 0)
    # (matching, group key, ns its ranks have waited) per group of this node's NCCL ranks
    nccl_waits: Callable[[], list[tuple[str, str, int]]] = field(default=lambda: [])
    latency: OpLatency = field(default_factory=OpLatency)
    # The agent's rank book (taken from the app at a scrape, as the handshakes are): late
    # ranks and throttled processes; None without tracing.
    book: RankBook | None = None
    handshakes: Handshakes = field(default_factory=Handshakes)  # the app's, at a scrape
    _registry: tuple[NodeState, CollectorRegistry] | None = field(default=None, repr=False)

    def registry(self, state: NodeState) -> CollectorRegistry:
        """This agent's registry: its collector and the process collector."""
        if self._registry is None or self._registry[0] is not state:
            reg = CollectorRegistry(auto_describe=False)
            reg.register(AgentCollector(state, self))
            ProcessCollector(registry=reg)
            self._registry = (state, reg)
        return self._registry[1]


SOURCES = web.AppKey("metric_sources", Sources)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, value=value)


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, value=value)


class AgentCollector(Collector):
    """Everything fleetd's own: read from the sources at each scrape."""

    def __init__(self, state: NodeState, src: Sources) -> None:
        self.state, self.src = state, src

    def collect(self) -> Iterator[Metric]:
        state, src = self.state, self.src
        w, t = src.writer(), src.tracer()
        build = GaugeMetricFamily("fleetd_build_info", "fleetd's version, 1",
                                  labels=["version", "python", "schema_version"])
        build.add_metric([__version__, platform.python_version(), str(SCHEMA_VERSION)], 1)
        yield build
        yield _gauge("fleetd_tracing", "1 while the tracer runs, 0 when it does not "
                     "(--no-trace, or tracing stopped: see the agent's log)",
                     1 if state.tracing and t.get("running", True) else 0)
        yield _counter("fleetd_trace_records", "records the tracer decoded from the "
                       "kernel's ring buffers (rate() gives records/s)", t.get("records", 0))
        yield _gauge("fleetd_trace_targets", "processes traced now", t.get("targets", 0))
        yield _gauge("fleetd_trace_probes", "uprobes attached", t.get("probes", 0))
        yield _counter("fleetd_events_written", "events committed to the database",
                       w.events_written)
        writer_lost = w.queue_dropped + w.failed_rows
        # The tracer's count includes the writer's (its drops name writer_queue and
        # writer_failed); without a tracer only the writer's is known.
        yield _counter("fleetd_events_lost", "events lost: ring buffers or kernel maps "
                       "full, writer queue full, failed writes",
                       max(t.get("lost", 0), writer_lost))
        yield _gauge("fleetd_writer_queue_rows", "rows waiting for the writer thread",
                     w.queue_rows)
        yield _counter("fleetd_events_pruned", "oldest events deleted to bound the size",
                       w.pruned_events)
        yield _counter("fleetd_threads_pruned", "thread rows deleted once no kept event "
                       "named them", w.pruned_threads)
        yield _counter("fleetd_processes_pruned", "process rows deleted once nothing kept "
                       "named them", w.pruned_processes)
        yield _gauge("fleetd_disk_full", "1 while writes fail because the database's disk "
                     "is full (the agent prunes and retries; writing resumes by itself)",
                     1 if w.disk_full else 0)
        yield _counter("fleetd_events_dropped_disk_full", "rows the writer dropped because "
                       "the disk was full (also in fleetd_events_lost)",
                       w.disk_full_rows)
        yield _gauge("fleetd_db_bytes", "bytes of the database holding data", src.db_bytes())
        yield _counter("fleetd_tls_handshake_failures", "TLS handshakes that failed or "
                       "timed out", src.conns.handshake_failures)
        yield _counter("fleetd_tls_handshakes", "TLS connections that made a request",
                       src.handshakes.total)
        yield _counter("fleetd_tls_resumed_handshakes", "of those, the ones that resumed "
                       "a session (no certificates exchanged)", src.handshakes.resumed)
        yield _counter("fleetd_client_cert_refusals", "verified certificates refused as "
                       "clients (node certificates, no client role)", src.client_refusals())
        yield _gauge("fleetd_connections_open", "connections open, handshakes included",
                     src.conns.open)
        yield _counter("fleetd_connections_refused", "connections closed unread: over the "
                       "total or per-source cap", src.conns.refused)
        yield _counter("fleetd_slow_requests_closed", "connections closed because headers "
                       "or a body did not arrive in time", src.conns.slow_closed)
        yield _counter("fleetd_connections_evicted", "connections (handshaking or idle) of "
                       "the address holding the most, closed at the total cap to admit an "
                       "address holding fewer", src.conns.evicted)
        yield _counter("fleetd_slow_readers_cut", "connections cut because their client "
                       "took nothing of its answer within limits.write_timeout_s",
                       src.conns.slow_readers_cut)
        yield _gauge("fleetd_answer_queued_bytes", "bytes of answers made (or being made) "
                     "and not yet taken by their clients", src.conns.queued_bytes)
        yield _counter("fleetd_answer_queue_refusals", "requests refused as busy because "
                       "their client's (or all clients') answers wait unread over "
                       "limits.max_queued_bytes", src.conns.queue_refusals)
        yield _counter("fleetd_queries_failed", "queries refused or failed",
                       state.query_errors)
        query = HistogramMetricFamily("fleetd_query_seconds", "time to answer a query")
        # query_hist is cumulative already: each bucket counts the queries <= its edge.
        query.add_metric([], [*((repr(float(edge)), float(n)) for edge, n in
                                zip(QUERY_BUCKETS_S, state.query_hist, strict=True)),
                              ("+Inf", float(state.queries))], state.query_seconds)
        yield query
        yield src.latency.family()
        yield _gauge("fleetd_nccl_ranks", "traced processes that made NCCL calls",
                     src.nccl_ranks())
        waits = GaugeMetricFamily(
            "fleetd_nccl_wait_seconds", "per communicator or torchrun job of this node's "
            "ranks: how long ranks have waited for one that did not arrive (or is stopped, "
            "in D state or dead); 0 when none waits", labels=["matching", "group"])
        for matching, key, ns in src.nccl_waits():
            waits.add_metric([matching, key], round(ns / 1e9, 3))
        yield waits
        yield from _book_metrics(src.book, state.node)


def _book_metrics(book: RankBook | None, node: str) -> Iterator[Metric]:
    late = GaugeMetricFamily(
        "fleetd_rank_late_ratio", "per rank of a communicator or torchrun job with two or "
        "more ranks on this node: the share of their collectives of the last 5 s it "
        "entered last", labels=["matching", "group", "rank"])
    throttled = GaugeMetricFamily(
        "fleetd_process_throttled_ratio", "per traced process under a CPU quota: the share "
        "of its cgroup's CFS periods throttled over the last sample (about 1 s)",
        labels=["pid", "comm"])
    if book is not None:
        for matching, key, rank, ratio in local_late(book, node):
            late.add_metric([matching, key, str(rank)], ratio)
        for pid, comm, ratio in book.throttled():
            throttled.add_metric([str(pid), comm], ratio)
    yield late
    yield throttled


def render(state: NodeState, src: Sources) -> str:
    """The Prometheus text format (what a scrape without an Accept header gets)."""
    return generate_latest(src.registry(state)).decode()


async def metrics(request: web.Request) -> web.StreamResponse:
    state, src = request.app[STATE], request.app[SOURCES]
    src.handshakes = request.app.get(HANDSHAKES, src.handshakes)
    src.book = request.app.get(RANKBOOK, src.book)
    await src.latency.refresh(request.app[READERS], state.node, int(state.started * 1e9))
    # The text format, or OpenMetrics when the scraper asks for it.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(src.registry(state)),
                        headers={"Content-Type": content_type})
