"""What an exporter consumes: per node, a time-ordered stream of event rows and a few
small facts (names, ranks, chains, clock correction).

The same shapes come from a local database (:mod:`fleetd.export.local`) and from a live
node's ``/api/v1/events`` stream (:func:`event_from_api`), so the exporters never know
where their rows came from.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

import orjson

from fleetd.analyze.reading.answers import ChainJson
from fleetd.store.catalog import BY_NAME


class ByteSink(Protocol):
    """Where a trace is written: a file, a gzip stream, a socket's writer."""

    def write(self, data: bytes, /) -> object: ...


# (rowkey, ts_ns, dur_ns, pid, tid, op, ret, bytes, peer, a0, a1, stack, args JSON or None)
# rowkey's low 40 bits are the event's seq (its id is node:seq); ts_ns is the start.
EventRow = tuple[int, int, int, int, int, int, int, int, int, int, int, int, str | None]
ROW_FIELDS: tuple[str, ...] = (
    "rowkey", "ts_ns", "dur_ns", "pid", "tid", "op", "ret", "bytes", "peer", "a0", "a1",
    "stack", "args",
)
# Imported GPU work (gpu_data): (rowkey, ts_ns, dur_ns, pid, device, stream, kind, name,
# correlation, launch seq (0: none), bytes, collective or None, grid x/y/z, block x/y/z).
GpuRow = tuple[int, int, int, int, int, int, int, str, int, int, int, str | None,
               int, int, int, int, int, int]
# Imported host ranges (annotation_data): (rowkey, ts_ns, dur_ns, pid, tid, kind, name).
AnnotationRow = tuple[int, int, int, int, int, int, str]


def task_name(comm: str | None, pid: int | None, thread: str | None, tid: int) -> str:
    """The one pattern the timeline names a task by, on tracks, in args and on markers:
    ``comm[pid]`` for a process's main thread, ``comm[pid] thread tid N`` for another of
    its threads (the thread's own name only when it differs from the process's)."""
    who = comm or thread or "?"
    text = f"{who}[{'?' if pid is None else pid}]"
    if tid != pid:
        if thread and thread != who:
            text += f" {thread}"
        text += f" tid {tid}"
    return text


def event_from_api(obj: Mapping[str, Any]) -> EventRow | None:
    """One NDJSON object of ``/api/v1/events`` as a row; None for an op unknown here."""
    op = BY_NAME.get(str(obj.get("op")))
    if op is None:
        return None
    args = obj.get("args")
    if args is not None and not isinstance(args, str):
        args = orjson.dumps(args).decode()
    return (int(obj["rowkey"]), int(obj["ts_ns"]), int(obj["dur_ns"]), int(obj["pid"]),
            int(obj["tid"]), op.code, int(obj.get("ret") or 0), int(obj.get("bytes") or 0),
            int(obj.get("peer") or 0), int(obj.get("a0") or 0), int(obj.get("a1") or 0),
            int(obj.get("stack") or 0), args)


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of stamped time over which the correction grows linearly from 0 to
    ``jump`` (the wall clock's drift between two offset samples)."""

    start_ns: int
    end_ns: int
    jump_ns: int

    def delta(self, ts: int) -> int:
        if self.start_ns <= ts < self.end_ns:
            return self.jump_ns * (ts - self.start_ns) // (self.end_ns - self.start_ns)
        return 0


class ClockFixJson(TypedDict):
    """How a node's stamps were corrected, as the trace's ``otherData.nodes[].clock``
    records it (docs/export.md)."""

    source: str
    offset_ns: int
    error_ns: int | None
    interpolated_pieces: int
    max_interpolated_ns: int


@dataclass(frozen=True, slots=True)
class ClockFix:
    """How a node's timestamps are corrected: a constant ``offset_ns`` (measured by the
    fleet client, or given by hand) plus ``pieces`` interpolated between the node's own
    clock samples (recorded in its sessions)."""

    offset_ns: int = 0
    source: str = "none"  # none | recorded | fleet | manual, joined with '+'
    error_ns: int | None = None  # what the correction cannot remove
    pieces: tuple[Piece, ...] = ()

    @property
    def horizon_ns(self) -> int:
        """How far correction can reorder events: the largest jump between samples."""
        return max((abs(p.jump_ns) for p in self.pieces), default=0)

    def apply(self, ts: int) -> int:
        """The corrected time of one stamp (for the few non-event items)."""
        if not self.pieces:
            return ts + self.offset_ns
        i = bisect.bisect_right(self.pieces, ts, key=lambda p: p.start_ns) - 1
        return ts + self.offset_ns + (self.pieces[i].delta(ts) if i >= 0 else 0)

    def to_json(self) -> ClockFixJson:
        return {
            "source": self.source,
            "offset_ns": self.offset_ns,
            "error_ns": self.error_ns,
            "interpolated_pieces": len(self.pieces),
            "max_interpolated_ns": self.horizon_ns,
        }


@dataclass(frozen=True, slots=True)
class ChainMark:
    """A causal chain as the timeline shows it (from chain_history rows or explain JSON)."""

    id: str
    severity: str
    root_cause: str
    summary: str
    ts_ns: int
    dur_ns: int
    op: str | None = None
    victim: Mapping[str, Any] = field(default_factory=dict)
    culprit: Mapping[str, Any] | None = None
    fixes: Sequence[str] = ()
    evidence: Sequence[Mapping[str, Any]] = ()
    explained: float | None = None
    impact: float | None = None

    @classmethod
    def from_report(cls, c: ChainJson) -> ChainMark:
        """A chain of ``explain``'s JSON (also what the node API's chains endpoint sends,
        checked by fleetd.wire.chains)."""
        return cls(str(c["id"]), str(c["severity"]), str(c["root_cause"]), str(c["summary"]),
                   int(c["ts_ns"] or 0), int(c["dur_ns"] or 0), c.get("op"),
                   dict(c.get("victim") or {}), c.get("culprit"), list(c.get("fixes") or ()),
                   list(c.get("evidence") or ()), c.get("explained"), c.get("impact"))


@dataclass(slots=True)
class NodeTrace:
    """One node's part of a timeline. ``events`` must be ordered by ``ts_ns`` (then id),
    as the database index and ``/api/v1/events`` deliver them; it is read once."""

    name: str
    events: Iterable[EventRow]
    ranks: tuple[int, ...] = ()
    processes: Mapping[int, str] = field(default_factory=dict)  # pid -> comm
    threads: Mapping[int, tuple[int | None, str | None]] = field(default_factory=dict)
    chains: Sequence[ChainMark] = ()
    rates: Iterable[tuple[int, int, int]] = ()  # (ts_ns, dur_ns, calls) from histograms
    clock: ClockFix = field(default_factory=ClockFix)
    # Imported GPU timelines (empty for recorded nodes): GPU rows and annotated ranges,
    # each in time order, and the launch seqs of the GPU rows, ascending with repeats.
    gpu: Iterable[GpuRow] = ()
    annotations: Iterable[AnnotationRow] = ()
    launches: Sequence[int] = ()
    # Recorded user stacks (stacks.hash -> frames, innermost first) of the events: a
    # slice with a stack carries its frames.
    stacks: Mapping[int, Sequence[str]] = field(default_factory=dict)
