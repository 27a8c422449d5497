"""One node's overview: event counts by source, trace sessions, chain counts, top ops.

Shared by the agent's ``GET /api/v1/overview`` and ``fleetd overview --db``.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from fleetd.analyze.causes.chains import SEVERITY_RANK
from fleetd.analyze.explain import report as explain_report
from fleetd.analyze.pernode.model import NodeSlice
from fleetd.analyze.reading.answers import OverviewAnswer, OverviewSession
from fleetd.analyze.reading.data import nodes
from fleetd.analyze.reading.window import Window

SESSION_COLUMNS = ("id", "started_ns", "ended_ns", "end_reason", "lost_events", "rank",
                   "world_size", "headers_route")


def overview(conn: sqlite3.Connection, win: Window, node: str) -> OverviewAnswer:
    """The overview of ``node`` (a database may hold several, after a merge)."""
    found = nodes(conn, node)
    return node_overview(conn, win, node, NodeSlice(conn, found[0], win) if found else None)


def node_overview(conn: sqlite3.Connection, win: Window, node: str, sl: NodeSlice | None
                  ) -> OverviewAnswer:
    """:func:`overview` over the node's slice (None: the node is not in this file)."""
    lo, hi = (sl.node.lo, sl.node.hi) if sl else (0, -1)
    # The node's events are one range of row ids, so this stays on the primary key.
    by_source = dict(conn.execute(
        "SELECT o.source, count(*) FROM event_data e JOIN ops o ON o.code = e.op "
        "WHERE e.id BETWEEN ? AND ? AND e.ts_ns >= ? AND e.ts_ns < ? GROUP BY o.source",
        (lo, hi, win.start_ns, win.end_ns)).fetchall())
    have = {r[1] for r in conn.execute("PRAGMA table_info(sessions)")}
    cols = ", ".join(c if c in have else f"NULL AS {c}" for c in SESSION_COLUMNS)
    sessions = [_session(r) for r in conn.execute(
        f"SELECT {cols} FROM sessions WHERE node = ? ORDER BY started_ns", (node,))]
    report = explain_report([sl] if sl else [], win)
    severities = {s: sum(1 for c in report["chains"] if c["severity"] == s)
                  for s in SEVERITY_RANK}
    top = sorted(report["ops"], key=lambda r: -int(r.get("total_ns") or 0))[:10]
    return {"node": node, "window": report["window"], "events": sum(by_source.values()),
            "by_source": by_source, "sessions": sessions,
            "lost_events": sum(int(s["lost_events"] or 0) for s in sessions),
            "crashed_sessions": sum(1 for s in sessions if s["end_reason"] == "crashed"),
            "chains": severities, "verdict": report["verdict"], "top_ops": top,
            "warnings": report["warnings"]}


def _session(row: tuple[Any, ...]) -> OverviewSession:
    """A ``sessions`` row read in :data:`SESSION_COLUMNS` order."""
    sid, started, ended, reason, lost, rank, size, route = row
    return OverviewSession(id=sid, started_ns=started, ended_ns=ended, end_reason=reason,
                           lost_events=lost, rank=rank, world_size=size, headers_route=route)
