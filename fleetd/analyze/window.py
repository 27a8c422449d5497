"""The time window an analysis covers: as the user gave it, and resolved against the data.

One type carries the window everywhere: :class:`WindowSpec` is what the CLI, the MCP
tools and the node API take (``--since 5m``, or ``--from/--to``), passed to a node as
query parameters (:meth:`WindowSpec.params`, read back by :meth:`WindowSpec.from_params`)
and resolved against a database once (:meth:`WindowSpec.resolve`) into a
:class:`Window`, the half-open span every analyzer reads.

``--since`` counts back from *now*; a database recorded yesterday and copied here has
nothing in the last five minutes, and saying "no problems found" would be a lie. So the
window keeps warnings that the CLI prints as they are. With no option at all, the
window is the whole recording.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetd.errors import FleetdError, QueryError, UsageError
from fleetd.store.db import present_tables
from fleetd.store.timeparse import format_ns, parse_duration, parse_timestamp


@dataclass(frozen=True, slots=True)
class Window:
    """Half-open ``[start_ns, end_ns)`` in wall-clock UTC ns."""

    start_ns: int
    end_ns: int
    label: str
    warnings: tuple[str, ...] = field(default=())

    @property
    def dur_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    def to_json(self) -> dict[str, object]:
        return {
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "start": format_ns(self.start_ns),
            "end": format_ns(self.end_ns),
            "label": self.label,
        }


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """The window as the user gave it: ``since`` (a duration back from now) or
    ``from_``/``to`` (absolute times, in *our* clock), or nothing (the whole recording)."""

    since: str | None = None
    from_: str | None = None
    to: str | None = None

    @property
    def absolute(self) -> bool:
        return bool(self.from_ or self.to)

    def resolve(self, conn: sqlite3.Connection, now_ns: int | None = None) -> Window:
        """The window over this database, with warnings when it holds nothing there."""
        return resolve_window(conn, self.since or None, self.from_ or None, self.to or None,
                              now_ns)

    def params(self, offset_ns: int = 0) -> dict[str, str]:
        """Query parameters for a node whose clock is ``offset_ns`` ahead of ours.
        ``since`` needs no shift: "the last 5 minutes" by the node's clock is the same
        span of real time."""
        out: dict[str, str] = {}
        if self.since:
            out["since"] = self.since
        if self.from_:
            out["from"] = str(parse_timestamp(self.from_) + offset_ns)
        if self.to:
            out["to"] = str(parse_timestamp(self.to) + offset_ns)
        return out

    @classmethod
    def from_params(cls, q: Mapping[str, str]) -> WindowSpec:
        """What :meth:`params` wrote, as a node reads it from a request."""
        return cls(q.get("since") or None, q.get("from") or None, q.get("to") or None)

    def resolve_request(self, conn: sqlite3.Connection) -> Window:
        """:meth:`resolve` for a peer's request: a bad value is the peer's mistake, so it
        becomes a ``bad_request`` query error (HTTP 400), never a crash."""
        try:
            return self.resolve(conn)
        except FleetdError as exc:
            raise QueryError(exc.message, exc.hint, code="bad_request") from None

    def label(self) -> str:
        if self.since:
            return f"last {self.since}"
        if self.absolute:
            return f"{self.from_ or 'start'} .. {self.to or 'end'}"
        return "whole recording"

    def validate(self) -> None:
        """Parse errors surface once, before any node is asked."""
        self.params(0)


def data_extent(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """[first, last] ns of the stored events and histogram windows; None if no events."""
    row = conn.execute("SELECT min(ts_ns), max(ts_ns) FROM event_data").fetchone()
    if row is None or row[0] is None:
        return None
    # The last event may run past its start; one bounded look at the newest rows is
    # enough to find how far (the index gives them in order).
    end = conn.execute(
        "SELECT max(ts_ns + dur_ns) FROM (SELECT ts_ns, dur_ns FROM event_data "
        "ORDER BY ts_ns DESC LIMIT 1000)"
    ).fetchone()[0]
    first, last = int(row[0]), max(int(row[1]), int(end or row[1]))
    # Histograms cover the calls that were not stored: their windows belong to the data.
    agg = conn.execute("SELECT min(ts_ns), max(ts_ns + dur_ns) FROM aggregate_data").fetchone()
    if agg and agg[0] is not None:
        first, last = min(first, int(agg[0])), max(last, int(agg[1]) - 1)
    # Imported GPU work runs after the calls that launched it (a queued kernel can start
    # long after the last host call): it belongs to the recording too.
    for lo, hi in _imported_extents(conn):
        first, last = min(first, lo), max(last, hi - 1)
    return first, last + 1


def _imported_extents(conn: sqlite3.Connection) -> list[tuple[int, int]]:
    """[first start, last end) of the GPU rows and annotated ranges, in files that have
    those tables (schema 2) and rows in them."""
    tables = present_tables(conn, ("gpu_data", "annotation_data"))
    out = []
    for table in tables:
        lo = conn.execute(f"SELECT min(ts_ns) FROM {table}").fetchone()[0]
        if lo is None:
            continue
        hi = conn.execute(f"SELECT max(ts_ns + dur_ns) FROM (SELECT ts_ns, dur_ns FROM {table} "
                          "ORDER BY ts_ns DESC LIMIT 1000)").fetchone()[0]
        out.append((int(lo), int(hi)))
    return out


def resolve_window(
    conn: sqlite3.Connection,
    since: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    now_ns: int | None = None,
) -> Window:
    """Turn the command-line options into a window, with warnings about empty ones."""
    if since and (from_ or to):
        raise UsageError(
            f"give either --since {since!r} or --from/--to, not both",
            "--since 5m means the last five minutes; --from/--to name absolute times",
        )
    now = now_ns if now_ns is not None else time.time_ns()
    extent = data_extent(conn)
    if since:
        start, end, label = now - parse_duration(since), now + 1, f"last {since}"
    elif from_ or to:
        start = parse_timestamp(from_) if from_ else (extent[0] if extent else 0)
        end = parse_timestamp(to) + 1 if to else (extent[1] if extent else now + 1)
        label = f"{format_ns(start)} .. {format_ns(end - 1)}"
        if end <= start:
            raise UsageError(
                f"--from {from_!r} is not before --to {to!r}",
                "swap the two times, or widen the window",
            )
    elif extent:
        start, end, label = extent[0], extent[1], "whole recording"
    else:
        start, end, label = now, now + 1, "whole recording"
    return Window(start, end, label, tuple(_emptiness_warnings(extent, start, end, since, now)))


def _emptiness_warnings(
    extent: tuple[int, int] | None, start: int, end: int, since: str | None, now: int
) -> list[str]:
    if extent is None:
        return ["the database holds no events yet"]
    first, last = extent
    if last > start and first < end:
        return []
    if since and last <= start:
        age_h = (now - last) / 3.6e12
        return [
            f"no events in the last {since}: this recording ends at {format_ns(last)} "
            f"({age_h:.1f} h ago); drop --since to analyze the whole recording, or use "
            f"--from {format_ns(first)}"
        ]
    return [
        f"no events between {format_ns(start)} and {format_ns(end - 1)}: the recording "
        f"covers {format_ns(first)} .. {format_ns(last)}"
    ]
