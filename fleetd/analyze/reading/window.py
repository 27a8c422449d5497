"""The time window an analysis covers: as the user gave it, and resolved against the data.

One type carries the window everywhere: :class:`WindowSpec` is what the CLI, the MCP
tools and the node API take (``--since 5m``, or ``--from/--to``). It is parsed once, at
the edge (:meth:`WindowSpec.bounds`), into :class:`Bounds`: absolute nanoseconds in our
clock with the window's origin, and the one place its errors are worded. Bounds are
passed to a node as query parameters (:meth:`Bounds.params`, read back by
:meth:`WindowSpec.from_params`) and a spec is resolved against a database once
(:meth:`WindowSpec.resolve`) into a :class:`Window`, the half-open span every analyzer
reads.

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
from fleetd.store.bounds import ABSOLUTE, RELATIVE, WHOLE, Bounds
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


def _both_given(since: str | None) -> UsageError:
    return UsageError(f"give either --since {since!r} or --from/--to, not both",
                      "--since 5m means the last five minutes; --from/--to name "
                      "absolute times")


def _not_before(from_: str | None, to: str | None) -> UsageError:
    return UsageError(f"--from {from_!r} is not before --to {to!r}",
                      "swap the two times, or widen the window")


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

    def bounds(self, now_ns: int | None = None) -> Bounds:
        """The window parsed, in our clock: every error a window can have without the
        data is raised here, in one wording."""
        if self.since and self.absolute:
            raise _both_given(self.since)
        if self.since:
            now = now_ns if now_ns is not None else time.time_ns()
            return Bounds(RELATIVE, now - parse_duration(self.since), None, self.since)
        if not self.absolute:
            return Bounds(WHOLE)
        start = parse_timestamp(self.from_) if self.from_ else None
        end = parse_timestamp(self.to) + 1 if self.to else None
        if start is not None and end is not None and end <= start:
            raise _not_before(self.from_, self.to)
        return Bounds(ABSOLUTE, start, end)

    def params(self, offset_ns: int = 0) -> dict[str, str]:
        """:meth:`Bounds.params` of this window, parsed now."""
        return self.bounds().params(offset_ns)

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

    def validate(self) -> Bounds:
        """The window parsed before any node is asked, so its errors surface once."""
        return self.bounds()


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
    now = now_ns if now_ns is not None else time.time_ns()
    bounds = WindowSpec(since, from_, to).bounds(now)
    extent = data_extent(conn)
    if bounds.origin == RELATIVE and bounds.start_ns is not None:
        start, end, label = bounds.start_ns, now + 1, f"last {since}"
    elif bounds.origin == ABSOLUTE:
        start = bounds.start_ns if bounds.start_ns is not None else (
            extent[0] if extent else 0)
        end = bounds.end_ns if bounds.end_ns is not None else (
            extent[1] if extent else now + 1)
        label = f"{format_ns(start)} .. {format_ns(end - 1)}"
        if end <= start:  # an open side filled from the data can still cross the other
            raise _not_before(from_, to)
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
