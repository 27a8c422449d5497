"""The MCP tools over one database file (a node's, a copy, or a merged fleet file).

Every read goes through :class:`fleetd.store.guard.SafeDB`: a read-only connection
(``mode=ro`` + ``query_only``) with the read-only authorizer, under a deadline. Raw SQL
uses :meth:`SafeDB.query` (row/byte limits, ``truncated``); fleetd's own analysis runs
with :meth:`SafeDB.analyze`, so even its fixed SQL cannot write. Each call opens its own
connection: tools run on worker threads, and SafeDB is one-thread-at-a-time.

The functions return the answers of :mod:`fleetd.mcp.answers` (a registry question's
own answer for ``ask``); :mod:`fleetd.mcp.server` cleans, marks and size-caps them on
the way out (:mod:`fleetd.mcp.safety`).
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from fleetd.analyze.causes.chains import SEVERITY_RANK
from fleetd.analyze.facade import ANALYSIS_TIMEOUT_S, Analysis
from fleetd.analyze.pernode.opstats import COLUMNS
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers import (
    ChainDetail,
    ChainJson,
    GpuAnswer,
    KernelRow,
    OpRow,
    ProcessRow,
    StragglerEntry,
)
from fleetd.analyze.reading.data import json_or_text, nodes
from fleetd.analyze.reading.rows import (
    PLACEMENT_KEYS,
    OpColumn,
    ProcessTotals,
    ThreadRow,
    TimeColumn,
)
from fleetd.analyze.reading.window import Window, resolve
from fleetd.analyze.stacks import op_code
from fleetd.errors import UsageError
from fleetd.mcp.answers import (
    BreakdownProcess,
    BreakdownThread,
    BreakdownTool,
    ChainsTool,
    CompactChain,
    CpuProfileTool,
    Cut,
    ExportAnswer,
    GpuTool,
    MarkedKernel,
    Recording,
    SessionCount,
    SessionRow,
    SqlTool,
    StacksTool,
    ThreadsOmitted,
    TraceStats,
)
from fleetd.mcp.safety import mark_rows, untrusted
from fleetd.questions.catalog import GPU, GRAPHS, STACKS
from fleetd.questions.spec import Answer, Params, Question
from fleetd.security.private_dir import private_dir, user_cache_base
from fleetd.store.bounds import Bounds
from fleetd.store.catalog import SOURCES
from fleetd.store.db import open_reader
from fleetd.store.guard import Limits, SafeDB

log = logging.getLogger("fleetd.mcp.local")

T = TypeVar("T")
# Ceilings for run_sql; a call may lower them, never raise them.
SQL_LIMITS = Limits(timeout_s=10.0, max_rows=1000, max_bytes=1024 * 1024)
EXPORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}\.json(\.gz)?")
SHARE_KEYS: tuple[TimeColumn, ...] = ("running_ns", "runq_ns", "irq_ns", "d_state_ns",
                                      "sleeping_ns", "in_cuda_ns")


def default_export_dir() -> Path:
    """``$XDG_CACHE_HOME/fleetd/mcp-exports`` (``~/.cache/...``): under a directory this
    user owns, never a name in ``/tmp`` that another user could create first. It is
    made private (0700) when the first export is written (:func:`export_path`)."""
    return user_cache_base() / "fleetd" / "mcp-exports"


@dataclass(slots=True)
class LocalBackend:
    db: Path
    export_dir: Path = field(default_factory=default_export_dir)
    sql_limits: Limits = SQL_LIMITS
    analysis_timeout_s: float = ANALYSIS_TIMEOUT_S

    def __post_init__(self) -> None:
        # Refuse a missing, foreign or too-new file now, not on the first tool call.
        open_reader(self.db).close()

    def analyze(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with SafeDB(self.db) as db:
            return db.analyze(fn, self.analysis_timeout_s)

    # ---- tools ------------------------------------------------------------------------

    def trace_stats(self, win: Bounds, pid: int | None, per_process: bool,
                    source: str | None, top_n: int, node: str | None) -> TraceStats:
        if source is not None and source not in SOURCES:
            raise UsageError(f"unknown source {source!r}", f"use one of: {', '.join(SOURCES)}")

        def go(conn: sqlite3.Connection) -> TraceStats:
            a = Analysis.of(conn, win, node)
            names, w = a.node_names(), a.window
            rows = [r for r in a.op_stats(pid, per_process)
                    if source is None or r["source"] == source]
            cols = [c for c in COLUMNS if per_process or c not in ("pid", "comm")]
            return {
                "window": w.to_json(), "nodes": names,
                "events_by_source": _by_source(conn, w, pid, node),
                "sessions": _sessions(conn, node),
                "ops": {"columns": [*cols], "rows": [_op_row(r, cols) for r in rows[:top_n]]},
                "ops_total": len(rows), **cut("ops", len(rows), top_n),
                "warnings": list(w.warnings),
            }

        return self.analyze(go)

    def causal_chains(self, win: Bounds, pid: int | None, top_n: int, min_severity: str,
                      evidence_n: int, node: str | None, pod: str | None = None,
                      namespace: str | None = None) -> ChainsTool:
        bar = SEVERITY_RANK[min_severity]

        def go(conn: sqlite3.Connection) -> ChainsTool:
            a = Analysis.of(conn, win, node)
            a.node_names()
            report = a.explain(pid, pids=pods.selected(conn, pid, pod, namespace, ""))
            chains = [c for c in report["chains"] if SEVERITY_RANK[c["severity"]] <= bar]
            counts = {s: sum(1 for c in report["chains"] if c["severity"] == s)
                      for s in SEVERITY_RANK}
            out: ChainsTool = {
                "_traced_names": process_names(conn),
                "verdict": report["verdict"], "quiet": report["quiet"],
                "window": report["window"], "nodes": report["nodes"], "counts": counts,
                "chains": [compact_chain(c, evidence_n) for c in chains[:top_n]],
                "chains_total": len(chains), **cut("chains", len(chains), top_n),
                "warnings": report["warnings"]}
            arrivals = a.collectives()  # NCCL collectives: the rank the others wait for
            if len(report["nodes"]) > 1 or arrivals["stragglers"]:
                # A merged file: rank its nodes as the fleet client ranks live ones.
                out["stragglers"] = [compact_straggler(s)
                                     for s in a.stragglers(report["chains"], arrivals)]
            return out

        return self.analyze(go)

    def latency_breakdown(self, win: Bounds, pid: int | None, top_n: int, threads_n: int,
                          node: str | None, pod: str | None = None,
                          namespace: str | None = None) -> BreakdownTool:
        def go(conn: sqlite3.Connection) -> BreakdownTool:
            a = Analysis.of(conn, win, node)
            a.node_names()
            w = a.window
            procs = a.breakdown(pid, pods.selected(conn, pid, pod, namespace, ""))
            return {"window": w.to_json(),
                    "processes": [_breakdown(p, threads_n) for p in procs[:top_n]],
                    "processes_total": len(procs), **cut("processes", len(procs), top_n),
                    "warnings": list(w.warnings)}

        return self.analyze(go)

    def stacks(self, win: Bounds, op: str | None, pid: int | None, top_n: int,
               frames_n: int, node: str | None) -> StacksTool:
        if op:
            op_code(op)  # an unknown op is refused before the file is opened
        got = self.ask(STACKS, win, STACKS.values(
            {"op": op, "pid": pid, "top_n": top_n, "frames_n": frames_n}), node)
        found = got["stacks"]
        out: StacksTool = {
            "window": got["window"], "op": op, "pid": pid, "stacks": found[:top_n],
            "stacks_total": len(found), **cut("stacks", len(found), top_n),
            "events_without_stack": got["events_without_stack"], "warnings": got["warnings"]}
        if got.get("note"):
            out["note"] = got["note"]
        return out

    def cpu_profile(self, win: Bounds, pid: int | None, tid: int | None, top_n: int,
                    stacks_n: int, node: str | None) -> CpuProfileTool:
        """The on-CPU profile (fleetd profile): top frames, and the heaviest stacks."""
        from fleetd.analyze.reading.profile import StackCount, profile, stack_counts, stacks_json

        def go(conn: sqlite3.Connection) -> CpuProfileTool:
            a = Analysis.of(conn, win, node)
            counts: list[StackCount] = []
            period = 0
            for sl in a.slices:
                got, p = stack_counts(sl.conn, sl.node, sl.window, pid, tid)
                counts += got
                period = max(period, p)
            summary = profile(counts, period, top_n)
            heavy, left = stacks_json(counts, stacks_n, 32)
            total = len(heavy) + left
            out: CpuProfileTool = {
                "window": a.window.to_json(), "pid": pid, "tid": tid,
                "samples": summary["samples"], "gc_samples": summary["gc_samples"],
                "period_ns": summary["period_ns"], "on_cpu_ns": summary["on_cpu_ns"],
                "threads": summary["threads"], "stacks": heavy, "top": summary["top"],
                "stacks_total": total, **cut("stacks", total, stacks_n),
                "warnings": list(a.window.warnings)}
            if summary["note"]:
                out["note"] = summary["note"]
            return out

        return self.analyze(go)

    def run_sql(self, sql: str, params: list[Any], max_rows: int, timeout_s: float
                ) -> SqlTool:
        limits = self.sql_limits.lowered(timeout_s=timeout_s, max_rows=max_rows)
        with SafeDB(self.db, self.sql_limits) as db:
            res = db.query(sql, params, limits)
        return {"columns": res.columns, "rows": mark_rows(res.rows), "row_count": len(res.rows),
                "truncated": res.truncated,
                "truncated_reason": [_why_truncated(res.truncated_reason, limits)]
                if res.truncated else [],
                "elapsed_ms": round(res.elapsed_ms, 2), "warnings": res.warnings}

    def graphs(self, win: Bounds, pid: int | None, buckets: int, node: str | None
               ) -> Answer:
        return self.ask(GRAPHS, win, GRAPHS.values({"pid": pid, "buckets": buckets}), node)

    def gpu(self, win: Bounds, pid: int | None, steps: bool, top_n: int,
            node: str | None) -> GpuTool:
        """The GPU breakdown of imported timelines, kernel table cut to ``top_n``; kernel
        names come from the profiled program's file, so they are marked as data."""
        # The GPU question's answer over a file is the analyzer's own: a GpuAnswer.
        got = cast(GpuAnswer, self.ask(GPU, win, GPU.values({"pid": pid, "steps": steps}),
                                       node))
        return compact_gpu(got, top_n)

    def ask(self, question: Question, win: Bounds, params: Params, node: str | None
            ) -> Answer:
        """A question of the registry, of this file (``node``: that node of it): the
        question's own answer (its ``shape``)."""
        def go(conn: sqlite3.Connection) -> Answer:
            a = Analysis.of(conn, win if question.windowed else Bounds(), node)
            a.node_names()
            return dict(question.answer_locally(a, params))

        return self.analyze(go)

    def recording(self) -> Recording:
        """What the file says about how it was recorded (for get_check)."""
        def go(conn: sqlite3.Connection) -> Recording:
            return {"db": str(self.db), "nodes": [n.name for n in nodes(conn)],
                    "sessions": _session_details(conn)}

        return self.analyze(go)

    def export(self, name: str | None, win: Bounds, pid: int | None,
               limit_per_node: int | None, chains: str) -> ExportAnswer:
        from fleetd.export.local import LocalOptions, local_traces
        from fleetd.export.output import open_output
        from fleetd.export.perfetto import write_trace

        path = export_path(self.export_dir, name, self.db.stem)
        conn = open_reader(self.db)
        try:
            w = resolve(conn, win)
            traces, origin, warnings = local_traces(conn, LocalOptions(w, pid, limit_per_node,
                                                                       chains))
            meta = {"source": self.db.name, "window": w.to_json()}
            with open_output(path) as stream:
                stats = write_trace(traces, stream, origin_ns=origin, meta=meta)
        finally:
            conn.close()
        log.info("exported %d event(s) to %s", sum(st.events for st in stats), path)
        return export_answer(path, stats, warnings)


# ---- helpers shared with the fleet backend ---------------------------------------------------


def _without_flame(detail: ChainDetail) -> ChainDetail:
    """A chain's detail less its flame graph's stacks (the HTML page's)."""
    out = detail.copy()
    out.pop("flame", None)
    return out


def compact_chain(c: ChainJson, evidence_n: int) -> CompactChain:
    """A chain as explain gives it, minus internal keys, with short lists."""
    evidence = c["evidence"]
    out: CompactChain = {
        "id": c["id"], "node": c["node"], "severity": c["severity"],
        "root_cause": c["root_cause"], "summary": c["summary"], "op": c["op"],
        "victim": c["victim"], "culprit": c["culprit"], "explained": c["explained"],
        "impact": c["impact"], "ts_ns": c["ts_ns"], "dur_ns": c["dur_ns"],
        "time": c["time"],
        # The flame graph's stacks are the HTML page's; get_cpu_profile gives the stacks.
        "detail": _without_flame(c["detail"]),
        "fixes": c["fixes"], "culprits": c["culprits"][:3],
        "evidence": evidence[:evidence_n]}
    if len(evidence) > evidence_n:
        out["evidence_omitted"] = len(evidence) - evidence_n
    return out


def compact_gpu(report: GpuAnswer, top_n: int) -> GpuTool:
    """``fleetd gpu``'s report for a model: the kernel table cut to ``top_n`` rows (the
    cut reported), kernel names marked as untrusted data."""
    kernels = report["kernels"]
    out: GpuTool = {**report, "kernels": marked_kernels(kernels[:top_n]),
                    "kernels_shown": {"kernels_total": len(kernels),
                                      **cut("kernels", len(kernels), top_n)}}
    return out


def marked_kernels(kernels: list[KernelRow]) -> list[MarkedKernel]:
    """Kernel rows with their names (the profiled program's) marked as data."""
    return [{**k, "name": untrusted(k["name"])} for k in kernels]


def compact_straggler(s: StragglerEntry) -> StragglerEntry:
    """A straggler entry; the per-metric detail only for flagged nodes (it is long)."""
    if s.get("flagged"):
        return s
    out = s.copy()
    out.pop("metrics", None)
    return out


def export_path(directory: Path, name: str | None, stem: str) -> Path:
    """A new file in the export directory: never elsewhere, never over an existing one."""
    if name is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", stem)[:60] or "fleetd"
        name = f"{safe}-{stamp}-{time.time_ns() % 10**6:06d}.json.gz"
    if not EXPORT_NAME.fullmatch(name):
        raise UsageError(f"export name {name!r} is not allowed",
                         "give a plain file name ending in .json or .json.gz (letters, digits,"
                         " '.', '_', '-'); files are written into the server's export directory")
    private_export_dir(directory)
    path = directory / name
    if os.path.lexists(path):
        raise UsageError(f"{path} exists already", "choose another name; exports never "
                         "overwrite a file")
    return path


def private_export_dir(directory: Path) -> Path:
    """The export directory, made (0700) or checked: a real directory of this user's
    that nobody else may write, under one the user owns (the per-user cache for the
    default; the parent of a ``--export-dir``). A symlink, another owner or group/other
    write is refused with one line (fleetd/security/private_dir.py)."""
    default = default_export_dir()
    base = user_cache_base() if directory == default else None
    return private_dir(directory, base=base, what="MCP export directory",
                       hint="remove it, or start fleetd mcp with --export-dir DIR (a "
                       "directory of yours that nobody else can write)")


def export_answer(path: Path, stats: list[Any], warnings: list[str]) -> ExportAnswer:
    return {
        "path": str(path), "bytes": path.stat().st_size,
        "format": "Chrome Trace Event JSON" + (" (gzip)" if path.name.endswith(".gz") else ""),
        "open_with": "https://ui.perfetto.dev (or chrome://tracing)",
        "nodes": [{"node": s.name, "events": s.events, "chains": s.chains, "arrows": s.flows}
                  for s in stats],
        "events": sum(s.events for s in stats), "warnings": warnings}


def cut(what: str, total: int, limit: int) -> Cut:
    """Whether ``top_n`` hid some of ``total`` (the answer says ``<what>_total`` just
    before), and how to see them."""
    if total <= limit:
        return {"truncated": False}
    return {"truncated": True,
            "truncated_reason": [f"top_n: {limit} of {total} {what} shown; raise top_n for more"]}


def _op_row(r: OpRow, cols: list[OpColumn]) -> list[Any]:
    comm = r["comm"]
    return [untrusted(comm) if c == "comm" and comm is not None else r[c] for c in cols]


def process_names(conn: sqlite3.Connection, limit: int = 5000) -> list[str]:
    """Every process and thread name recorded, for quoting inside fleetd's sentences."""
    return [str(r[0]) for r in conn.execute(
        "SELECT comm FROM process_data WHERE comm IS NOT NULL UNION "
        "SELECT comm FROM task_data WHERE comm IS NOT NULL LIMIT ?", (limit,))]


def _why_truncated(reason: str | None, limits: Limits) -> str:
    if reason == "rows":
        return f"rows: stopped at max_rows={limits.max_rows}; add LIMIT/WHERE or aggregate"
    return f"bytes: stopped at {limits.max_bytes} bytes of values; select fewer columns"


def _by_source(conn: sqlite3.Connection, w: Window, pid: int | None,
               node: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in nodes(conn, node):
        sql = ("SELECT o.source, count(*) FROM event_data e JOIN ops o ON o.code = e.op "
               "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ?")
        params: list[int] = [w.start_ns, w.end_ns, n.lo, n.hi]
        if pid is not None:
            sql += " AND e.pid = ?"
            params.append(pid)
        for source, count in conn.execute(sql + " GROUP BY o.source", params):
            out[str(source)] = out.get(str(source), 0) + int(count)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _sessions(conn: sqlite3.Connection, node: str | None) -> list[SessionCount]:
    sql = ("SELECT node, count(*), sum(lost_events), sum(dropped_stacks), sum(sampled_out) "
           "FROM sessions" + (" WHERE node = ?" if node else "") + " GROUP BY node")
    return [{"node": n, "sessions": c, "lost_events": lost or 0, "dropped_stacks": ds or 0,
             "sampled_out": so or 0}
            for n, c, lost, ds, so in conn.execute(sql, (node,) if node else ())]


def _session_details(conn: sqlite3.Connection) -> list[SessionRow]:
    cols = ("id", "node", "host", "kernel", "started_ns", "ended_ns", "tool_version",
            "headers_route", "lost_events", "dropped_stacks", "sampled_out", "drops",
            "targets", "rank", "world_size")
    rows = conn.execute(f"SELECT {', '.join(cols)} FROM sessions ORDER BY started_ns "
                        "DESC LIMIT 20").fetchall()
    return [{"id": r[0], "node": r[1], "host": r[2], "kernel": r[3], "started_ns": r[4],
             "ended_ns": r[5], "tool_version": r[6], "headers_route": r[7],
             "lost_events": r[8], "dropped_stacks": r[9], "sampled_out": r[10],
             "drops": json_or_text(r[11]), "targets": r[12], "rank": r[13],
             "world_size": r[14]} for r in rows]


def _breakdown(p: ProcessRow, threads_n: int) -> BreakdownProcess:
    totals: ProcessTotals = {  # the row's own keys, in its order, less threads and ops
        "node": p["node"], "pid": p["pid"], "comm": p["comm"],
        "running_ns": p["running_ns"], "runq_ns": p["runq_ns"], "irq_ns": p["irq_ns"],
        "d_state_ns": p["d_state_ns"], "sleeping_ns": p["sleeping_ns"],
        "lock_ns": p["lock_ns"], "data_ns": p["data_ns"], "timer_ns": p["timer_ns"],
        "gpu_sync_ns": p["gpu_sync_ns"], "other_ns": p["other_ns"],
        "off_cpu_ns": p["off_cpu_ns"], "in_cuda_ns": p["in_cuda_ns"],
        "reclaim_ns": p["reclaim_ns"], "lock_spin_ns": p["lock_spin_ns"],
        "switches": p["switches"], "hist_off_cpu": p["hist_off_cpu"],
        "hist_runq": p["hist_runq"], "page_allocs": p["page_allocs"],
        "block_io": p["block_io"]}
    for k in PLACEMENT_KEYS:
        if k in p:
            totals[k] = p[k]
    threads = p["threads"]
    more: ThreadsOmitted = ({"threads_omitted": len(threads) - threads_n}
                            if len(threads) > threads_n else {})
    return {**totals, "threads": [_thread(t) for t in threads[:threads_n]], **more}


def _thread(t: ThreadRow) -> BreakdownThread:
    wall = t["wall_ns"] or 1
    # Shares of the thread's wall time make the split readable at a glance; in_cuda
    # overlaps the others (a thread inside a CUDA call may be running or waiting).
    return {**t, "share_of_wall": {k.removesuffix("_ns"): round(t[k] / wall, 4)
                                   for k in SHARE_KEYS}}


