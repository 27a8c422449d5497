"""The four fleet operations behind ``fleetd query/explain/ops/overview --nodes``.

Each fans out with :func:`fleetd.fleet.fanout.fan_out`, corrects timestamps by each
node's clock offset, merges, and returns a :class:`FleetResult`: the JSON object that
``--format json`` prints (shapes in docs/json.md) plus what the table formats need.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetd.analyze.chains import SEVERITY_RANK
from fleetd.errors import QueryError
from fleetd.fleet import stragglers
from fleetd.fleet.client import FleetClient
from fleetd.fleet.fanout import FleetAnswer, FleetOptions, NodeOutcome, Request, fan_out
from fleetd.fleet.merge import Merged, NodeRows, NodeWarning, merge, reduce
from fleetd.fleet.skew import correct_obj, correct_rows
from fleetd.runner import run_loop
from fleetd.store.timeparse import parse_timestamp

log = logging.getLogger("fleetd.fleet.queries")

# Refusals that mean the request itself is wrong: if every node says so, it is the
# user's mistake (exit 2 with the node's message), not an outage.
USER_ERROR_CODES = frozenset({"bad_query", "bad_request", "forbidden", "too_large"})


@dataclass(slots=True)
class FleetResult:
    answer: FleetAnswer
    obj: dict[str, Any]  # what --format json prints
    columns: list[str] = field(default_factory=list)  # the row formats
    rows: list[list[Any]] = field(default_factory=list)

    @property
    def warnings(self) -> list[NodeWarning]:
        return self.answer.warnings

    @property
    def exit_code(self) -> int:
        return self.answer.exit_code


@dataclass(frozen=True, slots=True)
class WindowArgs:
    """The window as the user gave it; absolute times are in *our* clock."""

    since: str | None = None
    from_: str | None = None
    to: str | None = None

    @property
    def absolute(self) -> bool:
        return bool(self.from_ or self.to)

    def params(self, offset_ns: int) -> dict[str, str]:
        """Query parameters in the node's clock. ``--since`` needs no shift: "the last
        5 minutes" by the node's clock is the same span of real time."""
        out: dict[str, str] = {}
        if self.since:
            out["since"] = self.since
        if self.from_:
            out["from"] = str(parse_timestamp(self.from_) + offset_ns)
        if self.to:
            out["to"] = str(parse_timestamp(self.to) + offset_ns)
        return out

    def label(self) -> str:
        if self.since:
            return f"last {self.since}"
        if self.absolute:
            return f"{self.from_ or 'start'} .. {self.to or 'end'}"
        return "whole recording"

    def validate(self) -> None:
        self.params(0)  # parse errors surface once, before any node is asked


def raise_if_user_error(answer: FleetAnswer) -> None:
    """Every node refused the request as malformed: say so once, as a usage error."""
    if answer.answered or not answer.outcomes:
        return
    fails = [o.failure for o in answer.outcomes if o.failure is not None]
    if fails and all(f.kind == "http" and f.code in USER_ERROR_CODES for f in fails):
        f = fails[0]
        message = f.message.split(": ", 1)[-1]
        raise QueryError(f"every node refused the request: {message}", f.hint,
                         code=f.code or "bad_request")


def _base(answer: FleetAnswer) -> dict[str, Any]:
    return {"warnings": [w.to_json() for w in answer.warnings], "skew": answer.skew_json()}


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
    obj = {"columns": columns, "rows": rows, "truncated": merged.truncated, **_base(answer)}
    return FleetResult(answer, obj, columns, rows)


def _query_request(spec: QuerySpec, offset_ns: int) -> Request:
    params = [p + offset_ns if i in spec.time_params and isinstance(p, int) else p
              for i, p in enumerate(spec.params)]
    body: dict[str, Any] = {"sql": spec.sql, "params": params}
    if spec.max_rows is not None:
        body["max_rows"] = spec.max_rows
    if spec.timeout_s is not None:
        body["timeout_s"] = spec.timeout_s
    return Request("POST", "/api/v1/query", body=body, expect=("columns", "rows"))


def _node_rows(answer: FleetAnswer, o: NodeOutcome) -> NodeRows:
    assert o.replies is not None
    reply = o.replies[0]
    columns = [str(c) for c in reply.get("columns") or []]
    rows = [list(r) for r in reply.get("rows") or [] if isinstance(r, list)]
    correct_rows(columns, rows, answer.offset_ns(o))
    return NodeRows(o.name, columns, rows, bool(reply.get("truncated")),
                    reply.get("truncated_reason"))


# ---- explain ------------------------------------------------------------------------


def explain(opts: FleetOptions, window: WindowArgs, pid: int | None = None) -> FleetResult:
    window.validate()

    def plan(offset_ns: int) -> list[Request]:
        params = window.params(offset_ns)
        chains = {**params, **({"pid": str(pid)} if pid else {})}
        return [Request("GET", "/api/v1/chains", chains, expect=("chains",)),
                Request("GET", "/api/v1/profile", params, expect=("node",))]

    answer: FleetAnswer = run_loop(fan_out(opts, plan, needs_offset=window.absolute))
    raise_if_user_error(answer)
    chains: list[dict[str, Any]] = []
    processes: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, str] = {}
    for o in answer.answered:
        assert o.replies is not None
        got, prof = o.replies
        off = answer.offset_ns(o)
        chains += [_tagged(correct_obj(c, off), o.name) for c in got.get("chains") or []]
        processes += [dict(p, node=o.name) for p in got.get("processes") or []]
        profiles[o.name] = prof
        verdicts[o.name] = str(got.get("verdict") or "")
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in got.get("warnings") or []]
    chains.sort(key=lambda c: (SEVERITY_RANK.get(c.get("severity", "LOW"), 3),
                               -float(c.get("impact") or 0), str(c.get("id"))))
    unreachable = {o.name: o.failure.text() for o in answer.failed if o.failure}
    ranked = stragglers.rank(profiles, unreachable, chains)
    obj = {"stragglers": ranked, "chains": chains, **_base(answer),
           "nodes": [o.name for o in answer.answered], "window": {"label": window.label()},
           "verdicts": verdicts, "processes": processes}
    return FleetResult(answer, obj)


def _tagged(chain: dict[str, Any], node: str) -> dict[str, Any]:
    chain["node"] = node
    return chain


# ---- ops ----------------------------------------------------------------------------


def ops(opts: FleetOptions, window: WindowArgs, pid: int | None, per_process: bool,
        columns: Sequence[str]) -> FleetResult:
    window.validate()

    def plan(offset_ns: int) -> list[Request]:
        params = window.params(offset_ns)
        if pid:
            params["pid"] = str(pid)
        if per_process:
            params["per_process"] = "1"
        return [Request("GET", "/api/v1/ops", params, expect=("ops",))]

    answer: FleetAnswer = run_loop(fan_out(opts, plan, needs_offset=window.absolute))
    raise_if_user_error(answer)
    cols = [c for c in columns if c != "node"]
    parts = []
    windows: dict[str, Any] = {}
    for o in answer.answered:
        assert o.replies is not None
        reply = o.replies[0]
        rows = [[r.get(c) for c in cols] for r in reply.get("ops") or [] if isinstance(r, dict)]
        parts.append(NodeRows(o.name, list(cols), rows))
        windows[o.name] = reply.get("window")
        answer.warnings += [NodeWarning(o.name, str(w), "window")
                            for w in reply.get("warnings") or []]
    merged: Merged = merge(parts)
    answer.warnings += merged.warnings
    obj = {"columns": merged.columns, "rows": merged.rows, "windows": windows,
           **_base(answer)}
    return FleetResult(answer, obj, merged.columns, merged.rows)


# ---- overview -----------------------------------------------------------------------

OVERVIEW_COLUMNS = ["node", "events", "lost_events", "sessions", "high", "medium", "low",
                    "verdict"]


def overview(opts: FleetOptions, window: WindowArgs) -> FleetResult:
    window.validate()
    answer: FleetAnswer = run_loop(fan_out(
        opts, lambda off: [Request("GET", "/api/v1/overview", window.params(off),
                                   expect=("events",))],
        needs_offset=window.absolute))
    raise_if_user_error(answer)
    nodes = []
    for o in answer.answered:
        assert o.replies is not None
        reply = dict(o.replies[0], node=o.name)
        nodes.append(correct_obj(reply, answer.offset_ns(o)))
    obj = {"nodes": nodes, **_base(answer)}
    return FleetResult(answer, obj, list(OVERVIEW_COLUMNS), overview_rows(nodes))


def overview_rows(nodes: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for n in nodes:
        chains = n.get("chains") or {}
        rows.append([n.get("node"), n.get("events"), n.get("lost_events"),
                     len(n.get("sessions") or []), chains.get("HIGH", 0),
                     chains.get("MEDIUM", 0), chains.get("LOW", 0), n.get("verdict")])
    return rows
