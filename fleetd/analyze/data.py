"""Reading one node's slice of a database: the shared plumbing of the analyzers.

Every query goes to the raw tables with the window on ``ts_ns`` (the indexed column)
and the node as an id range (``id >> 40`` is the node key), so a merged file with many
nodes is read one node at a time without the joins of the ``events`` view.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleetd.analyze.window import Window
from fleetd.store.catalog import BY_CODE, BY_NAME, OPS
from fleetd.store.schema import SEQ_BITS

MAX_AGG_WINDOW_NS = 3600 * 10**9  # aggregate windows are flushed far more often than this
CALL_SOURCES = frozenset({"cuda", "graph", "driver", "nccl"})
CALL_CODES: tuple[int, ...] = tuple(o.code for o in OPS if o.source in CALL_SOURCES)
SYNC_OPS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "cuCtxSynchronize", "cuStreamSynchronize", "cudaMemcpy", "cuMemcpyDtoH_v2",
})
LAUNCH_OPS = frozenset({
    "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cuGraphLaunch",
})
ALLOC_OPS = frozenset({
    "cudaMalloc", "cudaFree", "cudaMallocManaged", "cuMemAlloc_v2",
})
CAPTURE_OPS = frozenset({
    "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate",
    "cudaGraphExecUpdate",
})


def code(name: str) -> int:
    return BY_NAME[name].code


def name_of(op_code: int) -> str:
    op = BY_CODE.get(op_code)
    return op.name if op else f"op{op_code}"


@dataclass(frozen=True, slots=True)
class Node:
    key: int
    name: str

    @property
    def lo(self) -> int:
        return self.key << SEQ_BITS

    @property
    def hi(self) -> int:
        return ((self.key + 1) << SEQ_BITS) - 1

    def event_id(self, rowkey: int) -> str:
        return f"{self.name}:{rowkey & ((1 << SEQ_BITS) - 1)}"


def nodes(conn: sqlite3.Connection, only: str | None = None) -> list[Node]:
    rows = conn.execute("SELECT id, name FROM nodes ORDER BY name").fetchall()
    return [Node(int(k), str(n)) for k, n in rows if only is None or n == only]


def in_list(values: Iterable[int]) -> str:
    """An SQL ``IN (...)`` list of integers (ints only, so formatting is safe)."""
    return "(" + ",".join(str(int(v)) for v in values) + ")"


def effective_span(conn: sqlite3.Connection, node: Node, win: Window) -> tuple[int, int]:
    """The part of the window this node has data for: rates divide by this, not by the
    window the user typed (``--since 1d`` over a 2-minute recording is 2 minutes)."""
    row = conn.execute(
        "SELECT min(ts_ns), max(ts_ns + dur_ns) FROM event_data "
        "WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?",
        (win.start_ns, win.end_ns, node.lo, node.hi),
    ).fetchone()
    if row is None or row[0] is None:
        return win.start_ns, win.start_ns
    return max(win.start_ns, int(row[0])), min(win.end_ns, int(row[1]))


@dataclass(slots=True)
class Hist:
    """A log2 latency histogram merged over windows: bucket b holds [2^b, 2^(b+1))."""

    count: int = 0
    total: int = 0
    buckets: dict[int, tuple[int, int]] | None = None  # bucket -> (count, sum)

    def add_bucket(self, bucket: int, count: int, total: int) -> None:
        if self.buckets is None:
            self.buckets = {}
        c, s = self.buckets.get(bucket, (0, 0))
        self.buckets[bucket] = (c + count, s + total)

    def merge(self, other: Hist) -> None:
        self.count += other.count
        self.total += other.total
        for b, (c, s) in (other.buckets or {}).items():
            self.add_bucket(b, c, s)

    def quantile(self, q: float) -> int | None:
        """Interpolated inside the bucket; exact to within the bucket's factor of two."""
        if not self.buckets:
            return None
        n = sum(c for c, _ in self.buckets.values())
        if n == 0:
            return None
        target = q * n
        seen = 0
        for b in sorted(self.buckets):
            c, s = self.buckets[b]
            if c and seen + c >= target:
                if c == 1:
                    return s
                lo, hi = (0, 2) if b == 0 else (1 << b, 1 << (b + 1))
                # The bucket's mean is known: spread its values evenly around it, inside
                # the bucket, rather than over the whole factor of two.
                mean = s / c
                half = max(0.0, min(mean - lo, hi - mean))
                frac = (target - seen) / c
                return int(mean - half + frac * 2 * half)
            seen += c
        return None

    def top(self) -> int | None:
        """A lower bound for the largest value (the start of the highest bucket used)."""
        used = [b for b, (c, _) in (self.buckets or {}).items() if c]
        return (1 << max(used)) if used else None


def histograms(
    conn: sqlite3.Connection, node: Node, win: Window, op_codes: Sequence[int],
    pid: int | None = None,
) -> dict[tuple[int, int], Hist]:
    """(pid, op) -> histogram over the aggregate windows that start inside ``win``."""
    if not op_codes:
        return {}
    # An aggregate window that sticks out of ``win`` counts in proportion to its overlap
    # (aggregate windows are seconds long; the lower bound keeps the index range short).
    weight = "(min(ts_ns + dur_ns, ?) - max(ts_ns, ?)) * 1.0 / max(dur_ns, 1)"
    sql = (
        f"SELECT coalesce(pid, 0), op, bucket, sum(count * {weight}), sum(sum * {weight}) "
        f"FROM aggregate_data WHERE node = ? AND op IN {in_list(op_codes)} "
        "AND ts_ns >= ? AND ts_ns < ? AND ts_ns + dur_ns > ?"
    )
    params: list[int] = [win.end_ns, win.start_ns, win.end_ns, win.start_ns, node.key,
                         win.start_ns - MAX_AGG_WINDOW_NS, win.end_ns, win.start_ns]
    if pid is not None:
        sql += " AND pid = ?"
        params.append(pid)
    out: dict[tuple[int, int], Hist] = {}
    totals: set[tuple[int, int]] = set()
    for p, op, bucket, count, total in conn.execute(sql + " GROUP BY 1, 2, 3", params):
        h = out.setdefault((int(p), int(op)), Hist())
        if bucket < 0:
            h.count, h.total = round(count), round(total)
            totals.add((int(p), int(op)))
        else:
            h.add_bucket(int(bucket), round(count), round(total))
    # A file without total rows still has buckets: their sums are the totals.
    for key, h in out.items():
        if key not in totals and h.buckets:
            h.count = sum(c for c, _ in h.buckets.values())
            h.total = sum(s for _, s in h.buckets.values())
    return out


def comms(conn: sqlite3.Connection, node: Node) -> tuple[dict[int, str], dict[int, int]]:
    """pid -> process name, and ppid by pid."""
    names: dict[int, str] = {}
    parents: dict[int, int] = {}
    for pid, comm, ppid in conn.execute(
        "SELECT pid, comm, ppid FROM process_data WHERE node = ?", (node.key,)
    ):
        if comm:
            names[int(pid)] = str(comm)
        if ppid is not None:
            parents[int(pid)] = int(ppid)
    for pid in tracer_pids(conn, node):
        names[pid] = f"{names.get(pid, 'fleetd')} {TRACER_MARK}"
    return names, parents


TRACER_MARK = "(the tracer)"


def tracer_pids(conn: sqlite3.Connection, node: Node) -> set[int]:
    """The pids fleetd itself ran as while recording this node (from session targets)."""
    out: set[int] = set()
    for (text,) in conn.execute(
        "SELECT targets FROM session_data WHERE node = ? AND targets IS NOT NULL", (node.key,)
    ):
        try:
            pid = json.loads(text).get("tracer_pid")
        except (ValueError, AttributeError):
            continue  # an older or foreign row: no tracer pid recorded
        if isinstance(pid, int) and pid > 0:
            out.add(pid)
    return out


def tasks(conn: sqlite3.Connection, node: Node) -> dict[int, tuple[int | None, str | None]]:
    """tid -> (pid, thread name), including tasks seen only as peers."""
    return {
        int(tid): (None if pid is None else int(pid), None if comm is None else str(comm))
        for tid, pid, comm in conn.execute(
            "SELECT tid, pid, comm FROM task_data WHERE node = ?", (node.key,)
        )
    }
