"""Clock correction of a node's event stream.

The tracer stamps each event with the offset of the *latest* clock sample, so between
two samples a drifting clock leaves events stamped with a stale offset. Interpolating
between the samples removes that error (it is the best estimate the node's own records
give); a constant offset measured by the fleet client, or given by hand, moves the
whole node. Interpolated corrections may swap events that are closer together than
the clock moved, so the corrected stream goes through a small reorder buffer spanning
that much time; a node whose clock jumped more than :data:`MAX_REORDER_NS` between two
samples is left as recorded (the jump is a step, not drift, and the warning says so).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Iterator, Sequence

from fleetd.export.model import ClockFix, EventRow, Piece
from fleetd.store.clockinfo import SessionClock, session_errors

log = logging.getLogger("fleetd.export.clockfix")

MAX_REORDER_NS = 100_000_000


def recorded_fix(sessions: Sequence[SessionClock], offset_ns: int = 0,
                 source: str = "", measured_error_ns: int | None = None
                 ) -> tuple[ClockFix, list[str]]:
    """The correction a node's sessions allow, plus warnings about what it cannot fix.

    ``measured_error_ns``: the error of an offset the fleet client measured (half its
    best round trip), which is then the error of the node's corrected times: the
    recorded bounds are the kernel's, of that clock against true time (16 s when it is
    not synchronised), and say nothing about a clock measured against ours."""
    pieces: list[Piece] = []
    for s in sessions:
        for (m0, o0, _), (m1, o1, _) in zip(s.samples, s.samples[1:], strict=False):
            if o1 != o0 and m1 > m0:
                pieces.append(Piece(m0 + o0, m1 + o0, o1 - o0))
    pieces.sort(key=lambda p: p.start_ns)
    errors = session_errors(sessions)
    if measured_error_ns is not None:
        errors = [measured_error_ns]
    warnings: list[str] = []
    if pieces and max(abs(p.jump_ns) for p in pieces) > MAX_REORDER_NS:
        worst = max(pieces, key=lambda p: abs(p.jump_ns))
        warnings.append(f"the clock stepped {worst.jump_ns / 1e6:.1f} ms between two samples; "
                        "that node's times are exported as recorded")
        pieces = []
    parts = [p for p in (source, "recorded" if pieces else "") if p]
    fix = ClockFix(offset_ns, "+".join(parts) or "none", max(errors) if errors else None,
                   tuple(pieces))
    return fix, warnings


def corrected(events: Iterable[EventRow], fix: ClockFix) -> Iterable[EventRow]:
    """``events`` with corrected ``ts_ns``, still in time order (the same iterable when
    there is nothing to correct: the exporter's loop pays nothing for it)."""
    if fix.pieces:
        return _interpolated(events, fix.pieces, fix.offset_ns, fix.horizon_ns)
    if fix.offset_ns:
        return _shifted(events, fix.offset_ns)
    return events


def _shifted(events: Iterable[EventRow], off: int) -> Iterator[EventRow]:
    for ev in events:
        yield (ev[0], ev[1] + off, *ev[2:])


def _interpolated(events: Iterable[EventRow], pieces: Sequence[Piece], off: int,
                  horizon: int) -> Iterator[EventRow]:
    heap: list[tuple[int, int, EventRow]] = []
    i, last = 0, len(pieces) - 1
    for n, ev in enumerate(events):
        ts = ev[1]
        # Events come in stamped order, so the current piece only moves forward.
        while i < last and pieces[i + 1].start_ns <= ts:
            i += 1
        c = ts + off + pieces[i].delta(ts)
        heapq.heappush(heap, (c, n, ev))
        while heap[0][0] < c - horizon:
            t, _, e = heapq.heappop(heap)
            yield (e[0], t, *e[2:])
    while heap:
        t, _, e = heapq.heappop(heap)
        yield (e[0], t, *e[2:])
