"""The fleet operations behind ``fleetd query/explain/ops --nodes``, and :func:`ask`,
which asks every node one question of the registry (:mod:`fleetd.questions`: overview,
stacks, on-CPU stacks, graphs, gpu, pods).

Each fans out with :func:`fleetd.fleet.dispatch.fan_out`, corrects timestamps by each
node's clock offset, merges, and returns a :class:`FleetResult`: the JSON object that
``--format json`` prints (shapes in docs/json.md) plus what the table formats need.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypeVar, cast

from fleetd.analyze.causes.chains import SEVERITY_RANK
from fleetd.analyze.distributed import stragglers
from fleetd.analyze.reading.answers import ChainJson, NodeProfile, NoProfile, StragglerEntry
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
from fleetd.fleet.result import (
    BaseJson,
    FleetResult,
    WindowLabel,
    base_json,
    raise_if_user_error,
)
from fleetd.fleet.skew import correct_obj, correct_rows
from fleetd.questions.catalog import (
    CHAINS,
    OPS,
    OVERVIEW,
    OVERVIEW_COLUMNS,
    PROFILE,
    MergedCpuStacks,
    MergedGpu,
    MergedProcesses,
    MergedStacks,
    overview_rows,
)
from fleetd.questions.spec import Check, Params, Question
from fleetd.runner import run_loop
from fleetd.store.bounds import Bounds
from fleetd.wire import paths
from fleetd.wire.answers import CollectivesAnswer
from fleetd.wire.pods import PLACEMENT_FIELDS, label, params, read_placement
from fleetd.wire.query import check_rows
from fleetd.wire.shapes import ChainsReply, QueryBody, QueryReply

log = logging.getLogger("fleetd.fleet.queries")


# ---- the answers' JSON (docs/json.md) --------------------------------------------------


class QueryJson(BaseJson):
    """``fleetd query --nodes``: the merged (or reduced) rows, each led by its node."""

    columns: list[str]
    rows: list[list[Any]]  # SQL values, as the nodes sent them
    truncated: bool


class ExplainJson(BaseJson):
    """``fleetd explain --nodes``: every node's chains, ranked stragglers and arrivals."""

    stragglers: list[StragglerEntry]
    chains: list[ChainJson]
    nodes: list[str]  # the nodes that answered
    window: WindowLabel
    verdicts: dict[str, str]  # node -> its verdict
    processes: list[dict[str, object]]  # each node's process rows, with its node
    collectives: CollectivesAnswer
    selected: NotRequired[dict[str, str]]  # the pod / namespace asked for


class ExplainPage(ExplainJson):
    """What ``explain --nodes --format html`` draws: the fleet's answer, and every
    node's op statistics as rows (``fleetd ops --nodes``'s columns) for the histograms
    (fleetd.cli.explain_cmd.fleet_ops)."""

    ops: NotRequired[list[dict[str, object]]]  # none when no node answered them


class OpsJson(BaseJson):
    """``fleetd ops --nodes``: every node's op statistics, each row led by its node."""

    columns: list[str]
    rows: list[list[Any]]
    windows: dict[str, object]  # each node's as it sent it (OPS has no reader yet)


class AskedJson(BaseJson):
    """Any question asked of every node (:func:`ask`): each node's answer, tagged with
    its node, in our clock; the keys of the question's ``combine`` (its ``Merged*``
    type in fleetd.questions.catalog) follow, which only the question's own callers
    know: this type is what every question's fleet answer has."""

    nodes: list[dict[str, object]]


# Each question's fleet answer: AskedJson and what its combine adds.
class StacksFleetJson(AskedJson, MergedStacks):
    pass


class CpuStacksFleetJson(AskedJson, MergedCpuStacks):
    pass


class GraphsFleetJson(AskedJson, MergedProcesses):
    pass


class GpuFleetJson(AskedJson, MergedGpu):
    pass


A = TypeVar("A", bound=AskedJson)  # a question's fleet answer, named by its caller

# ---- query --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuerySpec:
    sql: str
    params: list[Any]
    time_params: frozenset[int] = frozenset()  # indexes of params that are our wall times
    max_rows: int | None = None
    timeout_s: float | None = None  # the SQL time limit asked of each node
    reduce_sql: str | None = None


def query(opts: FleetOptions, spec: QuerySpec) -> FleetResult[QueryJson]:
    result: FleetResult[QueryJson] = run_loop(query_async(opts, spec))
    return result


async def query_async(opts: FleetOptions, spec: QuerySpec,
                      client: FleetClient | None = None) -> FleetResult[QueryJson]:
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
    obj: QueryJson = {"columns": columns, "rows": rows, "truncated": merged.truncated,
                      **base_json(answer)}
    return FleetResult(answer, obj, columns, rows)


def _query_request(spec: QuerySpec, offset_ns: int) -> Request:
    params = [p + offset_ns if i in spec.time_params and isinstance(p, int) else p
              for i, p in enumerate(spec.params)]
    body: QueryBody = {"sql": spec.sql, "params": params}
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
    reply = cast(QueryReply, o.replies[0])  # read by check_rows, the request's check
    # check_rows let through only rows that are lists (JSON arrays), kept in place.
    columns, rows = reply["columns"], cast(list[list[Any]], reply["rows"])
    correct_rows(columns, rows, answer.offset_ns(o))
    return NodeRows(o.name, columns, rows, reply["truncated"], reply["truncated_reason"])


# ---- explain ------------------------------------------------------------------------


def explain(opts: FleetOptions, bounds: Bounds, pid: int | None = None,
            pod: str | None = None, namespace: str | None = None
            ) -> FleetResult[ExplainJson]:
    """Every node's chains and profile; with ``pod`` / ``namespace`` each node keeps
    the chains and processes of that pod's processes (none where it ran nowhere)."""
    from fleetd.analyze.distributed.collectives import straggler_entries
    from fleetd.fleet import collectives as arrivals

    selected = params(pod, namespace)
    asked = CHAINS.values({"pid": pid, paths.POD_PARAM: pod,
                           paths.NAMESPACE_PARAM: namespace})

    def plan(offset_ns: int) -> list[Request]:
        return [Request("GET", CHAINS.route, CHAINS.query(bounds, asked, offset_ns),
                        expect=(CHAINS.expect,),
                        check=_reader(CHAINS)),
                Request("GET", PROFILE.route, PROFILE.query(bounds, Params(), offset_ns),
                        expect=(PROFILE.expect,), check=_reader(PROFILE))]

    # Beside chains and profile, each node's collective calls (optional: a failure there
    # is a warning), compared across nodes in our clock.
    answer: FleetAnswer = run_loop(fan_out_work(
        opts, arrivals.with_arrivals(plan, bounds, arrivals.EXPLAIN_ROWS),
        needs_offset=bounds.absolute))
    raise_if_user_error(answer)
    chains: list[ChainJson] = []
    # A node's process rows pass through as it sent them (untrusted JSON objects), but
    # for their placement, read as text, and their node (_placed).
    processes: list[dict[str, object]] = []
    profiles: dict[str, NodeProfile | NoProfile] = {}
    verdicts: dict[str, str] = {}
    for o in answer.answered:
        assert o.replies is not None
        got = cast(ChainsReply, o.replies[0])  # read by CHAINS.check (_reader)
        prof = o.replies[1]
        off = answer.offset_ns(o)
        chains += [_tagged(correct_obj(c, off), o.name) for c in got.get("chains") or []]
        processes += [_placed(p, o.name) for p in got.get("processes") or []
                      if isinstance(p, dict)]
        profiles[o.name] = cast(NodeProfile | NoProfile, prof)  # read by PROFILE.check
        verdicts[o.name] = str(got.get("verdict") or "")
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in got.get("warnings") or []]
    chains.sort(key=lambda c: (SEVERITY_RANK.get(c.get("severity", "LOW"), 3),
                               -float(c.get("impact") or 0), str(c.get("id"))))
    unreachable = {o.name: o.failure.text() for o in answer.failed if o.failure}
    collectives = arrivals.from_answer(answer, 2, arrivals.EXPLAIN_ROWS)
    ranked = (straggler_entries(collectives, chains)
              + stragglers.rank(profiles, unreachable, chains))
    base = base_json(answer)
    obj: ExplainJson = {
        "stragglers": ranked, "chains": chains, "warnings": base["warnings"],
        "skew": base["skew"], "nodes": [o.name for o in answer.answered],
        "window": {"label": bounds.label()}, "verdicts": verdicts, "processes": processes,
        "collectives": collectives}
    if selected:
        obj["selected"] = dict(selected)
    return FleetResult(answer, obj)


def _placed(proc: Mapping[str, object], node: str) -> dict[str, object]:
    """A node's process row tagged with its node, its pod fields read as untrusted
    text (fleetd.wire.pods)."""
    out = {k: v for k, v in proc.items() if k not in PLACEMENT_FIELDS}
    return {**out, **read_placement(proc), "node": node}


def _tagged(chain: ChainJson, node: str) -> ChainJson:
    chain["node"] = node
    return chain


# ---- ops ----------------------------------------------------------------------------


def ops(opts: FleetOptions, bounds: Bounds, pid: int | None, per_process: bool,
        columns: Sequence[str], by: str = "op", pod: str | None = None,
        namespace: str | None = None) -> FleetResult[OpsJson]:
    """Every node's op statistics; with ``pod`` / ``namespace`` per process of that
    pod, a ``pod`` column (add it to ``columns``) naming each row's."""
    result = ask(opts, OPS, bounds, OPS.values({
        "pid": pid, "per_process": per_process, "by": by, paths.POD_PARAM: pod,
        paths.NAMESPACE_PARAM: namespace}), AskedJson)
    answer = result.answer
    cols = [c for c in columns if c != "node"]
    parts = []
    windows: dict[str, object] = {}  # each node's as it sent it (OPS has no reader yet)
    for reply in result.obj["nodes"]:
        got = reply.get("ops")
        rows = [[label(read_placement(r)) if c == "pod" else r.get(c) for c in cols]
                for r in (got if isinstance(got, list) else []) if isinstance(r, dict)]
        node = str(reply["node"])  # the node's name, as ask tagged it
        parts.append(NodeRows(node, list(cols), rows))
        windows[node] = reply.get("window")
    merged: Merged = merge(parts)
    answer.warnings += merged.warnings
    obj: OpsJson = {"columns": merged.columns, "rows": merged.rows, "windows": windows,
           **base_json(answer)}
    return FleetResult(answer, obj, merged.columns, merged.rows)


# ---- overview -----------------------------------------------------------------------


def overview(opts: FleetOptions, bounds: Bounds) -> FleetResult[AskedJson]:
    """Every node's overview, with the table's columns and rows."""
    result = ask(opts, OVERVIEW, bounds, Params(), AskedJson)
    return FleetResult(result.answer, result.obj, list(OVERVIEW_COLUMNS),
                       overview_rows(result.obj["nodes"]))


# ---- a question of the registry -----------------------------------------------------


def _reader(question: Question) -> Check | None:
    """The question's wire reader, given an answer whose numbers all fit."""
    read = question.check
    return None if read is None else (lambda r: read(check_numbers(r, "the answer")))


def ask(opts: FleetOptions, question: Question, bounds: Bounds, params: Params,
        shape: type[A]) -> FleetResult[A]:
    """Ask every node ``question`` (one GET each, in the window when it takes one):
    ``{"nodes": [each answer with its node, in our clock], **question.combine(nodes),
    status, warnings, skew}``, of the type ``shape`` the caller names for the question
    (:class:`AskedJson` where any question's answer is handled alike). A node whose
    answer fails ``question.check`` (or holds a number beyond 64 bits, when there is a
    check) counts as failed."""
    check = _reader(question)
    answer: FleetAnswer = run_loop(fan_out(
        opts, lambda off: [Request("GET", question.route,
                                   question.query(bounds, params, off),
                                   expect=(question.expect,), check=check)],
        needs_offset=question.windowed and bounds.absolute))
    raise_if_user_error(answer)
    nodes: list[dict[str, object]] = []
    for o in answer.answered:
        assert o.replies is not None
        reply = correct_obj(dict(o.replies[0], node=o.name), answer.offset_ns(o))
        if question.node_warnings:
            answer.warnings += [NodeWarning(o.name, str(w), "window")
                                for w in reply.get("warnings") or []]
        nodes.append(reply)
    merged = {} if question.combine is None else question.combine(nodes)
    # The combine's keys after the nodes' (its Merged* type: AskedJson's docstring).
    obj = cast(A, {"nodes": nodes, **base_json(answer), **merged})
    return FleetResult(answer, obj)
