"""Collective arrivals from every node, checked, then compared in this machine's clock.

Each node answers ``GET /api/v1/collectives`` with its NCCL collective calls in the window
(rows of :data:`~fleetd.analyze.distributed.collectives.ARRIVAL_COLUMNS`) and the processes that
made
them. The answer is untrusted: the wire's reader (:mod:`fleetd.wire.collectives`)
rebuilds every row from checked values, and one bad value rejects that node's arrivals
(:class:`~fleetd.wire.failure.BadReply`): for ``fleetd collectives``
the node then counts as failed; for ``fleetd explain`` it is a warning, and its chains
and profile are still used. The other nodes are compared without it.

Clocks: a node's arrivals move by the fleet's measured offset, with its error bound
(half the best round trip); a node whose offset is unknown (or not corrected, with
``--no-clock-correction``) compares as unknown or with the whole offset as its error.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from fleetd.analyze.distributed import collectives as coll
from fleetd.fleet.client import FleetClient
from fleetd.fleet.combine import NodeWarning
from fleetd.fleet.dispatch import fan_out
from fleetd.fleet.fanout import (
    VERSION_HINT,
    FleetAnswer,
    FleetOptions,
    NodeWork,
    Plan,
    Request,
    fail,
    send_all,
)
from fleetd.fleet.result import FleetResult, WindowLabel, raise_if_user_error
from fleetd.fleet.targets import Target
from fleetd.questions.catalog import COLLECTIVES
from fleetd.questions.spec import Params
from fleetd.runner import run_loop
from fleetd.store.bounds import Bounds
from fleetd.wire.answers import CollectivesAnswer
from fleetd.wire.collectives import check_reply
from fleetd.wire.failure import BadReply, Failure, NodeFailed
from fleetd.wire.values import printable

QUESTION = COLLECTIVES  # GET /api/v1/collectives
MAX_WARNINGS = 100
MAX_TEXT = 1000
FAILED = "_fleetd_failed"  # the key an optional request's failure is kept under
KIND = "collectives"  # NodeWarning kind: this node's arrivals could not be used
EXPLAIN_ROWS = coll.EXPLAIN_ROWS  # the newest calls per node explain --nodes compares


def request(bounds: Bounds, offset_ns: int, max_rows: int | None = None) -> Request:
    asked = QUESTION.query(bounds, Params({"max_rows": max_rows}), offset_ns)
    return Request("GET", QUESTION.route, asked,
                   expect=("columns", "rows"),
                   check=lambda reply: reply)  # checked whole by check_reply


def node_warnings(reply: Mapping[str, Any], node: str) -> list[NodeWarning]:
    """The node's own window notes, printable and capped (a bad list is ignored: these
    are words for people, nothing is computed from them)."""
    got = reply.get("warnings")
    if not isinstance(got, list):
        return []
    return [NodeWarning(node, printable(w, MAX_TEXT), "window")
            for w in got[:MAX_WARNINGS] if isinstance(w, str)]


# ---- clocks --------------------------------------------------------------------------------


def clocks(answer: FleetAnswer) -> dict[str, coll.Clock]:
    """node -> (offset, error) from the fan-out's clock samples: the measured offset and
    half the best round trip when timestamps are corrected; offset 0 and the offset's size
    (plus that bound) as the error when they are not; unknown error without a sample."""
    out: dict[str, coll.Clock] = {}
    for o in answer.answered:
        s = o.skew
        if s is None:
            out[o.name] = coll.Clock(0, None)
        elif answer.correct:
            out[o.name] = coll.Clock(s.correction_ns, math.ceil(s.error_ns))
        else:
            out[o.name] = coll.Clock(0, math.ceil(abs(s.offset_ns) + s.error_ns))
    return out


# ---- explain: the arrivals beside chains and profile ------------------------------------


def with_arrivals(plan: Plan, bounds: Bounds, max_rows: int | None = None) -> NodeWork:
    """Per node: the plan's requests (any failure fails the node) and, beside them, its
    arrivals, whose failure is only remembered (:data:`FAILED`): an agent without the
    endpoint still has chains and a profile."""
    async def work(client: FleetClient, t: Target, offset: int) -> list[dict[str, object]]:
        extra = asyncio.create_task(_optional(client, t, request(bounds, offset, max_rows)))
        try:
            replies = await send_all(client, t, plan(offset))
        except BaseException:
            extra.cancel()
            raise
        return [*replies, await extra]

    return work


async def _optional(client: FleetClient, t: Target, r: Request) -> dict[str, object]:
    try:
        [reply] = await send_all(client, t, [r])
    except NodeFailed as exc:
        return {FAILED: exc.failure.text()}
    return reply


def from_answer(answer: FleetAnswer, index: int, max_rows: int = coll.DEFAULT_ROWS,
                *, strict: bool = False) -> CollectivesAnswer:
    """The arrival report over the answered nodes' ``index``-th replies. A node whose
    arrivals are missing or malformed is a warning (``strict``: a failed node), and the
    others are compared without it."""
    parts = []
    for o in answer.answered:
        assert o.replies is not None
        reply = o.replies[index] if index < len(o.replies) else {FAILED: "no answer"}
        why = reply.get(FAILED)
        if why is None:
            try:
                parts.append(check_reply(reply, o.name, max_rows))
                if strict:
                    answer.warnings += node_warnings(reply, o.name)
                continue
            except BadReply as exc:
                why = f"{o.target.address}{QUESTION.route} answered a malformed reply ({exc})"
        if strict:
            fail(answer, o, Failure("bad_json", str(why), VERSION_HINT))
        else:
            answer.warnings.append(NodeWarning(
                o.name, f"collective arrivals not compared: {printable(why, MAX_TEXT)}", KIND))
    return coll.analyze(parts, coll.one_machine(clocks(answer), parts))


class CollectivesJson(CollectivesAnswer):
    """``fleetd collectives --nodes``: the arrival report, then the fleet's window,
    nodes, warnings and skew (docs/json.md)."""

    window: WindowLabel
    nodes: list[str]
    warnings: list[dict[str, str]]  # NodeWarning.to_json
    skew: dict[str, dict[str, float]]


def collectives(opts: FleetOptions, bounds: Bounds, max_rows: int | None = None
                ) -> FleetResult[CollectivesJson]:
    """``fleetd collectives --nodes``: every node's arrivals compared in one clock; a
    FleetResult whose ``obj`` is the report with the fleet's warnings and skew."""
    limit = max_rows or coll.DEFAULT_ROWS
    answer: FleetAnswer = run_loop(fan_out(
        opts, lambda off: [request(bounds, off, max_rows)], needs_offset=bounds.absolute))
    raise_if_user_error(answer)
    report = from_answer(answer, 0, limit, strict=True)
    obj: CollectivesJson = {**report, "window": {"label": bounds.label()},
           "nodes": [o.name for o in answer.answered],
           "warnings": [w.to_json() for w in answer.warnings], "skew": answer.skew_json()}
    return FleetResult(answer, obj, list(coll.ROW_COLUMNS), coll.rows(report))
