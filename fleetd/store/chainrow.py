"""The one row layout of a stored causal chain (``chain_data``, the ``chains`` view).

``explain --store`` writes chains in it, the batch writer inserts it, the exporter and
the fleet client read it back from a file or from a node. Every one of them takes the
columns from here, so a new column is added once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import orjson

# What a chain version stores, besides its identity (node, seq, key, version, created_ns).
CHAIN_FIELDS = (
    "ts_ns", "dur_ns", "severity", "root_cause", "summary", "op", "victim_pid", "victim_tid",
    "victim_comm", "culprit_pid", "culprit_comm", "explained", "impact", "evidence", "fixes",
)
# The latest version of each stored chain, as the timeline shows it.
STORED_CHAIN_COLUMNS = ", ".join(("id", *CHAIN_FIELDS))
# Chains that overlap a window; takes (end_ns, start_ns).
STORED_CHAIN_WINDOW = "ts_ns < ? AND ts_ns + dur_ns >= ?"


class ChainRow(TypedDict):
    """A chain version as the batch writer stores it: :data:`CHAIN_FIELDS` and the
    ``key`` that picks the version."""

    ts_ns: int
    dur_ns: int
    severity: str
    root_cause: str
    summary: str
    op: str | None
    victim_pid: int
    victim_tid: int
    victim_comm: str | None
    culprit_pid: int | None
    culprit_comm: str | None
    explained: float
    impact: float
    # explain's evidence items (fleetd.analyze.reading.answers.EvidenceItem, a layer
    # above this one), stored as JSON text
    evidence: Sequence[Mapping[str, object]]
    fixes: list[str]
    key: str


def chain_row(c: Mapping[str, Any]) -> ChainRow:
    """A chain of ``explain``'s JSON (its ChainJson) as a row to store."""
    culprit = c["culprit"] or {}
    victim = c["victim"]
    return {"ts_ns": c["ts_ns"], "dur_ns": c["dur_ns"], "severity": c["severity"],
            "root_cause": c["root_cause"], "summary": c["summary"], "op": c["op"],
            "victim_pid": victim["pid"], "victim_tid": victim["tid"],
            "victim_comm": victim["comm"], "culprit_pid": culprit.get("pid"),
            "culprit_comm": culprit.get("comm"), "explained": c["explained"],
            "impact": c["impact"], "evidence": c["evidence"], "fixes": c["fixes"],
            "key": c["key"]}


def stored_chain(row: Sequence[Any]) -> dict[str, Any]:
    """One row of :data:`STORED_CHAIN_COLUMNS` by name, ``evidence`` and ``fixes`` parsed
    (a list, empty when unreadable: the row may come from a peer). ValueError when the
    row has the wrong width."""
    out = dict(zip(("id", *CHAIN_FIELDS), row, strict=True))
    out["evidence"] = _json_list(out["evidence"])
    out["fixes"] = _json_list(out["fixes"])
    return out


def _json_list(text: str | None) -> list[Any]:
    try:
        value = orjson.loads(text or "[]")
    except (orjson.JSONDecodeError, TypeError):
        return []
    return value if isinstance(value, list) else []
