"""The time window an analysis covers, resolved against the data actually stored.

``--since`` counts back from *now*; a database recorded yesterday and copied here has
nothing in the last five minutes, and saying "no problems found" would be a lie. So the
window keeps warnings that the CLI prints as they are. With no option at all, the
window is the whole recording.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field

from fleetd.errors import UsageError
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
    return first, last + 1


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
