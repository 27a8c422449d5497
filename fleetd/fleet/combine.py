"""Combining per-node result sets into one, and ``--reduce``: SQL over the merged rows.

Not to be confused with :mod:`fleetd.store.merge`, which merges node databases into one
file; this module only joins the rows that nodes returned to a fleet query.

Every merged row starts with the ``node`` it came from. Nodes normally return the same
columns; when one does not (another schema version, a ``SELECT *`` over a changed view),
its rows are aligned by column name into the union of all columns, with NULL where a
node lacks a column, and a warning names the node and the difference. Nothing is
dropped silently.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetd.errors import QueryError, UsageError
from fleetd.store.guard import Limits, SafeDB

log = logging.getLogger("fleetd.fleet.combine")

REDUCE_TABLE = "merged"
REDUCE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class NodeWarning:
    """One line of ``warnings``: which node, what went wrong, and the kind of problem."""

    node: str
    error: str
    kind: str  # refused | unreachable | tls | timeout | disconnected | http | bad_json |
    #            skew | columns | truncated | name

    def to_json(self) -> dict[str, str]:
        return {"node": self.node, "error": self.error, "kind": self.kind}


@dataclass(slots=True)
class NodeRows:
    node: str
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False
    truncated_reason: str | None = None


@dataclass(slots=True)
class Merged:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False
    warnings: list[NodeWarning] = field(default_factory=list)


def merge(parts: Sequence[NodeRows]) -> Merged:
    """Rows of every node, each led by its node name, in the order the nodes were given.

    A result that has a ``node`` column of its own (``SELECT node, ...`` or the events
    view's columns) keeps it, moved to the front, instead of getting a second one: an
    agent serving a merged database knows each row's node better than we do.
    """
    if not parts:
        return Merged(["node"], [])
    parts = [_lead_with_node(p) for p in parts]
    reference = _reference_columns(parts)
    union = list(reference)
    for p in parts:
        union += [c for c in p.columns if c not in union]
    out = Merged(["node", *union], [])
    for p in parts:
        if p.columns == reference and union == reference:
            out.rows += p.rows
        else:
            out.rows += _aligned(p, union)
            if p.columns != reference:
                out.warnings.append(_mismatch(p, reference))
        if p.truncated:
            out.truncated = True
            out.warnings.append(NodeWarning(
                p.node, f"result truncated at {len(p.rows)} rows (limit on "
                f"{p.truncated_reason or 'rows'}); narrow the query or raise --limit",
                "truncated"))
    return out


def _reference_columns(parts: Sequence[NodeRows]) -> list[str]:
    """The column list most nodes returned (ties: the first node's)."""
    counts = Counter(tuple(p.columns) for p in parts)
    top = max(counts.values())
    for p in parts:
        if counts[tuple(p.columns)] == top:
            return list(p.columns)
    return list(parts[0].columns)


def _aligned(p: NodeRows, union: list[str]) -> list[list[Any]]:
    # By name; with duplicate names in one node's columns the first one wins.
    pos: dict[str, int] = {}
    for i, c in enumerate(p.columns):
        pos.setdefault(c, i)
    picks = [pos.get(c) for c in union]
    return [[r[0], *(r[i + 1] if i is not None else None for i in picks)] for r in p.rows]


def _lead_with_node(p: NodeRows) -> NodeRows:
    """The part with its rows led by their node; ``columns`` without that column."""
    if "node" not in p.columns:
        return NodeRows(p.node, list(p.columns), [[p.node, *r] for r in p.rows],
                        p.truncated, p.truncated_reason)
    i = p.columns.index("node")
    cols = p.columns[:i] + p.columns[i + 1:]
    rows = [[r[i], *r[:i], *r[i + 1:]] for r in p.rows]
    return NodeRows(p.node, cols, rows, p.truncated, p.truncated_reason)


def _mismatch(p: NodeRows, reference: list[str]) -> NodeWarning:
    missing = [c for c in reference if c not in p.columns]
    extra = [c for c in p.columns if c not in reference]
    parts = []
    if missing:
        parts.append(f"lacks {', '.join(missing)} (null in its rows)")
    if extra:
        parts.append(f"adds {', '.join(extra)} (null in the other nodes' rows)")
    if not parts:
        parts.append(f"orders them {', '.join(p.columns)}")
    return NodeWarning(p.node, f"columns differ from the other nodes': {'; '.join(parts)}; "
                       "rows were aligned by column name", "columns")


# ---- --reduce -------------------------------------------------------------------------


def unique_names(columns: Sequence[str]) -> list[str]:
    """Column names made unique for a table: a second ``n`` becomes ``n_2``."""
    taken: set[str] = set()
    out = []
    for c in columns:
        name, k = c, 1
        while name in taken:
            k += 1
            name = f"{c}_{k}"
        taken.add(name)
        out.append(name)
    return out


def reduce(merged: Merged, sql: str, timeout_s: float = REDUCE_TIMEOUT_S
           ) -> tuple[list[str], list[list[Any]]]:
    """Run ``sql`` over the merged rows, loaded as table ``merged`` of a guarded scratch
    database: the same sandbox and limits as a query of a file. A result over the row or
    byte limit is cut there and marks ``merged`` truncated."""
    names = unique_names(merged.columns)
    rows = ([_cell(v) for v in r] for r in merged.rows)
    with SafeDB.in_memory(REDUCE_TABLE, names, rows, Limits(timeout_s=timeout_s)) as db:
        try:
            result = db.query(sql)
        except QueryError as exc:
            raise UsageError(
                f"--reduce {sql!r} failed: {_reason(exc)}",
                f"it runs over table {REDUCE_TABLE}({', '.join(names)}); one SELECT, "
                "e.g. --reduce \"SELECT avg(n) FROM merged\"") from None
    if result.truncated:
        merged.truncated = True
        log.warning("--reduce result truncated at %d rows (limit on %s)", len(result.rows),
                    result.truncated_reason)
    return result.columns, [list(r) for r in result.rows]


def _reason(exc: QueryError) -> str:
    """SQLite's own words where it refused the statement, else the guard's."""
    cause = exc.__cause__
    return str(cause) if isinstance(cause, sqlite3.Error) else exc.message


def _cell(value: Any) -> Any:
    if isinstance(value, list | dict):
        return repr(value)  # JSON rows hold only scalars; be safe anyway
    return value
