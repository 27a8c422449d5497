"""A live fleet as exporter input: what :mod:`fleetd.export.pull` spooled, read back
one node after another, each with its clock correction.

A live node's stamps are corrected by the offset the fleet client measured (``fleet``:
minus the node's skew, so its times land in this machine's clock), plus ``--offset``
(``manual``), plus the interpolation between the node's own clock samples
(``recorded``), as for a file. Each node's ``otherData.nodes[].clock`` records what was
applied, and ``otherData.fleet.skew`` what was measured.

What a node sent is data from another machine: every line is checked, and one that is
not JSON, lacks a field, has a field of the wrong type or goes back in time is skipped
with a warning naming the node and the line. It never stops the export. Imported GPU
rows and annotated ranges are checked value by value (type, range, string length, inside
the window asked for, time order): a bad row is skipped the same way, and a launch arrow
is only ever drawn to a GPU row that passed, so no arrow is left dangling.
"""

from __future__ import annotations

import heapq
import logging
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

import orjson

from fleetd.analyze.reading import pods
from fleetd.errors import NetworkError
from fleetd.export.clockfix import recorded_fix
from fleetd.export.local import chain_from_row
from fleetd.export.model import (
    AnnotationRow,
    ChainMark,
    ClockFix,
    EventRow,
    GpuRow,
    NodeTrace,
    event_from_api,
)
from fleetd.export.output import check_output, open_output
from fleetd.export.perfetto import NodeStats, Written, write_trace
from fleetd.export.pull import NodePull, PullFacts, PullSpec, pull
from fleetd.fleet.fanout import EXIT_NO_ANSWER, FleetAnswer, FleetOptions
from fleetd.store.bounds import Bounds
from fleetd.store.clockinfo import SessionClock, session_clock
from fleetd.store.schema import SEQ_MASK
from fleetd.wire.pods import read_placement

log = logging.getLogger("fleetd.export.fleet")

MAX_LINE_BYTES = 8 * 1024 * 1024  # above any event's args (SQLite caps a value at 4 MiB)
LINE_WARNINGS = 5  # named per node; the rest are counted
Warn = Callable[[str], None]


class NoNodeExported(NetworkError):
    """Not one node sent its timeline: nothing is written."""

    exit_code = EXIT_NO_ANSWER


@dataclass(frozen=True, slots=True)
class FleetExportOptions:
    window: Bounds = field(default_factory=Bounds)  # parsed once, by the caller
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
                 out: Path | None, written: Written | None = None) -> FleetExport:
    """Pull every node and write one timeline to ``out`` (stdout for None)."""
    span = xopts.window
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
            meta = _meta(answer, span.to_json(), warnings)
            stats = write_trace(traces, stream, origin_ns=origin, meta=meta, written=written)
    return FleetExport(answer, stats, warnings)


def _nothing(answer: FleetAnswer) -> tuple[str, str]:
    """The one-line error when no node sent anything, and its hint."""
    why = [f"{o.name} ({o.failure.kind})" for o in answer.outcomes if o.failure is not None]
    shown = ", ".join(why[:4]) + (f" and {len(why) - 4} more" if len(why) > 4 else "")
    hint = next((o.failure.hint for o in answer.outcomes
                 if o.failure is not None and o.failure.hint), None)
    return (f"no node sent its timeline: {shown}; nothing was written",
            hint or "check the agents and the --nodes addresses, then export again")


class NodeSkewJson(TypedDict):
    """A node's measured clock offset, as ``otherData.fleet.skew`` records it."""

    skew_ns: int
    error_ns: int
    samples: int
    corrected: bool


class FleetStatusJson(TypedDict):
    status: str  # complete | partial | none
    answered: str  # "N of M node(s)"
    skew: dict[str, NodeSkewJson]
    node_warnings: list[str]


class FleetMeta(TypedDict):
    """What a fleet export adds to the trace's ``otherData`` (docs/export.md)."""

    source: str  # fleet
    window: dict[str, object]
    fleet: FleetStatusJson
    warnings: list[str]


def _meta(answer: FleetAnswer, window: dict[str, object], warnings: list[str]
          ) -> FleetMeta:
    # write_trace writes otherData after the events, so ``warnings`` is complete by then
    # (the spool readers add to it while the events are written).
    skew: dict[str, NodeSkewJson] = {
        o.name: {"skew_ns": o.skew.correction_ns, "error_ns": round(o.skew.error_ns),
                 "samples": o.skew.used, "corrected": answer.correct}
        for o in answer.outcomes if o.skew is not None}
    return {"source": "fleet", "window": window, "fleet": {
        "status": answer.status,
        "answered": f"{len(answer.answered)} of {len(answer.outcomes)} node(s)",
        "skew": skew,
        "node_warnings": [f"node {w.node}: {w.error}" for w in answer.warnings],
    }, "warnings": warnings}


# ---- one node ---------------------------------------------------------------------------


MAX_FRAMES = 128  # frames kept per stack from a node
MAX_FRAME_CHARS = 1024


def _trace(p: NodePull, answer: FleetAnswer, xopts: FleetExportOptions,
           warn: Warn) -> tuple[NodeTrace, int] | None:
    """The node's exporter input and its first corrected time; None when it sent no
    event in the window."""
    def note(text: str) -> None:
        warn(f"node {p.name}: {text}")

    for w in p.warnings:
        note(w)
    # The GPU rows are read twice: here, for their launch seqs (the arrows' ids are handed
    # out before the events are written), their first time and the warnings; then by the
    # writer, the same checks on the same bytes giving the same rows.
    launches, gpu_first = _launches(p, note)
    first = min((t for t in (_first_ts(p.events), gpu_first) if t is not None), default=None)
    if first is None:
        note("no events in the window")
        return None
    sessions, ranks = _sessions(p.facts.get("sessions"), note)
    processes, threads, more_ranks = _names(p.facts.get("names"), note)
    _add_pods(processes, p.facts.get("placement"), note)
    fix = _clock(p, answer, xopts, sessions, note)
    trace = NodeTrace(p.name, _events(p.events, note), tuple(sorted(ranks | more_ranks)),
                      processes, threads, _chains(p.facts, note), _rates(p.rates, note), fix,
                      stacks=_stacks(p.facts.get("stacks"), note))
    if p.gpu is not None:
        trace.gpu = _gpu(p.gpu, p.window, _quiet)
        trace.launches = launches
    if p.annotations is not None:
        trace.annotations = _annotations(p.annotations, p.window, note)
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
    # A measured offset is only as good as half the best round trip, and that is all
    # its error: the node's recorded bound is its clock against true time.
    measured = round(o.skew.error_ns) if fleet and o.skew is not None else None
    fix, notes = recorded_fix(sessions, offset, source, measured)
    for n in notes:
        note(n)
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


def _add_pods(processes: dict[int, str], reply: Any, note: Warn) -> None:
    """Each process name gains its pod and container, as the local export names them
    (``python (pod ml/trainer-0, container trainer)``); the node's text is untrusted
    (printable, cut: fleetd.wire.pods)."""
    for row in _rows(reply, "pods", note):
        if len(row) != 6 or type(row[0]) is not int or row[0] not in processes:
            continue
        pid, pod, namespace, name, container, uid = row
        placed = read_placement({"pod": pod, "namespace": namespace,
                                 "container": name or container, "pod_uid": uid})
        processes[pid] += pods.label(placed)


def _stacks(reply: Any, note: Warn) -> dict[int, list[str]]:
    """hash -> frames, from a node: bounded like any node's strings (frames per stack,
    characters per frame); a bad row is skipped with a note."""
    out: dict[int, list[str]] = {}
    bad = 0
    for row in _rows(reply, "stacks", note):
        try:
            h, text = row
            frames = orjson.loads(text)
            if not isinstance(frames, list) or not -(2**63) <= int(h) < 2**63:
                raise ValueError("not a stack")
            out[int(h)] = [str(f)[:MAX_FRAME_CHARS] for f in frames[:MAX_FRAMES]]
        except (TypeError, ValueError):  # orjson.JSONDecodeError is a ValueError
            bad += 1
    if bad:
        note(f"{bad} stack row(s) with a bad value skipped")
    return out


# ---- chains -----------------------------------------------------------------------------


def _chains(facts: PullFacts, note: Warn) -> list[ChainMark]:
    marks: list[ChainMark] = []
    for row in _rows(facts["stored"], "stored chains", note):
        marks += _checked(chain_from_row, row, note)
    computed = facts["computed"]
    chains = computed.get("chains") if computed is not None else None
    for c in chains if isinstance(chains, list) else []:
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

    def __init__(self, note: Warn, what: str = "events line") -> None:
        self.note = note
        self.what = what
        self.bad = 0
        self.unknown_ops = 0

    def line(self, lineno: int, why: str) -> None:
        self.bad += 1
        if self.bad <= LINE_WARNINGS:
            self.note(f"{self.what} {lineno} skipped: {why}")

    def close(self) -> None:
        if self.bad > LINE_WARNINGS:
            self.note(f"{self.bad - LINE_WARNINGS} more bad {self.what}(s) skipped")
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


# ---- imported GPU work ------------------------------------------------------------------

MAX_NAME_CHARS = 16_384  # of a kernel's, copy's or range's name (C++ templates run long)
_U32 = 2**32  # devices, streams, grid and block sizes
_I64 = 2**63  # ids, times, pids, tids, correlation ids, bytes
MAX_DUR_NS = 2**62  # a GPU row or range of more than 146 years is not one
GPU_KINDS = (1, 2, 3)  # kernel, memcpy, memset: sync rows have no slice, never asked for
ANNOTATION_KINDS = (1, 2, 3, 4)  # step, nvtx, user_annotation, cpu_op
LAUNCH_RUN = 65_536  # launch seqs sorted per run, then merged: memory stays 8 bytes each


def _quiet(_: str) -> None:
    """The writer's pass over GPU rows: their warnings were given by the first pass."""


def _what(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _num(value: Any, field: str, hi: int = _I64) -> int:
    """An integer in ``[0, hi)`` (a JSON true is not one), else ValueError naming it."""
    if type(value) is not int:
        raise ValueError(f"{field} is {_what(value)}, not an integer")
    if not 0 <= value < hi:
        raise ValueError(f"{field} {value} is out of range")
    return value


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} is {_what(value)}, not a string")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{field} is {len(value)} characters long (at most "
                         f"{MAX_NAME_CHARS})")
    return value


def _check_width(row: Any, width: int) -> None:
    """ValueError unless ``row`` is a list of ``width`` values: the first check of each
    kind of row a node sends, worded the same for all."""
    if not isinstance(row, list):
        raise ValueError(f"{_what(row)} where a row of {width} values belongs")
    if len(row) != width:
        raise ValueError(f"a row of {len(row)} values, not {width}")


def _ts(value: Any, window: tuple[int, int]) -> int:
    ts = _num(value, "ts_ns")
    if not window[0] <= ts < window[1]:
        raise ValueError(f"ts_ns {ts} is outside the window asked for")
    return ts


def _gpu_row(row: Any, window: tuple[int, int]) -> GpuRow:
    """One row of pull.GPU_SQL as a node sent it; ValueError saying what is wrong."""
    _check_width(row, 18)
    kind = _num(row[6], "kind")
    if kind not in GPU_KINDS:
        raise ValueError(f"kind {kind} is not a kernel (1), copy (2) or set (3)")
    name = _name(row[7], "name")
    gx, gy, gz, bx, by, bz = (_num(v, f, _U32) for v, f in zip(
        row[12:], ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"),
        strict=True))
    return (_num(row[0], "id"), _ts(row[1], window), _num(row[2], "dur_ns", MAX_DUR_NS),
            _num(row[3], "pid"), _num(row[4], "device", _U32),
            _num(row[5], "stream", _U32), kind, name, _num(row[8], "correlation"),
            _num(row[9], "launch", SEQ_MASK + 1), _num(row[10], "bytes"),
            None if row[11] is None else _name(row[11], "collective"), gx, gy, gz, bx, by, bz)


def _annotation_row(row: Any, window: tuple[int, int]) -> AnnotationRow:
    """One row of pull.ANNOTATIONS_SQL as a node sent it; ValueError saying what is
    wrong."""
    _check_width(row, 7)
    kind = _num(row[5], "kind")
    if kind not in ANNOTATION_KINDS:
        raise ValueError(f"kind {kind} is not a step (1), NVTX range (2), user annotation "
                         "(3) or operator (4)")
    name = _name(row[6], "name")
    return (_num(row[0], "id"), _ts(row[1], window), _num(row[2], "dur_ns", MAX_DUR_NS),
            _num(row[3], "pid"), _num(row[4], "tid"), kind, name)


def _checked_rows(path: Path, window: tuple[int, int], note: Warn, what: str,
                  check: Callable[[Any, tuple[int, int]], Any]) -> Iterator[Any]:
    """The good rows of a spool of rows, in time order; the others skipped with a
    warning naming the row (its place in what the node sent) and what was wrong."""
    bad = _Complaints(note, what)
    last: int | None = None
    with open(path, "rb") as f:
        for lineno, line in enumerate(_lines(f), 1):
            if line is None:
                bad.line(lineno, f"longer than {MAX_LINE_BYTES} bytes")
                continue
            try:
                row = check(orjson.loads(line), window)
            except orjson.JSONDecodeError as exc:
                bad.line(lineno, f"not JSON ({exc})")
                continue
            except ValueError as exc:
                bad.line(lineno, str(exc))
                continue
            if last is not None and row[1] < last:
                bad.line(lineno, "earlier than the row before (the node sends time order)")
                continue
            last = row[1]
            yield row
    bad.close()


def _gpu(path: Path, window: tuple[int, int], note: Warn) -> Iterator[GpuRow]:
    return _checked_rows(path, window, note, "GPU row", _gpu_row)


def _annotations(path: Path, window: tuple[int, int], note: Warn) -> Iterator[AnnotationRow]:
    return _checked_rows(path, window, note, "annotation row", _annotation_row)


def _launches(p: NodePull, note: Warn) -> tuple[array[int], int | None]:
    """The launch seqs of exactly the GPU rows the writer will read (ascending, repeats
    kept, as :class:`~fleetd.export.model.NodeTrace` wants them) and the first one's
    time; the rows' warnings are given here."""
    seqs: array[int] = array("q")
    first: int | None = None
    if p.gpu is None:
        return seqs, None
    for row in _gpu(p.gpu, p.window, note):
        if first is None:
            first = row[1]
        if row[9]:
            seqs.append(row[9])
    if seqs and p.file_nodes > 1:
        # Event seqs count per node: in a merged file two nodes' calls can share one,
        # and the events stream does not say which node a call is of.
        note(f"launch arrows left out: the agent serves a file of {p.file_nodes} nodes, "
             "whose launch calls cannot be told apart by number (export the file with "
             "--db for them)")
        return array("q"), first
    return _ascending(seqs), first


def _ascending(seqs: array[int]) -> array[int]:
    """``seqs`` sorted, in runs merged, so the peak stays a few arrays of 8-byte ints
    (a sorted() of them all would hold a Python int per launch)."""
    if all(seqs[i] <= seqs[i + 1] for i in range(len(seqs) - 1)):
        return seqs
    runs = [array("q", sorted(seqs[i:i + LAUNCH_RUN]))
            for i in range(0, len(seqs), LAUNCH_RUN)]
    del seqs
    return array("q", heapq.merge(*runs))
