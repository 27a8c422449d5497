"""A live fleet as exporter input: what :mod:`fleetd.export.pull` spooled, read back
one node after another, each with its clock correction.

A live node's stamps are corrected by the offset the fleet client measured (``fleet``:
minus the node's skew, so its times land in this machine's clock), plus ``--offset``
(``manual``), plus the interpolation between the node's own clock samples
(``recorded``), as for a file. Each node's ``otherData.nodes[].clock`` records what was
applied, and ``otherData.fleet.skew`` what was measured.

What a node sent is data from another machine: every line is checked, and one that is
not JSON, lacks a field, has a field of the wrong type or goes back in time is skipped
with a warning naming the node and the line. It never stops the export.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from fleetd.analyze.window import WindowSpec
from fleetd.errors import NetworkError
from fleetd.export.clockfix import recorded_fix
from fleetd.export.local import chain_from_row
from fleetd.export.model import ChainMark, ClockFix, EventRow, NodeTrace, event_from_api
from fleetd.export.output import check_output, open_output
from fleetd.export.perfetto import NodeStats, write_trace
from fleetd.export.pull import NodePull, PullSpec, Span, pull
from fleetd.fleet.fanout import EXIT_NO_ANSWER, FleetAnswer, FleetOptions
from fleetd.store.clockinfo import SessionClock, session_clock

log = logging.getLogger("fleetd.export.fleet")

MAX_LINE_BYTES = 8 * 1024 * 1024  # above any event's args (SQLite caps a value at 4 MiB)
LINE_WARNINGS = 5  # named per node; the rest are counted
Warn = Callable[[str], None]


class NoNodeExported(NetworkError):
    """Not one node sent its timeline: nothing is written."""

    exit_code = EXIT_NO_ANSWER


@dataclass(frozen=True, slots=True)
class FleetExportOptions:
    window: WindowSpec = field(default_factory=WindowSpec)
    pid: int | None = None
    limit_per_node: int | None = None
    chains: str = "auto"
    correct_clock: bool = True  # False: times as each node recorded them
    offsets: Mapping[str, int] = field(default_factory=dict)  # node -> ns, given by hand


@dataclass(slots=True)
class FleetExport:
    answer: FleetAnswer  # how the fan-out went: status, exit code, node warnings, skew
    stats: list[NodeStats]
    warnings: list[str]  # about the data (lines skipped, names cut), one node each


def export_fleet(opts: FleetOptions, xopts: FleetExportOptions,
                 out: Path | None) -> FleetExport:
    """Pull every node and write one timeline to ``out`` (stdout for None)."""
    span = Span.of(xopts.window, time.time_ns())
    if out is not None:
        check_output(out)
    spec = PullSpec(span, xopts.pid, xopts.limit_per_node, xopts.chains)
    # Spools go beside the output: where the user made room for the trace (a tmpfs
    # /tmp would hold them in memory).
    with tempfile.TemporaryDirectory(prefix=".fleetd-export-",
                                     dir=out.parent if out is not None else None) as tmp:
        answer, pulls = pull(opts, spec, Path(tmp))
        if not pulls:
            raise NoNodeExported(*_nothing(answer))
        warnings: list[str] = []
        traces, starts = [], []
        for p in pulls:
            got = _trace(p, answer, xopts, warnings.append)
            if got is not None:
                traces.append(got[0])
                starts.append(got[1])
        unknown = set(xopts.offsets) - {p.name for p in pulls}
        if unknown:
            warnings.append(f"--offset names node(s) that did not answer: "
                            f"{', '.join(sorted(unknown))}")
        if not traces:
            warnings.append("no events to export in the window")
        origin = min(starts, default=span.start_ns if span.start_ns is not None
                     else time.time_ns())
        with open_output(out) as stream:
            stats = write_trace(traces, stream, origin_ns=origin,
                                meta=_meta(answer, span, warnings))
    return FleetExport(answer, stats, warnings)


def _nothing(answer: FleetAnswer) -> tuple[str, str]:
    """The one-line error when no node sent anything, and its hint."""
    why = [f"{o.name} ({o.failure.kind})" for o in answer.outcomes if o.failure is not None]
    shown = ", ".join(why[:4]) + (f" and {len(why) - 4} more" if len(why) > 4 else "")
    hint = next((o.failure.hint for o in answer.outcomes
                 if o.failure is not None and o.failure.hint), None)
    return (f"no node sent its timeline: {shown}; nothing was written",
            hint or "check the agents and the --nodes addresses, then export again")


def _meta(answer: FleetAnswer, span: Span, warnings: list[str]) -> dict[str, Any]:
    # write_trace writes otherData after the events, so ``warnings`` is complete by then
    # (the spool readers add to it while the events are written).
    skew = {o.name: {"skew_ns": o.skew.correction_ns, "error_ns": round(o.skew.error_ns),
                     "samples": o.skew.used, "corrected": answer.correct}
            for o in answer.outcomes if o.skew is not None}
    return {"source": "fleet", "window": span.to_json(), "fleet": {
        "status": answer.status,
        "answered": f"{len(answer.answered)} of {len(answer.outcomes)} node(s)",
        "skew": skew,
        "node_warnings": [f"node {w.node}: {w.error}" for w in answer.warnings],
    }, "warnings": warnings}


# ---- one node ---------------------------------------------------------------------------


def _trace(p: NodePull, answer: FleetAnswer, xopts: FleetExportOptions,
           warn: Warn) -> tuple[NodeTrace, int] | None:
    """The node's exporter input and its first corrected time; None when it sent no
    event in the window."""
    def note(text: str) -> None:
        warn(f"node {p.name}: {text}")

    for w in p.warnings:
        note(w)
    first = _first_ts(p.events)
    if first is None:
        note("no events in the window")
        return None
    sessions, ranks = _sessions(p.facts.get("sessions"), note)
    processes, threads, more_ranks = _names(p.facts.get("names"), note)
    fix = _clock(p, answer, xopts, sessions, note)
    trace = NodeTrace(p.name, _events(p.events, note), tuple(sorted(ranks | more_ranks)),
                      processes, threads, _chains(p.facts, note), _rates(p.rates, note), fix)
    return trace, fix.apply(first)


def _clock(p: NodePull, answer: FleetAnswer, xopts: FleetExportOptions,
           sessions: list[SessionClock], note: Warn) -> ClockFix:
    o = p.outcome
    offset = xopts.offsets.get(p.name, 0)
    fleet = xopts.correct_clock and answer.correct and o.skew is not None
    if fleet:
        offset -= answer.offset_ns(o)  # the node's clock minus ours: take it back
    source = "+".join(s for s, on in (("fleet", fleet), ("manual", p.name in xopts.offsets))
                      if on)
    if not xopts.correct_clock:
        return ClockFix(offset, source or "none")
    fix, notes = recorded_fix(sessions, offset, source)
    for n in notes:
        note(n)
    if fleet and o.skew is not None:
        # The measured offset is only as good as half the best round trip.
        fix = replace(fix, error_ns=(fix.error_ns or 0) + round(o.skew.error_ns))
    return fix


def _rows(reply: Any, what: str, note: Warn) -> list[list[Any]]:
    """The rows of a query reply, with a note when the node cut them short."""
    if not isinstance(reply, dict):
        return []
    if reply.get("truncated"):
        note(f"{what} cut short by the node's limits ({reply.get('truncated_reason')}); "
             "some tracks may be unnamed")
    return [r for r in reply.get("rows") or [] if isinstance(r, list)]


def _sessions(reply: Any, note: Warn) -> tuple[list[SessionClock], set[int]]:
    sessions: list[SessionClock] = []
    ranks: set[int] = set()
    for row in _rows(reply, "sessions", note):
        try:
            sessions.append(session_clock(row[:7]))
            if row[7] is not None:
                ranks.add(int(row[7]))
        except (TypeError, ValueError, IndexError) as exc:
            note(f"a session row with a bad value skipped ({exc})")
    return sessions, ranks


def _names(reply: Any, note: Warn
           ) -> tuple[dict[int, str], dict[int, tuple[int | None, str | None]], set[int]]:
    processes: dict[int, str] = {}
    threads: dict[int, tuple[int | None, str | None]] = {}
    ranks: set[int] = set()
    for row in _rows(reply, "process and thread names", note):
        try:
            kind, ident, pid, comm, rank = row
            comm = None if comm is None else str(comm)
            if kind == "process":
                if comm is not None:
                    processes[int(ident)] = comm
                if rank is not None:
                    ranks.add(int(rank))
            else:
                threads[int(ident)] = (None if pid is None else int(pid), comm)
        except (TypeError, ValueError) as exc:
            note(f"a process/thread row with a bad value skipped ({exc})")
    return processes, threads, ranks


# ---- chains -----------------------------------------------------------------------------


def _chains(facts: Mapping[str, Any], note: Warn) -> list[ChainMark]:
    marks: list[ChainMark] = []
    for row in _rows(facts.get("stored"), "stored chains", note):
        marks += _checked(chain_from_row, row, note)
    computed = facts.get("computed")
    if isinstance(computed, dict):
        for c in computed.get("chains") or []:
            marks += _checked(ChainMark.from_report, c, note)
    return marks


def _checked(make: Callable[[Any], ChainMark], value: Any, note: Warn) -> list[ChainMark]:
    """One chain from a node, checked where the writer relies on its shape."""
    try:
        mark = make(value)
        if not isinstance(mark.victim, Mapping) or not isinstance(mark.culprit or {},
                                                                  Mapping):
            raise TypeError("victim or culprit is not an object")
        int(mark.victim.get("tid") or 0)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        note(f"a causal chain with a bad value skipped ({exc!r})")
        return []
    return [replace(mark, evidence=[e for e in mark.evidence if _evidence_ok(e)])]


def _evidence_ok(e: Any) -> bool:
    """Evidence the arrows can use: an object with integer times and, if it names one,
    a culprit object with integer ids. Anything else is left out (no arrow)."""
    if not isinstance(e, dict) or not isinstance(e.get("ts_ns"), int):
        return False
    who = e.get("culprit") or {}
    return (isinstance(e.get("dur_ns") or 0, int) and isinstance(who, dict)
            and all(isinstance(who.get(k) or 0, int) for k in ("pid", "tid")))


# ---- the spools -------------------------------------------------------------------------


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The spool's lines; None for one longer than :data:`MAX_LINE_BYTES` (skipped
    without reading it into memory)."""
    while line := f.readline(MAX_LINE_BYTES):
        if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


class _Complaints:
    """Per node: the first few bad lines by number, then how many more."""

    def __init__(self, note: Warn) -> None:
        self.note = note
        self.bad = 0
        self.unknown_ops = 0

    def line(self, lineno: int, why: str) -> None:
        self.bad += 1
        if self.bad <= LINE_WARNINGS:
            self.note(f"events line {lineno} skipped: {why}")

    def close(self) -> None:
        if self.bad > LINE_WARNINGS:
            self.note(f"{self.bad - LINE_WARNINGS} more bad events line(s) skipped")
        if self.unknown_ops:
            self.note(f"{self.unknown_ops} event(s) of ops this fleetd does not know "
                      "skipped (is the agent newer?)")


def _parse(line: bytes | None) -> tuple[EventRow | None, str]:
    """A row, or None and why ("" for a row of an op unknown here)."""
    if line is None:
        return None, f"longer than {MAX_LINE_BYTES} bytes"
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    op = obj.get("op")
    if not isinstance(op, str):  # else it would pass for an op of a newer agent
        return None, ("no field 'op'" if op is None
                      else f"a field of the wrong type (op is a {type(op).__name__})")
    try:
        return event_from_api(obj), ""
    except KeyError as exc:
        return None, f"no field {exc}"
    except (TypeError, ValueError) as exc:
        return None, f"a field of the wrong type ({exc})"


def _events(path: Path, note: Warn) -> Iterator[EventRow]:
    """The node's events in its time order, as the exporter reads them (lazily)."""
    bad = _Complaints(note)
    last: int | None = None
    with open(path, "rb") as f:
        for lineno, line in enumerate(_lines(f), 1):
            if line is not None and not line.strip():
                continue
            row, why = _parse(line)
            if row is None:
                if why:
                    bad.line(lineno, why)
                else:
                    bad.unknown_ops += 1
            elif last is not None and row[1] < last:
                bad.line(lineno, "earlier than the line before (the node sends time order)")
            else:
                last = row[1]
                yield row
    bad.close()


def _first_ts(path: Path) -> int | None:
    """The first good event's time (the warnings come when the events are read)."""
    with open(path, "rb") as f:
        for line in _lines(f):
            row = _parse(line)[0] if line is None or line.strip() else None
            if row is not None:
                return row[1]
    return None


def _rates(path: Path, note: Warn) -> Iterator[tuple[int, int, int]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                ts, dur, calls = orjson.loads(line)
                yield int(ts), int(dur), int(calls or 0)
            except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
                note(f"histogram line {lineno} skipped ({exc})")
