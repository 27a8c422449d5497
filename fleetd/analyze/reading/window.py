"""The time window an analysis covers, resolved against the data: :class:`Window`.

The window arrives parsed (:class:`fleetd.store.bounds.Bounds`: from the user's flags,
a tool's arguments or a request's parameters, once) and is resolved against a database
once (:func:`resolve`) into a :class:`Window`, the half-open span every analyzer reads:
its open sides filled from the recording's extent, with warnings when it holds nothing.

``--since`` counts back from *now*; a database recorded yesterday and copied here has
nothing in the last five minutes, and saying "no problems found" would be a lie. So the
window keeps warnings that the CLI prints as they are. With no option at all, the
window is the whole recording.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field

from fleetd.analyze.reading.answers import WindowJson
from fleetd.errors import FleetdError, QueryError, UsageError
from fleetd.store.bounds import ABSOLUTE, RELATIVE, Bounds
from fleetd.store.db import present_tables
from fleetd.store.timeparse import format_ns


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

    def to_json(self) -> WindowJson:
        return {
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "start": format_ns(self.start_ns),
            "end": format_ns(self.end_ns),
            "label": self.label,
        }


def data_extent(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """[first, last] ns of the stored events and histogram windows; None if no events."""
    # Two statements: SQLite reads a lone min() or max() from the end of the time index,
    # but both in one statement walk all of it (0.5 s on a 7 M-event file).
    row = (conn.execute("SELECT min(ts_ns) FROM event_data").fetchone()[0],
           conn.execute("SELECT max(ts_ns) FROM event_data").fetchone()[0])
    if row[0] is None:
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


def resolve(conn: sqlite3.Connection, bounds: Bounds, now_ns: int | None = None) -> Window:
    """The window over this database (a relative one ending now), with warnings when it
    holds nothing; a UsageError when an open side, filled from the data, crosses the
    other."""
    now = now_ns if now_ns is not None else time.time_ns()
    extent = data_extent(conn)
    if bounds.origin == RELATIVE and bounds.start_ns is not None:
        start, end = bounds.start_ns, now + 1
        label = bounds.label()
    elif bounds.origin == ABSOLUTE:
        start = bounds.start_ns if bounds.start_ns is not None else (
            extent[0] if extent else 0)
        end = bounds.end_ns if bounds.end_ns is not None else (
            extent[1] if extent else now + 1)
        label = f"{format_ns(start)} .. {format_ns(end - 1)}"
        if end <= start:
            raise _crossed(bounds, start, end)
    elif extent:
        start, end, label = extent[0], extent[1], bounds.label()
    else:
        start, end, label = now, now + 1, bounds.label()
    return Window(start, end, label,
                  tuple(_emptiness_warnings(extent, start, end, bounds.since, now)))


def resolve_request(conn: sqlite3.Connection, bounds: Bounds) -> Window:
    """:func:`resolve` for a peer's request: a window its data empties is the peer's
    mistake, so it becomes a ``bad_request`` query error (HTTP 400), never a crash."""
    try:
        return resolve(conn, bounds)
    except FleetdError as exc:
        raise QueryError(exc.message, exc.hint, code="bad_request") from None


def resolve_window(conn: sqlite3.Connection, since: str | None = None,
                   from_: str | None = None, to: str | None = None,
                   now_ns: int | None = None) -> Window:
    """:func:`resolve` of the window the user's words give (Bounds.parse), both at
    ``now_ns``: for tests and scripts that hold the words, not a Bounds."""
    now = now_ns if now_ns is not None else time.time_ns()
    return resolve(conn, Bounds.parse(since, from_, to, now), now)


def _crossed(bounds: Bounds, start: int, end: int) -> UsageError:
    """An absolute window with one side open whose other side lies beyond the data."""
    return UsageError(f"the window {bounds.label()} holds no time: filled from the "
                      f"recording, it runs from {format_ns(start)} to {format_ns(end - 1)}",
                      "move --from/--to inside the recording, or drop the open side's "
                      "partner")


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
