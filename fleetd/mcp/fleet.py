"""The MCP tools over a live fleet, through the fleet client's public operations.

Every answer starts with how the fan-out went: ``status`` (complete, partial, none),
how many nodes answered, one line per node warning (unreachable, timed out, refused,
renamed, clock skew above the threshold) and one skew line per node. An assistant reads
those first, so a missing node is never mistaken for a healthy one.

The fleet operations are synchronous (each runs on its thread's event loop), which suits
the worker threads the MCP SDK runs synchronous tools on; each thread keeps its client
and connections warm between calls (``FleetOptions.keep_warm``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, cast

from fleetd.analyze.distributed.collectives import host_chains
from fleetd.analyze.pernode.opstats import COLUMNS
from fleetd.analyze.reading.answers import GraphProcess, KernelRow, StackGroup
from fleetd.analyze.stacks import NOTE_NO_STACKS, op_code
from fleetd.errors import FleetdError, UsageError
from fleetd.fleet import queries
from fleetd.fleet.dispatch import fan_out
from fleetd.fleet.fanout import FleetAnswer, FleetOptions, Request, session
from fleetd.fleet.queries import QuerySpec
from fleetd.mcp.answers import (
    CompactChain,
    FanOut,
    FanOutPart,
    FleetChains,
    FleetExport,
    FleetGpu,
    FleetGraphs,
    FleetHealth,
    FleetOps,
    FleetOverview,
    FleetProfile,
    FleetQuery,
    FleetSql,
    FleetStacks,
    FleetStragglers,
    Head,
    HealthKey,
    HeavyStack,
    NodeHealth,
    NodeOverview,
    OverviewKey,
    TopOp,
    TopOpKey,
)
from fleetd.mcp.local import (
    compact_chain,
    compact_straggler,
    cut,
    default_export_dir,
    export_answer,
    export_path,
    marked_kernels,
)
from fleetd.mcp.safety import NAMES_KEY, mark_rows, untrusted
from fleetd.questions.catalog import CPU_STACKS, GPU, GRAPHS, STACKS
from fleetd.questions.spec import Answer, Params, Question
from fleetd.runner import run_loop
from fleetd.store.bounds import WHOLE, Bounds
from fleetd.wire import paths
from fleetd.wire import pods as wire_pods

if TYPE_CHECKING:
    from fleetd.fleet.hang import HangJson
    from fleetd.fleet.straggle import StragglerJson

log = logging.getLogger("fleetd.mcp.fleet")

ACTIONS = ("chains", "sql", "ops", "overview", "stragglers", "stacks", "graphs", "gpu")
STACK_FRAMES = 16  # frames per stack, innermost first (as get_stacks)
GRAPH_BUCKETS = 20  # timeline buckets per process (as graph_lifecycle)
STRAGGLER_CHAINS = 3  # chains shown as the "why" of each flagged node
BASE_KEYS = ("nodes", "warnings", "skew")  # said by header(), or the merged rows
HEALTH_KEYS: tuple[HealthKey, ...] = ("status", "version", "schema_version", "tracing",
                                      "uptime_s", "trace")
OVERVIEW_KEYS: tuple[OverviewKey, ...] = ("node", "events", "by_source", "lost_events",
                                          "chains", "verdict", "window", "warnings")
TOP_OP_KEYS: tuple[TopOpKey, ...] = ("op", "count", "total_ns", "p50_ns", "p99_ns")


@dataclass(slots=True)
class FleetBackend:
    opts: FleetOptions
    export_dir: Path = field(default_factory=default_export_dir)  # for export_timeline

    def __post_init__(self) -> None:
        # A server asks again and again: keep each worker thread's connections (and TLS
        # sessions) open between tool calls instead of a handshake per node per call.
        self.opts = dataclasses.replace(self.opts, keep_warm=True)

    def health(self) -> FleetHealth:
        """Every node's /health: reachable, version, tracing, probes and libraries."""
        answer: FleetAnswer = run_loop(fan_out(
            self.opts, lambda _off: [Request("GET", paths.HEALTH, expect=("status",))]))
        found = []
        for o in answer.outcomes:
            item: NodeHealth = {"node": o.name, "address": o.target.address}
            if o.replies:
                for k in HEALTH_KEYS:
                    if k in o.replies[0]:
                        item[k] = o.replies[0].get(k)
            else:
                item["status"] = "unreachable"
                item["error"] = o.failure.text() if o.failure else "no answer"
            found.append(item)
        return {**header(answer), "nodes": found}

    def query(self, action: str, window: Bounds, pid: int | None, sql: str | None,
              params: list[Any], max_rows: int, per_process: bool, top_n: int,
              evidence_n: int, op: str | None = None, pod: str | None = None,
              namespace: str | None = None) -> FleetQuery:
        if (pod or namespace) and action not in ("chains", "stragglers", "ops"):
            raise UsageError(f"pod/namespace select processes for actions chains, "
                             f"stragglers and ops, not {action!r}", "drop pod and namespace")
        if pod or namespace:
            if pid is not None:
                raise UsageError("pid and pod/namespace both select processes",
                                 "give one of them")
            try:
                wire_pods.read_params(wire_pods.params(pod, namespace))
            except ValueError as exc:
                raise UsageError(str(exc), "give a pod as NAME or NAMESPACE/NAME") from exc
        if action == "sql":
            if window.origin != WHOLE or pid is not None:
                raise UsageError("since/start/end/pid do not apply to action 'sql'",
                                 "put the condition in the SQL: WHERE ts_ns >= ? AND pid = ?")
            return self._sql(sql, params, max_rows)
        if sql:
            raise UsageError(f"sql is only for action 'sql', not {action!r}",
                             "drop sql, or use action 'sql'")
        if action == "ops":
            return self._ops(window, pid, per_process, top_n, pod, namespace)
        if action == "overview":
            return self._overview(window)
        if action in ("chains", "stragglers"):
            return self._explain(action, window, pid, top_n, evidence_n, pod, namespace)
        if op and action != "stacks":
            raise UsageError(f"op is only for action 'stacks', not {action!r}",
                             "drop op, or use action 'stacks'")
        if action == "stacks":
            return self._stacks(window, op, pid, top_n)
        if action == "graphs":
            return self._graphs(window, pid)
        if action == "gpu":
            return self._gpu(window, pid, top_n)
        raise UsageError(f"unknown action {action!r}", f"use one of: {', '.join(ACTIONS)}")

    def export(self, name: str | None, window: Bounds, pid: int | None,
               limit_per_node: int | None, chains: str) -> FleetExport:
        """Every node's timeline into one file, as ``fleetd export --nodes`` writes it."""
        from fleetd.export.fleet import FleetExportOptions, export_fleet

        path = export_path(self.export_dir, name, "fleet")
        done = export_fleet(self.opts, FleetExportOptions(window, pid, limit_per_node, chains),
                            path)
        log.info("exported %d event(s) from %d node(s) to %s",
                 sum(s.events for s in done.stats), len(done.stats), path)
        head = header(done.answer)
        answer = export_answer(path, done.stats, done.warnings)
        # One warnings list, the fan-out's first: a missing node matters most.
        return {**head, **answer, "warnings": head["warnings"] + answer["warnings"]}

    def hang(self, hang_after_s: float) -> FleetHang:
        """Every node's NCCL ranks polled once and judged as ``fleetd watch`` judges them
        (fleetd/fleet/hang.py): the rank a hung job waits for, or no hang."""
        from fleetd.fleet.hang import HangVerdict, poll

        async def go() -> tuple[FleetAnswer, HangVerdict]:
            async with session(self.opts.client, warm=True) as client:  # this thread's warm client
                return await poll(self.opts, client, hang_after_s)

        answer, verdict = run_loop(go())
        head = fan_out_of(answer)  # no skew: only ages are compared, no offset is sampled
        # Jobs and keys are marked as data (in copies), which changes their type.
        jobs: list[str] = []
        hangs = [_marked_hang(h, jobs) for h in verdict["hangs"]]
        groups: list[dict[str, object]] = [dict(g) for g in verdict["groups"]]
        for g in (*hangs, *groups):
            if g["matching"] == "torchrun":  # the key holds the job id
                jobs.append(str(g["key"]).rpartition("/")[0])
                g["key"] = untrusted(g["key"])
        # The verdict's sentences name jobs (traced environment values): quoted as data.
        out: FleetHang = {
            NAMES_KEY: jobs, "status": head["status"], "answered": head["answered"],
            "warnings": verdict["warnings"], "hang_status": verdict["status"],
            "hang_after_s": verdict["hang_after_s"], "verdict": verdict["verdict"],
            "hangs": hangs, "groups": groups, "ranks": verdict["ranks"],
            "nodes": verdict["nodes"]}
        if "stragglers" in verdict:
            out["stragglers"] = verdict["stragglers"]
        return out

    # ---- actions ----------------------------------------------------------------------

    def _sql(self, sql: str | None, params: list[Any], max_rows: int) -> FleetSql:
        if not sql:
            raise UsageError("action 'sql' needs sql", "pass one SELECT statement in sql")
        # Each node stops the SQL a little before our deadline, so a slow query comes back
        # as that node's own timeout error rather than a hung-up connection.
        node_limit = max(0.05, self.opts.client.timeout_s * 0.9)
        result = queries.query(self.opts, QuerySpec(sql, list(params), frozenset(), max_rows,
                                                    node_limit))
        truncated = bool(result.obj.get("truncated"))
        return {**header(result.answer), "columns": result.columns,
                "rows": mark_rows(result.rows), "row_count": len(result.rows),
                "truncated": truncated,
                "truncated_reason": [f"rows: a node stopped at max_rows={max_rows} or its "
                                     "byte limit; add LIMIT/WHERE or aggregate"]
                if truncated else []}

    def _ops(self, window: Bounds, pid: int | None, per_process: bool, top_n: int,
             pod: str | None = None, namespace: str | None = None) -> FleetOps:
        if pod or namespace:  # per process, each row with its pod (as fleetd ops --pod)
            at = COLUMNS.index("comm") + 1
            cols = [*COLUMNS[:at], "pod", *COLUMNS[at:]]
            per_process = True
        else:
            cols = [c for c in COLUMNS if per_process or c not in ("pid", "comm")]
        result = queries.ops(self.opts, window, pid, per_process, cols, "op", pod, namespace)
        rows = _mark_column(result.columns, result.rows, "comm")
        # Rows come node by node; the busiest ops of every node first reads better.
        total_i = result.columns.index("total_ns")
        rows.sort(key=lambda r: -int(r[total_i] or 0))
        return {**header(result.answer), "columns": result.columns, "rows": rows[:top_n],
                "rows_total": len(rows), **cut("rows", len(rows), top_n)}

    def _overview(self, window: Bounds) -> FleetOverview:
        result = queries.overview(self.opts, window)
        names = self._names()
        found = []
        for n in result.obj["nodes"]:
            item: NodeOverview = {}
            for k in OVERVIEW_KEYS:
                item[k] = n.get(k)
            sessions, tops = n.get("sessions"), n.get("top_ops")  # as the node sent them
            item["sessions"] = len(sessions) if isinstance(sessions, list | dict) else 0
            item["top_ops"] = []
            for r in (tops if isinstance(tops, list) else [])[:5]:
                if not isinstance(r, dict):
                    continue
                op: TopOp = {}
                for t in TOP_OP_KEYS:
                    op[t] = r.get(t)
                item["top_ops"].append(op)
            found.append(item)
        return {NAMES_KEY: names, **header(result.answer), "nodes": found}

    def _stacks(self, window: Bounds, op: str | None, pid: int | None, top_n: int
                ) -> FleetStacks:
        if op:
            op_code(op)  # refused here, once, rather than by every node
        result = queries.ask(self.opts, STACKS, window, STACKS.values(
            {"op": op, "pid": pid, "top_n": top_n, "frames_n": STACK_FRAMES}),
            queries.StacksFleetJson)
        # The nodes' stacks as they sent them (STACKS has no wire reader yet: only their
        # numbers were checked), handed on in the shape the tool declares.
        found = cast(list[StackGroup], result.obj["stacks"])
        bare = sum(got for n in result.obj["nodes"]
                   if isinstance(got := n.get("events_without_stack"), int))
        out: FleetStacks = {**header(result.answer), "op": op, "pid": pid,
                            "stacks": found[:top_n], "stacks_total": len(found),
                            **cut("stacks", len(found), top_n), "events_without_stack": bare}
        if not found:
            out["note"] = NOTE_NO_STACKS
        return out

    def _graphs(self, window: Bounds, pid: int | None) -> FleetGraphs:
        result = queries.ask(self.opts, GRAPHS, window,
                             GRAPHS.values({"pid": pid, "buckets": GRAPH_BUCKETS}),
                             queries.GraphsFleetJson)
        # As the nodes sent them (GRAPHS has no wire reader yet: only numbers checked).
        procs = cast(list[GraphProcess], result.obj["processes"])
        out: FleetGraphs = {**header(result.answer), "processes": procs}
        if not procs:
            out["note"] = "no CUDA graph call (capture, instantiate, launch) on any node"
        return out

    def _gpu(self, window: Bounds, pid: int | None, top_n: int) -> FleetGpu:
        """Every node's imported GPU ranks side by side (``fleetd gpu --nodes``), the
        slowest flagged; kernel names come from the profiled programs, marked as data."""
        from fleetd.analyze.gpu.device import NOTE_NO_GPU, THRESHOLDS

        result = queries.ask(self.opts, GPU, window,
                             GPU.values({"pid": pid, "thresholds": dict(THRESHOLDS)}),
                             queries.GpuFleetJson)
        obj = result.obj
        # The kernel rows as the nodes sent them (merged, numbers checked, not read).
        kernels = cast(list[KernelRow], obj.get("kernels") or [])
        ranks = obj.get("ranks") or []
        out: FleetGpu = {**header(result.answer), "ranks": ranks,
                         "straggler": obj.get("straggler"),
                         "kernels": marked_kernels(kernels[:top_n]),
                         "kernels_total": len(kernels), **cut("kernels", len(kernels), top_n)}
        if not ranks:
            out["note"] = NOTE_NO_GPU
        return out

    def ask(self, question: Question, win: Bounds, params: Params, node: str | None
            ) -> Answer:
        """A question of the registry, of every node (``node``: its rows only), led by
        how the fan-out went."""
        # Any question's answer: its own keys are handed on as they are.
        result = queries.ask(self.opts, question, win, params, queries.AskedJson)
        body = {k: v for k, v in result.obj.items() if k not in BASE_KEYS}
        if node is not None and question.rows:
            got = body.get(question.rows)  # the combine's rows, each tagged with its node
            body[question.rows] = [r for r in got if isinstance(r, dict)
                                   and r.get("node") == node] if isinstance(got, list) else []
        return {**header(result.answer), **body}

    def cpu_profile(self, win: Bounds, pid: int | None, tid: int | None, top_n: int,
                    stacks_n: int, node: str | None) -> FleetProfile:
        """Every node's on-CPU samples (``GET /api/v1/cpu_stacks``, as ``fleetd profile
        --nodes``) merged into one profile: top frames over the fleet, and the heaviest
        (node, thread, stack) counts, each with its node. ``node``: that node's only."""
        from fleetd.analyze.reading.profile import StackCount, profile

        result = queries.ask(self.opts, CPU_STACKS, win, CPU_STACKS.values({"pid": pid,
                                                                            "tid": tid}),
                             queries.CpuStacksFleetJson)
        counts = [StackCount(s["node"], s["pid"], s["tid"], tuple(s["frames"]),
                             s["samples"], s["gc"]) for s in result.obj["stacks"]
                  if node is None or s["node"] == node]
        summary = profile(counts, int(result.obj["period_ns"]), top_n)
        ranked = sorted(counts, key=lambda c: (-c.samples, c.node, c.tid, c.frames))
        heavy: list[HeavyStack] = [
            {"node": c.node, "pid": c.pid, "tid": c.tid,
             "frames": list(c.frames[:STACK_FRAMES * 2]), "samples": c.samples, "gc": c.gc}
            for c in ranked[:stacks_n]]
        out: FleetProfile = {
            **header(result.answer), "pid": pid, "tid": tid,
            "samples": summary["samples"], "gc_samples": summary["gc_samples"],
            "period_ns": summary["period_ns"], "on_cpu_ns": summary["on_cpu_ns"],
            "threads": summary["threads"], "stacks": heavy, "top": summary["top"],
            "stacks_total": len(ranked), **cut("stacks", len(ranked), stacks_n)}
        if summary["note"]:
            out["note"] = summary["note"]
        return out

    def _names(self) -> list[str]:
        """Every node's process and thread names: the verdicts quote them (best effort:
        a node that does not answer here just gets its names cleaned, not quoted)."""
        sql = ("SELECT comm FROM processes WHERE comm IS NOT NULL UNION "
               "SELECT comm FROM threads WHERE comm IS NOT NULL")
        try:
            got = queries.query(self.opts, QuerySpec(sql, [], frozenset(), 5000))
        except FleetdError as exc:
            log.info("process names not fetched: %s", exc)
            return []
        i = got.columns.index("comm") if "comm" in got.columns else -1
        return [str(r[i]) for r in got.rows if i >= 0 and r[i] is not None]

    def _explain(self, action: str, window: Bounds, pid: int | None, top_n: int,
                 evidence_n: int, pod: str | None = None, namespace: str | None = None
                 ) -> FleetChains | FleetStragglers:
        result = queries.explain(self.opts, window, pid, pod, namespace)
        obj = result.obj
        chains = obj.get("chains") or []
        if action == "chains":
            return {**header(result.answer), "verdicts": obj.get("verdicts") or {},
                    "chains": [compact_chain(c, evidence_n) for c in chains[:top_n]],
                    "chains_total": len(chains), **cut("chains", len(chains), top_n)}
        ranked = obj.get("stragglers") or []
        why: dict[str, list[CompactChain]] = {}
        for s in ranked:  # a rank named by collective arrival first: its node's host chains
            if s.get("flagged") and s["node"] not in why:
                mine = (host_chains(s["node"], s.get("pid"), chains, s.get("peers") or ())
                        if s.get("metric") == "collective_arrival"
                        else [c for c in chains if c.get("node") == s["node"]])
                why[s["node"]] = [compact_chain(c, evidence_n)
                                  for c in mine[:STRAGGLER_CHAINS]]
        return {**header(result.answer), "stragglers": [compact_straggler(s) for s in ranked],
                "flagged": list(why), "why": why, "verdicts": obj.get("verdicts") or {}}


class FleetHang(FanOut):
    """check_hang: the fan-out, then the poll's verdict (fleetd.fleet.hang.HangVerdict,
    its ``status`` as ``hang_status``) with every job and torchrun key marked as data;
    ``warnings``: the verdict's."""

    _traced_names: list[str]  # safety.NAMES_KEY: the jobs the answer names
    hang_status: str  # hang | ok
    hang_after_s: float
    verdict: str
    hangs: list[dict[str, object]]  # HangJson, its parties' jobs marked (_marked_hang)
    groups: list[dict[str, object]]  # GroupJson, a torchrun key marked
    ranks: int
    nodes: list[str]
    stragglers: NotRequired[list[StragglerJson]]


def _marked_hang(hang: HangJson, jobs: list[str]) -> dict[str, object]:
    """``hang`` with each culprit's and waiting rank's job marked as data (and added
    to ``jobs``, culprits first)."""
    out: dict[str, object] = dict(hang)
    for side in ("culprits", "waiting"):
        parties: list[dict[str, object]] = []
        for p in hang[side]:
            party: dict[str, object] = dict(p)
            job = p.get("job")
            if job:
                jobs.append(job)
                party["job"] = untrusted(job)
            parties.append(party)
        out[side] = parties
    return out


def fan_out_of(answer: FleetAnswer) -> FanOutPart:
    """How the fan-out went: its status, who answered, and a line per node warning."""
    return {"status": answer.status,
            "answered": f"{len(answer.answered)} of {len(answer.outcomes)} node(s)",
            "warnings": [f"node {w.node}: {w.error}" for w in answer.warnings]}


def header(answer: FleetAnswer) -> Head:
    """How the fan-out went, and each node's clock, first in every fleet answer."""
    skew = []
    for o in answer.outcomes:
        if o.skew is not None:
            fixed = " (timestamps corrected)" if answer.correct and o.skew.offset_ns else ""
            skew.append(f"{o.name}: {o.skew.describe()}{fixed}")
        elif o.ok:
            skew.append(f"{o.name}: clock offset unknown; timestamps not corrected")
    return {**fan_out_of(answer), "skew": skew}


def _mark_column(columns: list[str], rows: list[list[Any]], name: str) -> list[list[Any]]:
    if name not in columns:
        return [list(r) for r in rows]
    i = columns.index(name)
    return [[untrusted(v) if j == i and v is not None else v for j, v in enumerate(r)]
            for r in rows]

