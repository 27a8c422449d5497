"""NCCL collective calls as one node hands them over: read from its database
(:func:`read_arrivals`), the processes that made them, and the node's clock facts.

This is what ``GET /api/v1/collectives`` answers and what a local read of a file gives
(docs/api.md); :mod:`fleetd.analyze.distributed.collectives` matches the calls of every node into
collective instances and judges them. Each call's entry (``ts_ns``, the node's wall
clock) is the rank's **arrival**; ``seq`` numbers the process's collectives per
communicator handle from when tracing began (docs/schema.md, "NCCL records"), which
:mod:`fleetd.analyze.distributed.align` turns into one numbering across ranks.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import orjson

from fleetd.analyze.reading.data import args_object, in_list, name_of
from fleetd.store.catalog import NCCL_COLLECTIVES
from fleetd.store.clockinfo import (
    SESSION_CLOCK_COLUMNS,
    Clock,
    NodeClock,
    node_boot,
    same_boot,
    session_clock,
)
from fleetd.store.sparse import sparse_only

if TYPE_CHECKING:  # a type only: the registry reads this module's limits at start-up
    from fleetd.analyze.pernode.model import NodeSlice

COLLECTIVES = NCCL_COLLECTIVES.names
COLLECTIVE_CODES: tuple[int, ...] = NCCL_COLLECTIVES.codes

# What one node hands over (GET /api/v1/collectives, and a local read).
MAX_ROWS = 200_000
DEFAULT_ROWS = 100_000
EXPLAIN_ROWS = 20_000  # per node for explain --nodes: a few MB each, thousands of instances
LOCAL_ROWS = 1_000_000  # a local or merged file: bounded only by memory
MAX_BYTES = 16 * 1024 * 1024
ARRIVAL_COLUMNS = ("ts_ns", "dur_ns", "pid", "tid", "op", "ret", "bytes", "seq", "comm_ptr",
                   "comm_hash", "rank", "nranks")
PROCESS_COLUMNS = ("pid", "comm", "rank", "world_size", "job")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One collective call as recorded (the node's own clock)."""

    ts_ns: int
    dur_ns: int
    pid: int
    tid: int
    op: str
    ret: int
    bytes: int
    seq: int | None
    comm_ptr: str | None
    comm_hash: str | None
    rank: int | None  # in the communicator (args), with comm_hash
    nranks: int | None

    def row(self) -> list[Any]:
        return [self.ts_ns, self.dur_ns, self.pid, self.tid, self.op, self.ret, self.bytes,
                self.seq, self.comm_ptr, self.comm_hash, self.rank, self.nranks]


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    comm: str | None
    rank: int | None
    world_size: int | None
    job: str | None

    def row(self) -> list[Any]:
        return [self.pid, self.comm, self.rank, self.world_size, self.job]


class CallTable(TypedDict):
    columns: list[str]
    rows: list[list[Any]]  # one cell per column


class CollectiveCalls(CallTable):
    """The body of ``GET /api/v1/collectives`` (docs/api.md), less node, window and
    warnings: the calls, the processes that made them, the node's clock."""

    processes: CallTable
    clock_error_ns: int | None
    boot_id: str | None
    mono_offset_ns: int | None
    truncated: bool
    truncated_reason: str | None  # rows | bytes


@dataclass(slots=True)
class NodeArrivals:
    """What one node contributes: its collective calls in the window (oldest first), the
    processes that made them, and its own clock error bound."""

    node: str
    arrivals: list[Arrival]
    procs: dict[int, Proc]
    clock_error_ns: int | None = None
    truncated: bool = False
    truncated_reason: str | None = None  # rows | bytes
    boot_id: str | None = None  # the one boot all its sessions ran in
    # wall minus CLOCK_MONOTONIC of the node's timestamps (its last session's mapping):
    # nodes of one boot share the monotonic clock, so this aligns them exactly.
    mono_offset_ns: int | None = None

    def to_json(self) -> CollectiveCalls:
        """The body of ``GET /api/v1/collectives`` (docs/api.md), less node, window and
        warnings."""
        return {"columns": list(ARRIVAL_COLUMNS), "rows": [a.row() for a in self.arrivals],
                "processes": {"columns": list(PROCESS_COLUMNS),
                              "rows": [p.row() for p in self.procs.values()]},
                "clock_error_ns": self.clock_error_ns, "boot_id": self.boot_id,
                "mono_offset_ns": self.mono_offset_ns,
                "truncated": self.truncated, "truncated_reason": self.truncated_reason}


def read_arrivals(sl: NodeSlice, max_rows: int | None = None, max_bytes: int | None = None
                  ) -> NodeArrivals:
    """The node's collective calls in the window, oldest first: the newest ``max_rows``
    (and at most about ``max_bytes`` of JSON) when given (the node API), all of them
    otherwise (a local file is the user's own)."""
    conn, node, win = sl.conn, sl.node, sl.window
    rows = conn.execute(
        "SELECT e.ts_ns, e.dur_ns, e.pid, e.tid, e.op, e.ret, e.bytes, x.args "
        "FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
        "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ? "
        f"AND e.op IN {in_list(COLLECTIVE_CODES)}{sparse_only(COLLECTIVE_CODES)} "
        "ORDER BY e.ts_ns DESC, e.id DESC LIMIT ?",
        (win.start_ns, win.end_ns, node.lo, node.hi,
         -1 if max_rows is None else max_rows + 1))
    out: list[Arrival] = []
    size, reason = 0, None
    for ts, dur, pid, tid, op, ret, nbytes, args in rows:
        if max_rows is not None and len(out) >= max_rows:
            reason = "rows"
            break
        a = _arrival(int(ts), int(dur), int(pid), int(tid), name_of(int(op)), int(ret),
                     int(nbytes), args)
        if max_bytes is not None:
            size += len(orjson.dumps(a.row())) + 1
            if size > max_bytes:
                reason = "bytes"
                break
        out.append(a)
    out.reverse()
    pids = {a.pid for a in out}
    procs = {p.pid: p for p in _processes(conn, node.key) if p.pid in pids}
    error, boot, mono = _clock_error(conn, node.key)
    return NodeArrivals(node.name, out, procs, error, reason is not None, reason, boot, mono)


def _arrival(ts: int, dur: int, pid: int, tid: int, op: str, ret: int, nbytes: int,
             args: Any) -> Arrival:
    d = args_object(args)
    comm_hash = _hex(d.get("comm_hash"), 16, exact=True)
    rank, nranks = _nat(d.get("rank")), _nat(d.get("nranks"))
    if comm_hash is None or rank is None or not nranks or rank >= nranks:
        comm_hash, rank, nranks = None, None, None
    seq = _nat(d.get("seq"))
    return Arrival(ts, max(0, dur), pid, tid, op, ret, max(0, nbytes),
                   seq if seq else None, _hex(d.get("comm"), 16), comm_hash, rank, nranks)


def _hex(v: Any, digits: int, *, exact: bool = False) -> str | None:
    """``0x7f..`` (a pointer, up to ``digits`` hex digits) or ``digits`` hex chars."""
    if not isinstance(v, str):
        return None
    body = v if exact else v.removeprefix("0x")
    ok = (len(body) == digits if exact else 0 < len(body) <= digits) and all(
        c in "0123456789abcdefABCDEF" for c in body)
    return v.lower() if ok else None


def _nat(v: Any) -> int | None:
    """A non-negative integer that fits an int32 (ranks, sizes) or int64 (seq)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63:
        return v
    return None


def _processes(conn: sqlite3.Connection, node_key: int) -> list[Proc]:
    """The node's processes with their torchrun identity (``job`` where the file has it)."""
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(process_data)")}
    job = "job" if "job" in cols else "NULL"
    out = []
    for pid, comm, rank, size, jb in conn.execute(
            f"SELECT pid, comm, rank, world_size, {job} FROM process_data WHERE node = ?",
            (node_key,)):
        out.append(Proc(int(pid), None if comm is None else str(comm),
                        _nat(rank), _nat(size) or None, None if jb is None else str(jb)))
    return out


def _clock_error(conn: sqlite3.Connection, node_key: int
                 ) -> tuple[int | None, str | None, int | None]:
    """The largest clock error bound the node's sessions recorded (None when unknown),
    the boot they all share (None when they do not, or do not say) and, with it, the
    wall-minus-monotonic offset of the last session."""
    sessions = []
    for row in conn.execute(f"SELECT {SESSION_CLOCK_COLUMNS} FROM session_data WHERE node = ?",
                            (node_key,)):
        try:
            sessions.append(session_clock(row))
        except (TypeError, ValueError):
            continue
    if not sessions:
        return None, None, None
    boot, mono = node_boot(sessions)
    return NodeClock("", "", sessions, None, None).error_ns, boot, mono


def one_machine(clocks: Mapping[str, Clock], parts: Sequence[NodeArrivals]
                ) -> dict[str, Clock]:
    """Nodes that ran in one boot of one machine placed against each other exactly
    (:func:`fleetd.store.clockinfo.same_boot`), from the boot and wall-minus-monotonic
    offset each node reported."""
    return same_boot(clocks, {p.node: (p.boot_id, p.mono_offset_ns) for p in parts})


def local_clocks(parts: Sequence[NodeArrivals]) -> tuple[dict[str, Clock], list[str]]:
    """Clocks of a local or merged file: each node as recorded (offset 0), with the error
    its sessions recorded; unknown errors count as 0, with a warning when several nodes
    are compared."""
    clocks: dict[str, Clock] = {}
    unknown = []
    for p in parts:
        clocks[p.node] = Clock(0, p.clock_error_ns if p.clock_error_ns is not None else 0)
        if p.clock_error_ns is None and p.arrivals:
            unknown.append(p.node)
    clocks = one_machine(clocks, parts)
    warnings = []
    if unknown and sum(1 for p in parts if p.arrivals) > 1:
        warnings.append(f"clock error of {', '.join(unknown)} unknown (no trace session "
                        "recorded): arrivals across nodes are compared as recorded")
    return clocks, warnings


def dur_text(ns: int) -> str:
    if abs(ns) >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if abs(ns) >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"
