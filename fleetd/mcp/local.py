"""The MCP tools over one database file (a node's, a copy, or a merged fleet file).

Every read goes through :class:`fleetd.store.guard.SafeDB`: a read-only connection
(``mode=ro`` + ``query_only``) with the read-only authorizer, under a deadline. Raw SQL
uses :meth:`SafeDB.query` (row/byte limits, ``truncated``); fleetd's own analysis runs
with :meth:`SafeDB.analyze`, so even its fixed SQL cannot write. Each call opens its own
connection: tools run on worker threads, and SafeDB is one-thread-at-a-time.

The functions return plain dicts; :mod:`fleetd.mcp.server` cleans, marks and size-caps
them on the way out (:mod:`fleetd.mcp.safety`).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from fleetd.analyze.breakdown import process_rows, thread_breakdown
from fleetd.analyze.chains import SEVERITY_RANK
from fleetd.analyze.data import comms, effective_span, in_list, name_of, nodes, tasks
from fleetd.analyze.explain import explain, profile
from fleetd.analyze.opstats import COLUMNS, op_stats
from fleetd.analyze.window import Window, resolve_window
from fleetd.errors import UsageError
from fleetd.fleet.stragglers import rank
from fleetd.mcp.graphs import graph_lifecycle
from fleetd.mcp.safety import NAMES_KEY, mark_rows, untrusted
from fleetd.store.catalog import BY_NAME, SOURCES
from fleetd.store.db import open_reader
from fleetd.store.guard import Limits, SafeDB

log = logging.getLogger("fleetd.mcp.local")

T = TypeVar("T")
ANALYSIS_TIMEOUT_S = 60.0  # as the agent's analysis endpoints
# Ceilings for run_sql; a call may lower them, never raise them.
SQL_LIMITS = Limits(timeout_s=10.0, max_rows=1000, max_bytes=1024 * 1024)
EXPORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}\.json(\.gz)?")
SHARE_KEYS = ("running_ns", "runq_ns", "irq_ns", "d_state_ns", "sleeping_ns", "in_cuda_ns")


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """The window as an assistant gave it: ``since`` or ``start``/``end``, or nothing."""

    since: str | None = None
    start: str | None = None
    end: str | None = None

    def resolve(self, conn: sqlite3.Connection) -> Window:
        return resolve_window(conn, self.since or None, self.start or None, self.end or None)


def default_export_dir() -> Path:
    # Per user: the directory is made 0700, so another user's would not be writable.
    return Path(tempfile.gettempdir()) / f"fleetd-mcp-exports-{os.getuid()}"


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

    def trace_stats(self, win: WindowSpec, pid: int | None, per_process: bool,
                    source: str | None, top_n: int, node: str | None) -> dict[str, Any]:
        if source is not None and source not in SOURCES:
            raise UsageError(f"unknown source {source!r}", f"use one of: {', '.join(SOURCES)}")

        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            names = _node_names(conn, node)
            w = win.resolve(conn)
            rows = [r for r in op_stats(conn, w, pid, per_process, node)
                    if source is None or r["source"] == source]
            cols = [c for c in COLUMNS if per_process or c not in ("pid", "comm")]
            return {
                "window": w.to_json(), "nodes": names,
                "events_by_source": _by_source(conn, w, pid, node),
                "sessions": _sessions(conn, node),
                "ops": {"columns": cols, "rows": [_op_row(r, cols) for r in rows[:top_n]]},
                **shown("ops", len(rows), top_n),
                "warnings": list(w.warnings),
            }

        return self.analyze(go)

    def causal_chains(self, win: WindowSpec, pid: int | None, top_n: int, min_severity: str,
                      evidence_n: int, node: str | None) -> dict[str, Any]:
        bar = SEVERITY_RANK[min_severity]

        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            _node_names(conn, node)
            w = win.resolve(conn)
            report = explain(conn, w, pid, node=node)
            chains = [c for c in report["chains"] if SEVERITY_RANK[c["severity"]] <= bar]
            counts = {s: sum(1 for c in report["chains"] if c["severity"] == s)
                      for s in SEVERITY_RANK}
            out = {NAMES_KEY: process_names(conn),
                   "verdict": report["verdict"], "quiet": report["quiet"],
                   "window": report["window"], "nodes": report["nodes"], "counts": counts,
                   "chains": [compact_chain(c, evidence_n) for c in chains[:top_n]],
                   **shown("chains", len(chains), top_n), "warnings": report["warnings"]}
            if len(report["nodes"]) > 1:
                # A merged file: rank its nodes as the fleet client ranks live ones.
                profiles = {n: profile(conn, w, n) for n in report["nodes"]}
                out["stragglers"] = [compact_straggler(s)
                                     for s in rank(profiles, {}, report["chains"])]
            return out

        return self.analyze(go)

    def latency_breakdown(self, win: WindowSpec, pid: int | None, top_n: int, threads_n: int,
                          node: str | None) -> dict[str, Any]:
        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            _node_names(conn, node)
            w = win.resolve(conn)
            procs: list[dict[str, Any]] = []
            for n in nodes(conn, node):
                names, _ = comms(conn, n)
                span = effective_span(conn, n, w)
                threads = thread_breakdown(conn, n, w, span, tasks(conn, n), names, pid)
                procs += process_rows(threads, conn, n, w)
            procs.sort(key=lambda p: (-int(p["in_cuda_ns"]), -int(p["off_cpu_ns"])))
            return {"window": w.to_json(),
                    "processes": [_breakdown(p, threads_n) for p in procs[:top_n]],
                    **shown("processes", len(procs), top_n), "warnings": list(w.warnings)}

        return self.analyze(go)

    def stacks(self, win: WindowSpec, op: str | None, pid: int | None, top_n: int,
               frames_n: int, node: str | None) -> dict[str, Any]:
        op_code = _op_code(op) if op else None

        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            _node_names(conn, node)
            w = win.resolve(conn)
            found: list[dict[str, Any]] = []
            bare = 0
            for n in nodes(conn, node):
                where, params = _event_filter(w, n.lo, n.hi, op_code, pid)
                names, _ = comms(conn, n)
                found += [dict(s, node=n.name) for s in
                          _stack_groups(conn, where, params, top_n, frames_n, names)]
                bare += conn.execute(f"SELECT count(*) FROM event_data WHERE {where} "
                                     "AND stack = 0", params).fetchone()[0]
            found.sort(key=lambda s: -int(s["total_ns"]))
            out: dict[str, Any] = {
                "window": w.to_json(), "op": op, "pid": pid, "stacks": found[:top_n],
                **shown("stacks", len(found), top_n), "events_without_stack": bare,
                "warnings": list(w.warnings)}
            if not found:
                out["note"] = ("no stack was recorded for these events: the tracer stores the "
                               "user stack of emitted CUDA calls only, and only where it could "
                               "walk it; try another op or pid, or drop the filters")
            return out

        return self.analyze(go)

    def run_sql(self, sql: str, params: list[Any], max_rows: int, timeout_s: float
                ) -> dict[str, Any]:
        limits = self.sql_limits.lowered(timeout_s=timeout_s, max_rows=max_rows)
        with SafeDB(self.db, self.sql_limits) as db:
            res = db.query(sql, params, limits)
        return {"columns": res.columns, "rows": mark_rows(res.rows), "row_count": len(res.rows),
                "truncated": res.truncated,
                "truncated_reason": [_why_truncated(res.truncated_reason, limits)]
                if res.truncated else [],
                "elapsed_ms": round(res.elapsed_ms, 2), "warnings": res.warnings}

    def graphs(self, win: WindowSpec, pid: int | None, buckets: int, node: str | None
               ) -> dict[str, Any]:
        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            _node_names(conn, node)
            out = graph_lifecycle(conn, win.resolve(conn), pid, node, buckets)
            if not out["processes"]:
                out["note"] = "no CUDA graph call (capture, instantiate, launch) in the window"
            return out

        return self.analyze(go)

    def recording(self) -> dict[str, Any]:
        """What the file says about how it was recorded (for get_check)."""
        def go(conn: sqlite3.Connection) -> dict[str, Any]:
            return {"db": str(self.db), "nodes": _node_names(conn, None),
                    "sessions": _session_details(conn)}

        return self.analyze(go)

    def export(self, name: str | None, win: WindowSpec, pid: int | None,
               limit_per_node: int | None, chains: str) -> dict[str, Any]:
        from fleetd.export.local import LocalOptions, local_traces
        from fleetd.export.output import open_output
        from fleetd.export.perfetto import write_trace

        path = export_path(self.export_dir, name, self.db.stem)
        conn = open_reader(self.db)
        try:
            w = win.resolve(conn)
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


def compact_chain(c: dict[str, Any], evidence_n: int) -> dict[str, Any]:
    """A chain as explain gives it, minus internal keys, with short lists."""
    out = {k: v for k, v in c.items() if k not in ("key", "evidence", "culprits")}
    culprits = list(c.get("culprits") or [])
    out["culprits"] = culprits[:3]
    evidence = list(c.get("evidence") or [])
    out["evidence"] = evidence[:evidence_n]
    if len(evidence) > evidence_n:
        out["evidence_omitted"] = len(evidence) - evidence_n
    return out


def compact_straggler(s: dict[str, Any]) -> dict[str, Any]:
    """A straggler entry; the per-metric detail only for flagged nodes (it is long)."""
    return s if s.get("flagged") else {k: v for k, v in s.items() if k != "metrics"}


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
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    if path.exists():
        raise UsageError(f"{path} exists already", "choose another name; exports never "
                         "overwrite a file")
    return path


def export_answer(path: Path, stats: list[Any], warnings: list[str]) -> dict[str, Any]:
    return {
        "path": str(path), "bytes": path.stat().st_size,
        "format": "Chrome Trace Event JSON" + (" (gzip)" if path.name.endswith(".gz") else ""),
        "open_with": "https://ui.perfetto.dev (or chrome://tracing)",
        "nodes": [{"node": s.name, "events": s.events, "chains": s.chains, "arrows": s.flows}
                  for s in stats],
        "events": sum(s.events for s in stats), "warnings": warnings}


def shown(what: str, total: int, limit: int) -> dict[str, Any]:
    """``<what>_total``, and the truncation flag when ``top_n`` hid some."""
    if total <= limit:
        return {f"{what}_total": total, "truncated": False}
    return {f"{what}_total": total, "truncated": True,
            "truncated_reason": [f"top_n: {limit} of {total} {what} shown; raise top_n for more"]}


def _op_row(r: dict[str, Any], cols: list[str]) -> list[Any]:
    return [untrusted(r[c]) if c == "comm" and r[c] is not None else r[c] for c in cols]


def process_names(conn: sqlite3.Connection, limit: int = 5000) -> list[str]:
    """Every process and thread name recorded, for quoting inside fleetd's sentences."""
    return [str(r[0]) for r in conn.execute(
        "SELECT comm FROM process_data WHERE comm IS NOT NULL UNION "
        "SELECT comm FROM task_data WHERE comm IS NOT NULL LIMIT ?", (limit,))]


def _why_truncated(reason: str | None, limits: Limits) -> str:
    if reason == "rows":
        return f"rows: stopped at max_rows={limits.max_rows}; add LIMIT/WHERE or aggregate"
    return f"bytes: stopped at {limits.max_bytes} bytes of values; select fewer columns"


def _node_names(conn: sqlite3.Connection, node: str | None) -> list[str]:
    found = [n.name for n in nodes(conn, node)]
    if node is not None and not found:
        raise UsageError(f"no node {node!r} in this database",
                         f"nodes here: {', '.join(n.name for n in nodes(conn)) or 'none'}")
    return found


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


def _sessions(conn: sqlite3.Connection, node: str | None) -> list[dict[str, Any]]:
    sql = ("SELECT node, count(*), sum(lost_events), sum(dropped_stacks), sum(sampled_out) "
           "FROM sessions" + (" WHERE node = ?" if node else "") + " GROUP BY node")
    return [{"node": n, "sessions": c, "lost_events": lost or 0, "dropped_stacks": ds or 0,
             "sampled_out": so or 0}
            for n, c, lost, ds, so in conn.execute(sql, (node,) if node else ())]


def _session_details(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    cols = ("id", "node", "host", "kernel", "started_ns", "ended_ns", "tool_version",
            "headers_route", "lost_events", "dropped_stacks", "sampled_out", "drops",
            "targets", "rank", "world_size")
    rows = conn.execute(f"SELECT {', '.join(cols)} FROM sessions ORDER BY started_ns "
                        "DESC LIMIT 20").fetchall()
    out = []
    for r in rows:
        d = dict(zip(cols, r, strict=True))
        d["drops"] = _json_or_text(d["drops"])
        out.append(d)
    return out


def _json_or_text(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _breakdown(p: dict[str, Any], threads_n: int) -> dict[str, Any]:
    out = {k: v for k, v in p.items() if k not in ("threads", "top_ops")}
    threads = list(p["threads"])
    out["threads"] = [_thread(t) for t in threads[:threads_n]]
    if len(threads) > threads_n:
        out["threads_omitted"] = len(threads) - threads_n
    return out


def _thread(t: dict[str, Any]) -> dict[str, Any]:
    wall = int(t["wall_ns"]) or 1
    out = dict(t)
    # Shares of the thread's wall time make the split readable at a glance; in_cuda
    # overlaps the others (a thread inside a CUDA call may be running or waiting).
    out["share_of_wall"] = {k.removesuffix("_ns"): round(int(t[k]) / wall, 4)
                            for k in SHARE_KEYS}
    return out


def _op_code(op: str) -> int:
    found = BY_NAME.get(op)
    if found is None:
        close = difflib.get_close_matches(op, BY_NAME, n=3)
        hint = (f"did you mean {', '.join(close)}?" if close
                else "CUDA ops are named like cudaLaunchKernel, cuLaunchKernel, "
                "cudaStreamSynchronize; SELECT name FROM ops lists them all")
        raise UsageError(f"unknown op {op!r}", hint)
    return found.code


def _event_filter(w: Window, lo: int, hi: int, op_code: int | None, pid: int | None
                  ) -> tuple[str, list[int]]:
    where = "ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?"
    params = [w.start_ns, w.end_ns, lo, hi]
    if op_code is not None:
        where += " AND op = ?"
        params.append(op_code)
    if pid is not None:
        where += " AND pid = ?"
        params.append(pid)
    return where, params


def _stack_groups(conn: sqlite3.Connection, where: str, params: list[int], top_n: int,
                  frames_n: int, names: dict[int, str]) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT stack, count(*), sum(dur_ns), max(dur_ns), group_concat(DISTINCT op), "
        f"group_concat(DISTINCT pid) FROM event_data WHERE {where} AND stack != 0 "
        "GROUP BY stack ORDER BY sum(dur_ns) DESC LIMIT ?", [*params, top_n]).fetchall()
    frames = _frames(conn, [int(r[0]) for r in rows])
    out = []
    for h, count, total, mx, ops, pids in rows:
        fr = frames.get(int(h), [])
        item: dict[str, Any] = {
            "stack": f"{int(h) & (2**64 - 1):016x}", "events": count, "total_ns": total,
            "mean_ns": total // count if count else None, "max_ns": mx,
            "ops": sorted({name_of(int(x)) for x in str(ops).split(",") if x}),
            "processes": [{"pid": p, "comm": names.get(p)}
                          for p in sorted(int(x) for x in str(pids).split(",") if x)[:10]],
            "frames": fr[:frames_n]}
        if len(fr) > frames_n:
            item["frames_omitted"] = len(fr) - frames_n
        out.append(item)
    return out


def _frames(conn: sqlite3.Connection, hashes: list[int]) -> dict[int, list[str]]:
    if not hashes:
        return {}
    out: dict[int, list[str]] = {}
    for h, text in conn.execute(f"SELECT hash, frames FROM stacks WHERE hash IN "
                                f"{in_list(hashes)}"):
        value = _json_or_text(text)
        out[int(h)] = ([str(f) for f in value] if isinstance(value, list) else [str(value)])
    return out
