"""The four fleet operations behind ``fleetd query/explain/ops/overview --nodes``.

Each fans out with :func:`fleetd.fleet.fanout.fan_out`, corrects timestamps by each
node's clock offset, merges, and returns a :class:`FleetResult`: the JSON object that
``--format json`` prints (shapes in docs/json.md) plus what the table formats need.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetd.analyze import stragglers
from fleetd.analyze.chains import SEVERITY_RANK
from fleetd.analyze.window import WindowSpec
from fleetd.fleet.client import FleetClient
from fleetd.fleet.combine import Merged, NodeRows, NodeWarning, merge, reduce
from fleetd.fleet.dispatch import fan_out
from fleetd.fleet.fanout import (
    FleetAnswer,
    FleetOptions,
    NodeOutcome,
    Request,
    check_numbers,
    fan_out_work,
)
from fleetd.fleet.result import FleetResult, base_json, raise_if_user_error
from fleetd.fleet.skew import correct_obj, correct_rows
from fleetd.runner import run_loop
from fleetd.wire import paths
from fleetd.wire.pods import PLACEMENT_FIELDS, label, params, read_placement
from fleetd.wire.query import check_rows

log = logging.getLogger("fleetd.fleet.queries")

# ---- query --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuerySpec:
    sql: str
    params: list[Any]
    time_params: frozenset[int] = frozenset()  # indexes of params that are our wall times
    max_rows: int | None = None
    timeout_s: float | None = None  # the SQL time limit asked of each node
    reduce_sql: str | None = None


def query(opts: FleetOptions, spec: QuerySpec) -> FleetResult:
    result: FleetResult = run_loop(query_async(opts, spec))
    return result


async def query_async(opts: FleetOptions, spec: QuerySpec,
                      client: FleetClient | None = None) -> FleetResult:
    """:func:`query` inside a running loop, optionally on a caller's open client."""
    answer = await fan_out(opts, lambda off: [_query_request(spec, off)],
                           needs_offset=bool(spec.time_params), client=client)
    raise_if_user_error(answer)
    parts = []
    for o in answer.answered:
        parts.append(_node_rows(answer, o))
    merged = merge(parts)
    answer.warnings += merged.warnings
    columns, rows = merged.columns, merged.rows
    if spec.reduce_sql is not None:
        columns, rows = reduce(merged, spec.reduce_sql)
    obj = {"columns": columns, "rows": rows, "truncated": merged.truncated, **base_json(answer)}
    return FleetResult(answer, obj, columns, rows)


def _query_request(spec: QuerySpec, offset_ns: int) -> Request:
    params = [p + offset_ns if i in spec.time_params and isinstance(p, int) else p
              for i, p in enumerate(spec.params)]
    body: dict[str, Any] = {"sql": spec.sql, "params": params}
    if spec.max_rows is not None:
        body["max_rows"] = spec.max_rows
    if spec.timeout_s is not None:
        body["timeout_s"] = spec.timeout_s
    return Request("POST", paths.QUERY, body=body, expect=("columns", "rows"),
                   check=lambda reply: check_rows(reply, spec.max_rows))


def _node_rows(answer: FleetAnswer, o: NodeOutcome) -> NodeRows:
    """A node's rows in our clock. Its answer was checked where it was read
    (:func:`fleetd.wire.query.check_rows`, the request's check), so it has its shape."""
    assert o.replies is not None
    reply = o.replies[0]
    columns, rows = reply["columns"], reply["rows"]
    correct_rows(columns, rows, answer.offset_ns(o))
    return NodeRows(o.name, columns, rows, reply["truncated"], reply["truncated_reason"])


# ---- explain ------------------------------------------------------------------------


def explain(opts: FleetOptions, window: WindowSpec, pid: int | None = None,
            pod: str | None = None, namespace: str | None = None) -> FleetResult:
    """Every node's chains and profile; with ``pod`` / ``namespace`` each node keeps
    the chains and processes of that pod's processes (none where it ran nowhere)."""
    from fleetd.analyze.collectives import straggler_entries
    from fleetd.fleet import collectives as arrivals

    bounds = window.validate()
    selected = params(pod, namespace)

    def plan(offset_ns: int) -> list[Request]:
        base = bounds.params(offset_ns)
        chains = {**base, **({"pid": str(pid)} if pid else {}), **selected}
        return [Request("GET", paths.CHAINS, chains, expect=("chains",)),
                Request("GET", paths.PROFILE, base, expect=("node",))]

    # Beside chains and profile, each node's collective calls (optional: a failure there
    # is a warning), compared across nodes in our clock.
    answer: FleetAnswer = run_loop(fan_out_work(
        opts, arrivals.with_arrivals(plan, bounds, arrivals.EXPLAIN_ROWS),
        needs_offset=window.absolute))
    raise_if_user_error(answer)
    chains: list[dict[str, Any]] = []
    processes: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, str] = {}
    for o in answer.answered:
        assert o.replies is not None
        got, prof = o.replies[:2]
        off = answer.offset_ns(o)
        chains += [_tagged(correct_obj(c, off), o.name) for c in got.get("chains") or []]
        processes += [_placed(p, o.name) for p in got.get("processes") or []
                      if isinstance(p, dict)]
        profiles[o.name] = prof
        verdicts[o.name] = str(got.get("verdict") or "")
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in got.get("warnings") or []]
    chains.sort(key=lambda c: (SEVERITY_RANK.get(c.get("severity", "LOW"), 3),
                               -float(c.get("impact") or 0), str(c.get("id"))))
    unreachable = {o.name: o.failure.text() for o in answer.failed if o.failure}
    collectives = arrivals.from_answer(answer, 2, arrivals.EXPLAIN_ROWS)
    ranked = (straggler_entries(collectives, chains)
              + stragglers.rank(profiles, unreachable, chains))
    obj = {"stragglers": ranked, "chains": chains, **base_json(answer),
           "nodes": [o.name for o in answer.answered], "window": {"label": window.label()},
           "verdicts": verdicts, "processes": processes, "collectives": collectives}
    if selected:
        obj["selected"] = dict(selected)
    return FleetResult(answer, obj)


def _placed(proc: dict[str, Any], node: str) -> dict[str, Any]:
    """A node's process row tagged with its node, its pod fields read as untrusted
    text (fleetd.wire.pods)."""
    out = {k: v for k, v in proc.items() if k not in PLACEMENT_FIELDS}
    return {**out, **read_placement(proc), "node": node}


def _tagged(chain: dict[str, Any], node: str) -> dict[str, Any]:
    chain["node"] = node
    return chain


# ---- ops ----------------------------------------------------------------------------


def ops(opts: FleetOptions, window: WindowSpec, pid: int | None, per_process: bool,
        columns: Sequence[str], by: str = "op", pod: str | None = None,
        namespace: str | None = None) -> FleetResult:
    """Every node's op statistics; with ``pod`` / ``namespace`` per process of that
    pod, a ``pod`` column (add it to ``columns``) naming each row's."""
    bounds = window.validate()
    selected = params(pod, namespace)

    def plan(offset_ns: int) -> list[Request]:
        query = {**bounds.params(offset_ns), **selected}
        if pid:
            query["pid"] = str(pid)
        if per_process:
            query["per_process"] = "1"
        if by != "op":
            query["by"] = by
        return [Request("GET", paths.OPS, query, expect=("ops",))]

    answer: FleetAnswer = run_loop(fan_out(opts, plan, needs_offset=window.absolute))
    raise_if_user_error(answer)
    cols = [c for c in columns if c != "node"]
    parts = []
    windows: dict[str, Any] = {}
    for o in answer.answered:
        assert o.replies is not None
        reply = o.replies[0]
        rows = [[label(read_placement(r)) if c == "pod" else r.get(c) for c in cols]
                for r in reply.get("ops") or [] if isinstance(r, dict)]
        parts.append(NodeRows(o.name, list(cols), rows))
        windows[o.name] = reply.get("window")
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in reply.get("warnings") or []]
    merged: Merged = merge(parts)
    answer.warnings += merged.warnings
    obj = {"columns": merged.columns, "rows": merged.rows, "windows": windows,
           **base_json(answer)}
    return FleetResult(answer, obj, merged.columns, merged.rows)


# ---- overview -----------------------------------------------------------------------

OVERVIEW_COLUMNS = ["node", "events", "lost_events", "sessions", "crashed", "high", "medium",
                    "low", "verdict"]


def overview(opts: FleetOptions, window: WindowSpec) -> FleetResult:
    bounds = window.validate()
    answer: FleetAnswer = run_loop(fan_out(
        opts, lambda off: [Request("GET", paths.OVERVIEW, bounds.params(off),
                                   expect=("events",))],
        needs_offset=window.absolute))
    raise_if_user_error(answer)
    nodes = []
    for o in answer.answered:
        assert o.replies is not None
        reply = dict(o.replies[0], node=o.name)
        nodes.append(correct_obj(reply, answer.offset_ns(o)))
    obj = {"nodes": nodes, **base_json(answer)}
    return FleetResult(answer, obj, list(OVERVIEW_COLUMNS), overview_rows(nodes))


# ---- stacks and graphs --------------------------------------------------------------


def stacks(opts: FleetOptions, window: WindowSpec, op: str | None, pid: int | None,
           top_n: int, frames_n: int, min_dur_ns: int = 0) -> FleetResult:
    """Every node's heaviest recorded stacks (``GET /api/v1/stacks``), heaviest first."""
    params = {k: str(v) for k, v in (("op", op), ("pid", pid), ("top_n", top_n),
                                     ("frames_n", frames_n), ("min_dur_ns", min_dur_ns)) if v}
    result = _per_node(opts, window, paths.STACKS, params, "stacks")
    found = [dict(s, node=n["node"]) for n in result.obj["nodes"]
             for s in n.get("stacks") or [] if isinstance(s, dict)]
    found.sort(key=lambda s: -_number(s.get("total_ns")))
    result.obj["stacks"] = found
    return result


def cpu_stacks(opts: FleetOptions, window: WindowSpec, pid: int | None, tid: int | None
               ) -> FleetResult:
    """Every node's on-CPU samples per (thread, stack) (``GET /api/v1/cpu_stacks``): the
    rows a merged profile is made of, each with its node; values that are not what the
    route answers are left out."""
    params = {k: str(v) for k, v in (("pid", pid), ("tid", tid)) if v}
    result = _per_node(opts, window, paths.CPU_STACKS, params, "stacks")
    found = []
    for n in result.obj["nodes"]:
        for s in n.get("stacks") or []:
            frames = s.get("frames") if isinstance(s, dict) else None
            if isinstance(frames, list) and all(isinstance(f, str) for f in frames) and all(
                    isinstance(s.get(k), int) and s[k] >= 0 for k in ("pid", "tid", "samples",
                                                                        "gc")):
                found.append({"node": str(n["node"]), "pid": s["pid"], "tid": s["tid"],
                              "frames": [f[:1000] for f in frames[:128]],
                              "samples": s["samples"], "gc": s["gc"]})
    result.obj["stacks"] = found
    result.obj["period_ns"] = max((int(n["period_ns"]) for n in result.obj["nodes"]
                                   if isinstance(n.get("period_ns"), int)), default=0)
    return result


def graphs(opts: FleetOptions, window: WindowSpec, pid: int | None, buckets: int
           ) -> FleetResult:
    """Every node's CUDA graph lifecycle per process (``GET /api/v1/graphs``)."""
    params = {k: str(v) for k, v in (("pid", pid), ("buckets", buckets)) if v}
    result = _per_node(opts, window, paths.GRAPHS, params, "processes")
    result.obj["processes"] = [dict(p, node=n["node"]) for n in result.obj["nodes"]
                               for p in n.get("processes") or [] if isinstance(p, dict)]
    return result


def gpu(opts: FleetOptions, window: WindowSpec, pid: int | None, steps: bool,
        thresholds: dict[str, float]) -> FleetResult:
    """Every node's GPU ranks (``GET /api/v1/gpu``) side by side, the slowest flagged
    with the straggler scoring; kernel rows keep their node."""
    from fleetd.analyze.gpu import slowest_rank

    params = {"thresholds": ",".join(f"{k}={v}" for k, v in thresholds.items())}
    if pid:
        params["pid"] = str(pid)
    if steps:
        params["steps"] = "1"
    result = _per_node(opts, window, paths.GPU, params, "ranks", _checked_gpu)
    nodes = result.obj["nodes"]
    for n in nodes:  # a rank is named by the node that answered, not by what it claims
        for r in n["ranks"]:
            r["node"] = n["node"]
    ranks = [r for n in nodes for r in n["ranks"]]
    result.obj["ranks"] = ranks
    result.obj["kernels"] = sorted(
        (dict(k, node=n["node"]) for n in nodes for k in n.get("kernels") or []
         if isinstance(k, dict)), key=lambda k: -_number(k.get("total_ns")))
    result.obj["straggler"] = slowest_rank(ranks)
    return result


def _checked_gpu(reply: dict[str, Any]) -> Mapping[str, Any]:
    from fleetd.wire.gpu import check_gpu_reply  # the GPU analyzer only when asked

    return check_gpu_reply(check_numbers(reply, "the answer"))


def _per_node(opts: FleetOptions, window: WindowSpec, path: str, extra: dict[str, str],
              expect: str, check: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
              ) -> FleetResult:
    """One GET per node in the window; each answer tagged with its node and moved into
    our clock, the nodes' window warnings added to the fan-out's. ``check`` rebuilds an
    answer from validated values or raises BadReply: that node then counts as failed."""
    bounds = window.validate()
    answer: FleetAnswer = run_loop(fan_out(
        opts, lambda off: [Request("GET", path, {**bounds.params(off), **extra},
                                   expect=(expect,), check=check)],
        needs_offset=window.absolute))
    raise_if_user_error(answer)
    nodes = []
    for o in answer.answered:
        assert o.replies is not None
        reply = correct_obj(dict(o.replies[0], node=o.name), answer.offset_ns(o))
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in reply.get("warnings") or []]
        nodes.append(reply)
    return FleetResult(answer, {"nodes": nodes, **base_json(answer)})


def _number(value: Any) -> float:
    """A peer's number, or 0 for anything else (sorting must not fail on a bad value)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def overview_rows(nodes: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for n in nodes:
        chains = n.get("chains") or {}
        rows.append([n.get("node"), n.get("events"), n.get("lost_events"),
                     len(n.get("sessions") or []), n.get("crashed_sessions"),
                     chains.get("HIGH", 0),
                     chains.get("MEDIUM", 0), chains.get("LOW", 0), n.get("verdict")])
    return rows
