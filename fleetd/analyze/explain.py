"""``explain``: what is slow, why, who caused it and what to do, node by node.

:func:`report` runs every cause's rules over each node's slice of the window
(:class:`fleetd.analyze.pernode.model.NodeSlice`) and returns an
:class:`~fleetd.analyze.reading.answers.ExplainReport`: its chains
(:class:`~fleetd.analyze.reading.answers.ChainJson`, built from the analyzers'
:class:`~fleetd.analyze.causes.chains.Chain` by :func:`chain_json`), the per-process
breakdown and op statistics (docs/explain.md). A merged file holds several nodes; each is
analyzed on its own (a culprit on one node cannot delay a thread on another), and the
agent answers ``GET /api/v1/chains`` with one node's part (:func:`explain_node`,
through :class:`fleetd.analyze.facade.Analysis`); the fleet client merges the nodes'
parts and ranks them with :mod:`fleetd.analyze.distributed.stragglers`.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from fleetd.analyze.causes import (
    causes,
    contention,
    gpu_chains,
    memory,
    oncpu,
    pipes,
    rules,
    throttle,
)
from fleetd.analyze.causes.chains import (
    MIN_CALLS,
    SEVERITY_RANK,
    Baseline,
    Chain,
    NodeView,
    account,
    attribute,
    build_chains,
    culprit_json,
    evidence_timeline,
    find_spikes,
    find_stalls,
    place_chain,
)
from fleetd.analyze.distributed import collectives
from fleetd.analyze.distributed.stragglers import node_profile as node_profile  # facade, agents
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.pernode.preload import pays
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers import (
    ChainJson,
    ExplainReport,
    NodeExplain,
    NodeProfile,
    NoProfile,
)
from fleetd.analyze.reading.data import (
    CALL_SOURCES,
    code,
    nodes,
)
from fleetd.analyze.reading.rows import OpRow, ProcessRow, ThreadRow, TopOp
from fleetd.analyze.reading.window import Window, resolve
from fleetd.store.bounds import Bounds
from fleetd.store.chainrow import chain_row
from fleetd.store.db import open_reader
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.analyze.explain")

Report = ExplainReport  # the older name
MIN_UNEXPLAINED_IMPACT = 0.01  # unexplained spikes below this share of time are noise


@contextmanager
def _connection(db: str | Path | sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    if isinstance(db, sqlite3.Connection):
        yield db
        return
    conn = open_reader(Path(db))
    try:
        yield conn
    finally:
        conn.close()


def explain(
    db: str | Path | sqlite3.Connection,
    window: Window | None = None,
    pid: int | None = None,
    per_process: bool = False,
    node: str | None = None,
) -> Report:
    """Chains (most severe first), per-process breakdown and op stats for every node."""
    with _connection(db) as conn:
        win = window or resolve(conn, Bounds())
        return report([NodeSlice(conn, n, win) for n in nodes(conn, node)], win, pid,
                      per_process)


def report(slices: list[NodeSlice], win: Window, pid: int | None = None,
           per_process: bool = False, pids: Collection[int] | None = None) -> Report:
    """The explain report over these node slices (one window), node by node; ``pids``
    (a pod's processes, say) keeps only their chains, processes and op rows (per
    process, then: op statistics of other processes cannot be taken out of a total)."""
    chains: list[ChainJson] = []
    procs: list[ProcessRow] = []
    ops: list[OpRow] = []
    warnings = list(win.warnings)
    for sl in slices:
        part = explain_node(sl, pid, per_process or pids is not None)
        if pids is not None:
            part = {"chains": [c for c in part["chains"] if c["victim"]["pid"] in pids],
                    "processes": [r for r in part["processes"] if r["pid"] in pids],
                    "ops": [r for r in part["ops"] if r["pid"] in pids],
                    "warnings": part["warnings"]}
        chains += part["chains"]
        procs += part["processes"]
        ops += part["ops"]
        warnings += part["warnings"]
    chains.sort(key=lambda c: (SEVERITY_RANK[c["severity"]], -float(c["impact"]), c["id"]))
    return {
        "window": win.to_json(),
        "nodes": [sl.name for sl in slices],
        # Failing NCCL calls are never quiet, whatever time they cost.
        "quiet": not any(c["severity"] in ("HIGH", "MEDIUM")
                         or c["root_cause"] == "nccl_failures" for c in chains),
        "verdict": _verdict(chains, win),
        "chains": chains,
        "processes": procs,
        "ops": ops,
        "warnings": warnings,
    }


def _verdict(chains: list[ChainJson], win: Window) -> str:
    if win.warnings:
        return "no data in the window: " + win.warnings[0]
    counts = {s: sum(1 for c in chains if c["severity"] == s) for s in SEVERITY_RANK}
    if not counts["HIGH"] and not counts["MEDIUM"]:
        failing = [c for c in chains if c["root_cause"] == "nccl_failures"]
        if failing:
            return (f"no host-side cause of GPU latency found, but NCCL calls failed in "
                    f"{len(failing)} process(es); first: {failing[0]['node']}: "
                    f"{failing[0]['summary']}")
        minor = f" ({counts['LOW']} minor chain(s) below the MEDIUM bar)" if counts["LOW"] else ""
        return "quiet: no host-side cause of GPU latency found" + minor
    top = chains[0]
    return (f"{counts['HIGH']} HIGH, {counts['MEDIUM']} MEDIUM, {counts['LOW']} LOW; "
            f"worst: {top['root_cause']} on {top['node']}: {top['summary']}")


def explain_node(sl: NodeSlice, pid: int | None = None, per_process: bool = False
                 ) -> NodeExplain:
    """One node's chains, processes and op stats (the unit the fleet client reuses)."""
    ops, threads = sl.ops, sl.threads
    view = NodeView(sl.conn, sl.node, sl.window, sl.tasks, sl.names, sl.sums, sl.stack_rows)
    ctx = rules.Context(view, sl.span, ops, threads, sl.parents, rules.page_hists(sl.conn, view))
    if sl.calls_ahead is not None:  # the rules' walk of the span, read by preload's child
        view.await_calls(sl.calls_ahead)
    elif sl.reopen is not None and pays(sl):
        rules.prefetch(ctx, sl.reopen)  # that walk beside the spikes, in a thread
    chains = _spike_chains(ctx, ops, threads)
    rules.refine_dataloader(ctx, chains)
    chains += rules.dataloader_rule(ctx, chains)
    chains += rules.host_sync_rule(ctx, chains) + rules.alloc_churn_rule(ctx)
    chains += rules.graph_recapture_rule(ctx)
    chains += contention.wait_rules(ctx)
    chains += pipes.pipe_rule(ctx)  # writes that wait for a slow reader
    chains += gpu_chains.gpu_idle_rule(ctx)  # imported GPU timelines only
    failed, warnings = collectives.failures(ctx)  # NCCL calls that returned an error
    chains += failed
    # Every lost share from the per-thread breakdown, one chain per thread and reason.
    chains = account(chains, threads)
    # The quota's share of the run-queue column, taken from the contention chain's.
    chains += throttle.throttle_rule(ctx, chains)
    chains += memory.memory_rule(ctx)  # the breakdown's reclaim column, no other chain's
    chains += oncpu.oncpu_rules(ctx, chains)  # on-CPU samples: GC pauses, a CPU-bound feeder
    memory.take_reclaim_from_cpu_bound(ctx, chains)  # reclaim is on-CPU time too
    memory.own_kernel_work(ctx, chains)  # a kworker running the victim's own work
    if pid is not None:
        chains = [c for c in chains if int(c.victim["pid"]) == pid]
        threads = [t for t in threads if t["pid"] == pid]
        warnings = [w for w, c in zip(warnings, failed, strict=True)
                    if int(c.victim["pid"]) == pid]
    out_ops = ops if per_process else sl.op_stats(pid, False)
    if per_process and pid is not None:
        out_ops = [r for r in ops if r["pid"] == pid]
    procs = sl.processes(threads)
    for p in procs:
        p["top_ops"] = [_brief(r) for r in ops if r["pid"] == p["pid"]][:5]
    # Each process named with its pod and container, where the tracer recorded them.
    placed = pods.placements(sl.conn, sl.node.key)
    for c in chains:
        place_chain(c, sl.node.key, placed)
    pods.annotate(procs, sl.node.key, placed)
    return {"chains": [chain_json(c) for c in chains], "processes": procs, "ops": out_ops,
            "warnings": warnings}


def _spike_chains(ctx: rules.Context, ops: list[OpRow], threads: list[ThreadRow]
                  ) -> list[Chain]:
    baselines = [
        Baseline(int(r["pid"] or 0), code(r["op"]), r["count"], r["p50_ns"] or 0,
                 r["p99_ns"] or 0)
        for r in ops
        if r["source"] in CALL_SOURCES and r["count"] >= MIN_CALLS and r["p50_ns"]
    ]
    spikes, scale = find_spikes(ctx.view, baselines)
    feeding = {t["tid"]: t["pid"] for t in threads if t["cuda_calls_stored"]}
    spikes += find_stalls(ctx.view, feeding)
    for s in spikes:
        attribute(ctx.view, s)
    chains = build_chains(ctx.view, spikes, scale, ctx.span_ns)
    return [c for c in chains
            if c.root_cause != "unexplained" or c.impact >= MIN_UNEXPLAINED_IMPACT]


def _brief(r: OpRow) -> TopOp:
    return {"op": r["op"], "count": r["count"], "total_ns": r["total_ns"],
            "p50_ns": r["p50_ns"], "p99_ns": r["p99_ns"], "stats_from": r["stats_from"]}


def chain_json(ch: Chain) -> ChainJson:
    """The chain as every reader sees it (docs/explain.md, "A chain"). The rules build a
    :class:`Chain` of the answer's own types (victim, culprits, detail, evidence), which
    tests/unit/test_answer_shapes.py holds real answers to."""
    if not ch.summary:
        ch.summary = causes.summary(ch)
    if not ch.fixes:
        ch.fixes = causes.fixes(ch)
    top = ch.culprits[0] if ch.culprits else None
    return {
        "id": ch.chain_id,
        "key": ch.key,
        "node": ch.node,
        "severity": ch.severity,
        "root_cause": ch.root_cause,
        "summary": ch.summary,
        "op": ch.op,
        "victim": ch.victim,
        "culprit": culprit_json(top) if top is not None else None,
        "culprits": ch.culprits[:5],
        "explained": ch.explained,
        "impact": ch.impact,
        "ts_ns": ch.ts_ns,
        "dur_ns": ch.dur_ns,
        "time": format_ns(ch.ts_ns) if ch.ts_ns else None,
        "detail": ch.detail,
        "evidence": evidence_timeline(ch),
        "fixes": ch.fixes,
    }


def store_chains(path: Path, report: Report) -> int:
    """Write the report's chains with history (same key: next version). Returns count."""
    from fleetd.store.writer import BatchWriter

    by_node: dict[str, list[ChainJson]] = {}
    for c in report["chains"]:
        by_node.setdefault(c["node"], []).append(c)
    for node, chains in by_node.items():
        with BatchWriter(path, node) as w:
            w.add_chains([chain_row(c) for c in chains])
    return sum(len(v) for v in by_node.values())


# ---- straggler features --------------------------------------------------------------


def profile(conn: sqlite3.Connection, window: Window, node: str
            ) -> NodeProfile | NoProfile:
    """Per-node features the fleet client compares across nodes to find stragglers."""
    found = nodes(conn, node)
    if not found:
        return {"node": node, "error": "no such node in this database"}
    return node_profile(NodeSlice(conn, found[0], window))
