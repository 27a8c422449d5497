"""Pull every node's timeline out of a live fleet, for ``fleetd export --nodes``.

Two rounds, both through the fleet client:

1. **facts**, one task per node under the fan-out's deadline (``--timeout``), beside its
   clock samples: process and thread names, sessions (ranks, recorded clock samples) and
   causal chains (stored ones, else computed by the node), all small;
2. **bulk**, for every node that answered, all at once: its events (``GET
   /api/v1/events``, NDJSON), its calls per histogram window and, where it holds
   imported GPU work, its GPU rows and annotated ranges (``POST /api/v1/query``, paged
   on ``(ts_ns, id)``), each into a spool file. The events body goes to disk piece by
   piece as it arrives, never held whole; a page of rows is written before the next is
   asked for. It has no deadline (an export takes as long as its size), only a limit on
   silence: a node that sends nothing for ``--timeout`` (per page: each gets the whole
   ``--timeout``), or whose answer breaks off, is dropped with a warning.

A node without GPU tables (a schema 1 file) or without GPU rows in the window costs one
small request (:data:`GPU_PROBE_SQL`'s shape) more, nothing else.

The exporter then reads the spools one node after another
(:mod:`fleetd.export.fleet`), so memory stays flat whatever the fleet sends. Nothing
here parses an event: a spool holds the node's bytes as they came.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

import orjson

from fleetd.analyze.reading.data import CALL_SOURCES
from fleetd.errors import UsageError
from fleetd.fleet.client import FleetClient
from fleetd.fleet.combine import NodeWarning
from fleetd.fleet.fanout import (
    FleetAnswer,
    FleetOptions,
    NodeOutcome,
    Request,
    fan_out_work,
    send_all,
)
from fleetd.fleet.result import raise_if_user_error
from fleetd.fleet.targets import Target
from fleetd.store.bounds import OPEN_END_NS, Bounds
from fleetd.store.chainrow import STORED_CHAIN_COLUMNS, STORED_CHAIN_WINDOW
from fleetd.store.clockinfo import SESSION_CLOCK_COLUMNS
from fleetd.wire import paths
from fleetd.wire.failure import Failure, NodeFailed
from fleetd.wire.shapes import QueryBody

log = logging.getLogger("fleetd.export.pull")

RATES_PAGE = 5_000  # histogram windows per request (under the agent's row ceiling)
NAMES_SQL = ("SELECT 'process' AS kind, pid AS id, NULL AS pid, comm, rank FROM processes "
             "UNION ALL SELECT 'thread', tid, pid, comm, NULL FROM threads")
# Where each process ran (schema 5), asked apart from the names: a node serving an older
# file has no such columns, and its names must still come.
PLACEMENT_SQL = ("SELECT pid, pod, namespace, container_name, container, pod_uid FROM "
                 "processes WHERE container IS NOT NULL OR pod_uid IS NOT NULL")
SESSIONS_SQL = f"SELECT {SESSION_CLOCK_COLUMNS}, rank FROM sessions ORDER BY seq"
# The frames of the stacks the window's events carry; the answer's row cap bounds them.
STACKS_SQL = ("SELECT hash, frames FROM stacks WHERE hash IN (SELECT DISTINCT stack FROM "
              "events WHERE stack != 0 AND ts_ns >= ? AND ts_ns < ?)")
MAX_STACKS = 20_000
# Calls per histogram window: totals where the tracer wrote them, else the buckets (as
# fleetd.export.local reads a file). Paged on ts_ns.
_SOURCES = ", ".join(f"'{s}'" for s in sorted(CALL_SOURCES))
RATES_SQL = (
    "SELECT ts_ns, dur_ns, coalesce(sum(count) FILTER (WHERE bucket = -1), sum(count)) "
    f"AS calls FROM aggregates WHERE source IN ({_SOURCES}) AND ts_ns > ? AND ts_ns < ?"
)
# Imported GPU work (kernels, copies, sets: synchronizations have no slice) and annotated
# ranges, in the columns of fleetd.export.model.GpuRow / AnnotationRow, as
# fleetd.export.local reads them from a file. Paged on (ts_ns, id): ts_ns repeats.
GPU_PAGE = 2_000  # rows per request: a few MB of Python objects at most
GPU_PAGE_BYTES = 4 * 1024 * 1024  # and a page's answer, kernel names and all
GPU_SQL = (
    "SELECT g.id, g.ts_ns, g.dur_ns, g.pid, g.device, g.stream, g.kind, "
    "coalesce((SELECT name FROM gpu_names WHERE hash = g.name), ''), g.correlation, "
    "g.launch, g.bytes, "
    "(SELECT name FROM gpu_names WHERE hash = g.collective AND g.collective != 0), "
    "g.grid_x, g.grid_y, g.grid_z, g.block_x, g.block_y, g.block_z "
    "FROM gpu_data g WHERE g.kind IN (1, 2, 3) AND g.ts_ns >= ? AND g.ts_ns < ? "
    "AND (g.ts_ns > ? OR g.id > ?){pid} ORDER BY g.ts_ns, g.id"
)
ANNOTATIONS_SQL = (
    "SELECT a.id, a.ts_ns, a.dur_ns, a.pid, a.tid, a.kind, "
    "coalesce((SELECT name FROM gpu_names WHERE hash = a.name), '') "
    "FROM annotation_data a WHERE a.ts_ns >= ? AND a.ts_ns < ? "
    "AND (a.ts_ns > ? OR a.id > ?){pid} ORDER BY a.ts_ns, a.id"
)
# One request says whether there is anything to page: the first GPU row and annotation
# in the window (index lookups), and how many nodes the served file holds. A file
# without the tables answers "no such table": nothing imported, nothing more to ask.
GPU_PROBE_SQL = (
    "SELECT (SELECT ts_ns FROM gpu_data WHERE kind IN (1, 2, 3) AND ts_ns >= ? "
    "AND ts_ns < ?{pid} ORDER BY ts_ns LIMIT 1), (SELECT ts_ns FROM annotation_data "
    "WHERE ts_ns >= ? AND ts_ns < ?{pid} ORDER BY ts_ns LIMIT 1), "
    "(SELECT count(*) FROM nodes)"
)


@dataclass(frozen=True, slots=True)
class PullSpec:
    span: Bounds  # the window, parsed once (Bounds.parse)
    pid: int | None = None
    limit_per_node: int | None = None
    chains: str = "auto"  # auto | stored | computed | none, as fleetd.export.local


# A node's query or chains answer as the fan-out let it through (the keys asked for are
# there, every number fits: fleetd.fleet.fanout.checked), its rows not yet read: data
# from another machine until fleetd.export.fleet reads it, row by row, skipping a bad row
# with a note (one bad row costs that row, not the node). Hence ``object`` values.
class PullFacts(TypedDict):
    """What round 1 got from one node: its replies, as they came, and its notes."""

    names: dict[str, object]  # NAMES_SQL
    sessions: dict[str, object]  # SESSIONS_SQL
    stacks: dict[str, object]  # STACKS_SQL
    stored: dict[str, object] | None  # its stored chains (--chains auto or stored)
    computed: dict[str, object] | None  # GET /api/v1/chains, where nothing is stored
    notes: list[str]  # what was left out, and why
    placement: dict[str, object] | None  # PLACEMENT_SQL; None: no pod names


@dataclass(slots=True)
class NodePull:
    """What one node sent: its facts (replies of round 1) and its spool files."""

    outcome: NodeOutcome
    facts: PullFacts
    events: Path  # NDJSON as the node sent it
    rates: Path  # one JSON [ts_ns, dur_ns, calls] per line
    events_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    # The window as sent to the node, in its clock: [start, end).
    window: tuple[int, int] = (0, OPEN_END_NS)
    # Imported GPU work, where the node holds some in the window: one JSON row (a
    # GpuRow / AnnotationRow as the node sent it) per line; None when there is none.
    gpu: Path | None = None
    annotations: Path | None = None
    gpu_rows: int = 0
    annotation_rows: int = 0
    file_nodes: int = 1  # nodes in the file the agent serves (a merged file: several)

    @property
    def name(self) -> str:
        return self.outcome.name


def pull(opts: FleetOptions, spec: PullSpec, spool: Path
         ) -> tuple[FleetAnswer, list[NodePull]]:
    """Both rounds on every node; spool files go into the directory ``spool``."""
    from fleetd.runner import run_loop

    got: tuple[FleetAnswer, list[NodePull]] = run_loop(pull_async(opts, spec, spool))
    return got


async def pull_async(opts: FleetOptions, spec: PullSpec, spool: Path
                     ) -> tuple[FleetAnswer, list[NodePull]]:
    node_limit = max(0.05, opts.client.timeout_s * 0.9)

    got: dict[Target, PullFacts] = {}

    async def facts(client: FleetClient, t: Target, offset: int) -> list[dict[str, object]]:
        got[t] = facts = await _facts(client, t, spec, offset, node_limit)
        # The fan-out names a node from its replies: the names answer carries its name.
        return [facts["names"]]

    async with FleetClient(opts.client) as client:
        # needs_offset: the window goes to each node in its own clock.
        answer = await fan_out_work(opts, facts, needs_offset=True, client=client)
        raise_if_user_error(answer)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_bulk(client, answer, o, got[o.target], spec,
                                          spool / str(i), node_limit))
                     for i, o in enumerate(answer.answered)]
    pulls = [p for p in (t.result() for t in tasks) if p is not None]
    return answer, pulls


# ---- round 1: facts -----------------------------------------------------------------


def _sql(sql: str, params: list[Any], timeout_s: float, max_rows: int | None = None,
         max_bytes: int | None = None) -> Request:
    body: QueryBody = {"sql": sql, "params": params, "timeout_s": timeout_s}
    if max_rows is not None:
        body["max_rows"] = max_rows
    if max_bytes is not None:
        body["max_bytes"] = max_bytes
    return Request("POST", paths.QUERY, body=body, expect=("columns", "rows"))


async def _facts(client: FleetClient, t: Target, spec: PullSpec, offset: int,
                 node_limit: float) -> PullFacts:
    start, end = spec.span.in_clock(offset)
    asks = [_sql(NAMES_SQL, [], node_limit), _sql(SESSIONS_SQL, [], node_limit),
            _sql(STACKS_SQL, [start, end], node_limit, MAX_STACKS)]
    if spec.chains in ("auto", "stored"):
        sql = f"SELECT {STORED_CHAIN_COLUMNS} FROM chains WHERE {STORED_CHAIN_WINDOW}"
        params: list[Any] = [end, start]
        if spec.pid is not None:
            sql += " AND victim_pid = ?"
            params.append(spec.pid)
        asks.append(_sql(sql + " ORDER BY ts_ns, id", params, node_limit))
    replies = await send_all(client, t, asks)
    stored = replies[3] if len(replies) > 3 else None
    facts: PullFacts = {"names": replies[0], "sessions": replies[1], "stacks": replies[2],
                        "stored": stored, "computed": None, "notes": [], "placement": None}
    if spec.chains == "computed" or (spec.chains == "auto" and not (stored or {}).get("rows")):
        facts["computed"] = await _computed_chains(client, t, spec, offset, facts["notes"])
    facts["placement"] = await _placement(client, t, node_limit, facts["notes"])
    return facts


async def _placement(client: FleetClient, t: Target, node_limit: float, notes: list[str]
                     ) -> dict[str, object] | None:
    """The node's processes' pods and containers, to name them on the timeline as the
    local export does; None (no pods named) where its file predates them (schema < 5) or
    the question fails, which costs only the pod names."""
    try:
        [reply] = await send_all(client, t, [_sql(PLACEMENT_SQL, [], node_limit)])
    except NodeFailed as exc:
        text = exc.failure.text()
        if "no such column" not in text:
            notes.append(f"pod names left out: {text}")
        return None
    return reply


async def _computed_chains(client: FleetClient, t: Target, spec: PullSpec, offset_ns: int,
                           notes: list[str]) -> dict[str, object] | None:
    """The node's explain over the window: the expensive request, made only when nothing
    is stored. Chains are annotations, so a node whose analysis fails or runs too long
    still exports its events, with a note, instead of being dropped."""
    # The span every node is asked for: "the last 5m" fixed where it was parsed.
    params = spec.span.pinned().params(offset_ns)
    if spec.pid is not None:
        params["pid"] = str(spec.pid)
    ask = Request("GET", paths.CHAINS, params, expect=("chains",))
    # Stop early enough that the node's events still get their turn.
    budget = client.remaining() - min(1.0, client.opts.timeout_s * 0.1)
    try:
        async with asyncio.timeout(max(0.0, budget)):
            [reply] = await send_all(client, t, [ask])
    except NodeFailed as exc:
        notes.append(f"causal chains left out: {exc.failure.text()}")
        return None
    except TimeoutError:
        notes.append("causal chains left out: the node's analysis did not finish within "
                     "--timeout (raise it, narrow the window, or use --chains none)")
        return None
    return reply


# ---- round 2: bulk ------------------------------------------------------------------


async def _bulk(client: FleetClient, answer: FleetAnswer, o: NodeOutcome, facts: PullFacts,
                spec: PullSpec, base: Path, node_limit: float) -> NodePull | None:
    """Spool one node's events, rates and imported GPU work; a failure drops the node
    with a warning (a failure of the rates only costs the rates)."""
    start, end = spec.span.in_clock(answer.offset_ns(o))
    node = NodePull(o, facts, base.with_suffix(".events.ndjson"),
                    base.with_suffix(".rates.ndjson"), warnings=list(facts["notes"]),
                    window=(start, end))
    params = {"since": str(start), "until": str(end)}
    if spec.pid is not None:
        params["pid"] = str(spec.pid)
    if spec.limit_per_node is not None:
        params["limit"] = str(spec.limit_per_node)
    idle_s = client.opts.timeout_s
    try:
        with _spool(node.events) as f:
            node.events_bytes = await client.stream_to(o.target, paths.EVENTS, params,
                                                       f.write, idle_s)
    except NodeFailed as exc:
        _drop(answer, o, exc)
        return None
    log.info("node %s: %d bytes of events", o.name, node.events_bytes)
    with _spool(node.rates) as f:
        try:
            await _rates(client, o.target, spec, start, end, node_limit, f)
        except NodeFailed as exc:
            # Secondary data: the timeline is still right without this counter.
            node.warnings.append("calls/s from histograms left out: "
                                 f"{exc.failure.text()}")
    try:
        await _gpu(client, o.target, spec, node, base, node_limit)
    except NodeFailed as exc:
        # GPU rows are part of the timeline: never half a node.
        _drop(answer, o, exc)
        return None
    return node


def _spool(path: Path) -> BinaryIO:
    try:
        return open(path, "wb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise UsageError(f"cannot write a spool file in {str(path.parent)!r}: "
                         f"{exc.strerror}", "export to a directory you can write, with "
                         "room for the nodes' events") from None


def _drop(answer: FleetAnswer, o: NodeOutcome, exc: NodeFailed) -> None:
    """A node that failed half-way counts as not answered: the status and exit code say
    partial, and its warning says why."""
    o.replies, o.failure = None, exc.failure
    answer.warnings.append(NodeWarning(o.name, f"left out of the export: {exc.failure.text()}",
                                       exc.failure.kind))


async def _ask(client: FleetClient, t: Target, request: Request) -> dict[str, object]:
    """One request of the bulk round. The client's deadline is the facts round's; a page
    asked after a long events stream gets the whole ``--timeout`` of its own instead (the
    bulk round has only a limit on silence)."""
    client.restart_deadline()
    [reply] = await send_all(client, t, [request])
    return reply


async def _rates(client: FleetClient, t: Target, spec: PullSpec, start: int, end: int,
                 node_limit: float, out: BinaryIO) -> None:
    sql = RATES_SQL + (" AND pid = ?" if spec.pid is not None else "")
    sql += " GROUP BY ts_ns, dur_ns ORDER BY ts_ns"
    cursor = start - 1
    while True:
        params: list[Any] = [cursor, end, *([spec.pid] if spec.pid is not None else [])]
        reply = await _ask(client, t, _sql(sql, params, node_limit, RATES_PAGE))
        got = reply.get("rows")
        rows = [r for r in (got if isinstance(got, list) else [])
                if isinstance(r, list) and len(r) == 3]
        out.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        if not reply.get("truncated") or not rows or not isinstance(rows[-1][0], int):
            return
        cursor = rows[-1][0]


# ---- imported GPU work ------------------------------------------------------------------


async def _gpu(client: FleetClient, t: Target, spec: PullSpec, node: NodePull, base: Path,
               node_limit: float) -> None:
    """The node's GPU rows and annotated ranges in the window, each into a spool, when
    the probe finds any. NodeFailed when a request fails (the caller drops the node)."""
    start, end = node.window
    by_pid: list[Any] = [spec.pid] if spec.pid is not None else []
    probe = _sql(GPU_PROBE_SQL.format(pid=" AND pid = ?" if by_pid else ""),
                 [start, end, *by_pid, start, end, *by_pid], node_limit, 1)
    try:
        reply = await _ask(client, t, probe)
    except NodeFailed as exc:
        f = exc.failure
        if f.kind == "http" and f.code == "bad_query" and "no such table" in f.message:
            return  # a file from before imports (schema 1): nothing to pull
        raise
    rows = reply.get("rows")
    first = rows[0] if isinstance(rows, list) and rows else None
    if not isinstance(first, list) or len(first) != 3:
        raise NodeFailed(_bad(t, "about its GPU tables not one row of three values"))
    has_gpu, has_annotations, file_nodes = first
    if type(file_nodes) is int:
        node.file_nodes = file_nodes
    if has_gpu is not None:
        node.gpu = base.with_suffix(".gpu.ndjson")
        sql = GPU_SQL.format(pid=" AND g.pid = ?" if by_pid else "")
        node.gpu_rows = await _pages(client, t, sql, spec, node, node_limit, node.gpu,
                                     "GPU rows")
    if has_annotations is not None:
        node.annotations = base.with_suffix(".annotations.ndjson")
        sql = ANNOTATIONS_SQL.format(pid=" AND a.pid = ?" if by_pid else "")
        node.annotation_rows = await _pages(client, t, sql, spec, node, node_limit,
                                            node.annotations, "annotations")


async def _pages(client: FleetClient, t: Target, sql: str, spec: PullSpec, node: NodePull,
                 node_limit: float, path: Path, what: str) -> int:
    """Every row of ``sql`` in the window into the spool ``path``, page after page,
    keyset-paged on the last row's ``(ts_ns, id)``, each page written before the next is
    asked for; at most ``--limit-per-node`` rows. Returns how many rows were written.

    The rows are the node's, unchecked (the reader checks each one); only what paging
    needs is checked here: a page that does not move the cursor forward ends it with a
    warning, so a lying node cannot keep it turning."""
    start, end = node.window
    by_pid: list[Any] = [spec.pid] if spec.pid is not None else []
    limit = spec.limit_per_node
    cursor = (start, -1)
    sent = 0
    with _spool(path) as out:
        while limit is None or sent < limit:
            page = GPU_PAGE if limit is None else min(GPU_PAGE, limit - sent)
            params = [cursor[0], end, cursor[0], cursor[1], *by_pid]
            reply = await _ask(client, t, _sql(sql, params, node_limit, page, GPU_PAGE_BYTES))
            rows = reply.get("rows")
            if not isinstance(rows, list):
                raise NodeFailed(_bad(t, f"a page of its {what} without a list of rows"))
            rows = rows[:page]  # never more than asked for, whatever the node sends
            out.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            sent += len(rows)
            if not reply.get("truncated") or not rows:
                break
            last = rows[-1]
            nxt = ((last[1], last[0]) if isinstance(last, list) and len(last) > 1
                   and type(last[0]) is int and type(last[1]) is int else None)
            if nxt is None or nxt <= cursor or nxt[0] >= end:
                node.warnings.append(f"{what} after the first {sent} left out: the node's "
                                     "pages do not move forward in time")
                break
            cursor = nxt
    log.info("node %s: %d %s", t.name, sent, what)
    return sent


def _bad(t: Target, what: str) -> Failure:
    return Failure("bad_json", f"{t.address} answered {what}",
                   "is this a fleetd agent, and an unmodified one?")
