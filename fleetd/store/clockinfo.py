"""What a node's trace sessions say about its clock, and when nodes cannot be aligned.

Every node stamps events with its own wall clock (monotonic + a sampled offset). Offline
there is no way to measure one node's clock against another's; what the files do hold
is each clock's own error bound (sampling window + the kernel's ``maxerror``), the
offset samples taken during each session (a jump between two is an NTP step), and the
span of the events. From those, :func:`clock_warnings` says when events of two nodes
cannot be compared to better than a threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.store.clockinfo")

# The session columns a clock correction needs, in this order: from a file's
# ``session_data``/``sessions``, or from a node's sessions view over the API.
SESSION_CLOCK_COLUMNS = (
    "seq, boot_id, started_ns, ended_ns, mono_offset_ns, clock_error_ns, clock_samples")


@dataclass(frozen=True, slots=True)
class SessionClock:
    seq: int
    boot_id: str | None
    started_ns: int
    ended_ns: int | None
    mono_offset_ns: int  # wall = monotonic + offset, at the session's start
    error_ns: int | None  # the session's clock error bound
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (mono, offset, error)


def session_clock(row: Sequence[Any]) -> SessionClock:
    """One row of :data:`SESSION_CLOCK_COLUMNS`; TypeError/ValueError when a value has
    the wrong type (a row from a peer is not trusted)."""
    seq, boot, start, end, off, err, samples = row
    return SessionClock(int(seq), None if boot is None else str(boot), int(start),
                        None if end is None else int(end), int(off),
                        None if err is None else int(err), clock_samples(samples))


def clock_samples(text: str | None) -> list[tuple[int, int, int]]:
    """The ``clock_samples`` JSON of a session: ``[(mono, offset, error), ...]``; an
    unreadable value is logged and read as no samples (the session's offset remains)."""
    if not text:
        return []
    try:
        return [(int(m), int(o), int(e)) for m, o, e in orjson.loads(text)]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        log.warning("unreadable clock_samples %.60r ignored", text)
        return []


@dataclass(slots=True)
class NodeClock:
    name: str
    where: str  # the file it comes from, for messages
    sessions: list[SessionClock]
    first_ns: int | None  # earliest event
    last_ns: int | None

    @property
    def error_ns(self) -> int | None:
        """The largest error bound any session or sample recorded; None when unknown."""
        errs = [s.error_ns for s in self.sessions if s.error_ns is not None]
        errs += [e for s in self.sessions for _, _, e in s.samples]
        return max(errs) if errs else None


def fmt_ns(ns: int) -> str:
    """A duration for messages: 850 us, 12.3 ms, 4.20 s, 2.0 h."""
    a = abs(ns)
    if a >= 3_600_000_000_000:
        return f"{ns / 3.6e12:.1f} h"
    if a >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if a >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


def clock_warnings(nodes: Sequence[NodeClock], threshold_ns: int) -> list[str]:
    """Reasons the nodes' timelines may be misaligned by more than ``threshold_ns``."""
    out: list[str] = []
    several = len(nodes) > 1
    for n in nodes:
        if several and not n.sessions and n.first_ns is not None:
            out.append(f"node {n.name!r} ({n.where}) has no trace sessions, so no clock "
                       "information: its times cannot be checked against the other nodes")
        out += _steps(n, threshold_ns)
    if several:
        out += _bounds(nodes, threshold_ns) + _overlap(nodes)
    return out


def _steps(n: NodeClock, threshold_ns: int) -> list[str]:
    """Jumps of the wall clock against monotonic: inside a session, or between sessions
    of one boot (monotonic time continues across them, so the offset should too)."""
    out: list[str] = []
    for s in n.sessions:
        for (_, o0, _), (m1, o1, _) in zip(s.samples, s.samples[1:], strict=False):
            if abs(o1 - o0) > threshold_ns:
                out.append(
                    f"node {n.name!r}: the wall clock moved {fmt_ns(o1 - o0)} against "
                    f"monotonic during session {s.seq} (around {format_ns(m1 + o1)}), an NTP "
                    "step: events near it may be misplaced by up to that much")
                break
    by_boot: dict[str, list[SessionClock]] = {}
    for s in n.sessions:
        if s.boot_id:
            by_boot.setdefault(s.boot_id, []).append(s)
    for group in by_boot.values():
        offsets = [s.mono_offset_ns for s in group]
        if max(offsets) - min(offsets) > threshold_ns:
            out.append(
                f"node {n.name!r}: sessions {', '.join(str(s.seq) for s in group)} of one boot "
                f"disagree on the clock offset by {fmt_ns(max(offsets) - min(offsets))} (the "
                "clock was stepped between them)")
    return out


def _bounds(nodes: Sequence[NodeClock], threshold_ns: int) -> list[str]:
    known = sorted(((n.error_ns, n.name) for n in nodes if n.error_ns is not None),
                   reverse=True)
    if len(known) < 2:
        return []
    (ea, a), (eb, b) = known[0], known[1]
    if ea + eb <= threshold_ns:
        return []
    return [f"nodes {a!r} (clock error ±{fmt_ns(ea)}) and {b!r} (±{fmt_ns(eb)}) can only be "
            f"aligned to within ±{fmt_ns(ea + eb)}, above the {fmt_ns(threshold_ns)} threshold: "
            "treat smaller cross-node gaps as noise, and check NTP/chrony on those nodes"]


def _overlap(nodes: Sequence[NodeClock]) -> list[str]:
    spans = [(n.first_ns, n.last_ns, n.name) for n in nodes
             if n.first_ns is not None and n.last_ns is not None]
    if len(spans) < 2:
        return []
    late = max(spans, key=lambda s: s[0])
    early = min(spans, key=lambda s: s[1])
    if late[0] <= early[1]:
        return []
    return [f"the recordings do not overlap in time: {early[2]!r} ends at {format_ns(early[1])}, "
            f"{late[2]!r} starts at {format_ns(late[0])} ({fmt_ns(late[0] - early[1])} later); "
            "they are different runs, or a clock is off by about that much"]
