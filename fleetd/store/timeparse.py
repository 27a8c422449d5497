"""Durations (``30s``, ``5m``, ``2h``, ``1d``) and timestamps given on the command line."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from fleetd.errors import UsageError

_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
    "d": 86400 * 1_000_000_000,
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|ms|s|m|h|d)\s*$")
# Times and durations are stored as SQLite's signed 64-bit integers: anything beyond
# this cannot be compared with a stored timestamp, so it is refused here, where the
# message can still name the value, instead of overflowing deep in a query.
MAX_NS = 2**63 - 1


def parse_duration(text: str) -> int:
    """``"5m"`` -> nanoseconds. A unit is required: a bare ``300`` is ambiguous."""
    m = _DURATION.match(text or "")
    if not m:
        raise UsageError(
            f"invalid duration {text!r}",
            "use a number with a unit: 30s, 5m, 2h, 1d (also ms, us, ns)",
        )
    value = float(m.group(1)) * _UNITS_NS[m.group(2)]
    if not value < MAX_NS:  # also catches inf from a number too long for a float
        raise UsageError(f"invalid duration {text!r}: longer than fleetd can store",
                         "use a duration below 100000d")
    if value <= 0:
        raise UsageError(f"invalid duration {text!r}: must be more than zero",
                         "use a positive number with a unit: 30s, 5m, 2h, 1d")
    return int(value)


def parse_timestamp(text: str) -> int:
    """An absolute time -> wall-clock ns (UTC), within 1970 .. 2262 (what fits in the
    stored 64-bit nanoseconds).

    See :func:`_parse_timestamp` for the accepted forms.
    """
    ns = _parse_timestamp(text)
    if not 0 <= ns <= MAX_NS:
        raise UsageError(f"time {text!r} is outside what fleetd can store (1970 .. 2262)",
                         "use a time after 1970-01-01, e.g. 2026-11-22T10:00:00Z or now-5m")
    return ns


def _parse_timestamp(text: str) -> int:
    """An absolute time -> wall-clock ns (UTC).

    Accepts ISO 8601 (``2026-11-22T10:00:00Z``, ``2026-11-22 10:00:00+01:00``; no zone
    means UTC), epoch seconds (``1763800000``, ``1763800000.5``) or epoch ns (19 digits),
    and ``now`` / ``now-5m``.
    """
    s = (text or "").strip()
    if s.startswith("now"):
        rest = s[3:].strip()
        if not rest:
            return time.time_ns()
        if rest.startswith("-"):
            return time.time_ns() - parse_duration(rest[1:])
    elif re.fullmatch(r"\d{19}", s):
        return int(s)
    elif re.fullmatch(r"\d{9,11}(\.\d+)?", s):
        return int(float(s) * 1e9)
    else:
        try:
            dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
            return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000
        except (ValueError, OverflowError):
            pass  # falls through to the one error message below
    raise UsageError(
        f"invalid time {text!r}",
        "use ISO 8601 (2026-11-22T10:00:00Z), epoch seconds, or now-5m",
    )


def format_ns(ts_ns: int) -> str:
    """Wall-clock ns -> ``2026-11-22T10:00:00.123456Z``."""
    dt = datetime.fromtimestamp(ts_ns / 1e9, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
