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
from typing import Any

import orjson

from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import (
    ALLOCS,
    BY_CODE,
    BY_NAME,
    CALLS,
    GRAPH_BUILDS,
    LAUNCHES,
    NCCL,
    SYNCS,
)
from fleetd.store.catalog import CALL_SOURCES as CALL_SOURCES
from fleetd.store.clockinfo import SESSION_CLOCK_COLUMNS, SessionClock, node_boot, session_clock
from fleetd.store.schema import SEQ_BITS
from fleetd.store.sparse import sparse_only
from fleetd.store.summaries import SPAN_WHERE, SecRun, raw_spans, summed_runs

MAX_AGG_WINDOW_NS = 3600 * 10**9  # aggregate windows are flushed far more often than this
# The op families the analyzers read by name (defined in fleetd.store.catalog).
CALL_CODES: tuple[int, ...] = CALLS.codes
SYNC_OPS = SYNCS.name_set
LAUNCH_OPS = LAUNCHES.name_set  # kernel and graph launches
ALLOC_OPS = ALLOCS.name_set
CAPTURE_OPS = GRAPH_BUILDS.name_set


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


def in_window(node: Node, win: Window, pid: int | None = None) -> tuple[str, list[int]]:
    """The WHERE clause (and its parameters) of a node's events in the window, of one
    process when ``pid`` is given."""
    sql = "ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?"
    params: list[int] = [win.start_ns, win.end_ns, node.lo, node.hi]
    if pid is not None:
        sql += " AND pid = ?"
        params.append(pid)
    return sql, params


def effective_span(conn: sqlite3.Connection, node: Node, win: Window,
                   runs: list[SecRun] | None = None) -> tuple[int, int]:
    """The part of the window this node has data for: rates divide by this, not by the
    window the user typed (``--since 1d`` over a 2-minute recording is 2 minutes).
    Seconds the writer summed (``runs``, :func:`summed_runs`) are read from their
    summaries, the rest from the events."""
    if runs is None:
        runs = summed_runs(conn, node.key, win.start_ns, win.end_ns)
    found: list[tuple[Any, Any]] = [conn.execute(
        "SELECT min(first_ns), max(end_ns) FROM second_cover WHERE node = ? AND sec "
        "BETWEEN ? AND ?", (node.key, first, last)).fetchone() for first, last in runs]
    # The whole window as every reader walks it; pieces of it through the time index.
    where = SPAN_WHERE if runs else in_window(node, win)[0]
    found += [conn.execute(
        f"SELECT min(ts_ns), max(ts_ns + dur_ns) FROM event_data WHERE {where}",
        (lo, hi, node.lo, node.hi),
    ).fetchone() for lo, hi in raw_spans(win.start_ns, win.end_ns, runs)]
    starts = [int(r[0]) for r in found if r is not None and r[0] is not None]
    ends = [int(r[1]) for r in found if r is not None and r[1] is not None]
    if not starts:
        return win.start_ns, win.start_ns
    return max(win.start_ns, min(starts)), min(win.end_ns, max(ends))


def json_or_text(text: str | None) -> Any:
    """A stored JSON value, or the text itself where it is not JSON."""
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def active_span(conn: sqlite3.Connection, node: Node, win: Window, pid: int
                ) -> tuple[int, int]:
    """From the first to the last stored CUDA/NCCL call of ``pid`` in the window: the time
    the process was feeding the GPU. Call rates divide by this, so a node whose tracing
    began before the job (or outlived it) is not called slow for the idle time around it."""
    codes = CALLS.codes
    marks = ",".join("?" * len(codes))
    row = conn.execute(
        f"SELECT min(ts_ns), max(ts_ns + dur_ns) FROM event_data WHERE ts_ns >= ? AND "
        f"ts_ns < ? AND id BETWEEN ? AND ? AND pid = ? AND op IN ({marks})",
        (win.start_ns, win.end_ns, node.lo, node.hi, pid, *codes),
    ).fetchone()
    if row is None or row[0] is None:
        return effective_span(conn, node, win)
    return max(win.start_ns, int(row[0])), min(win.end_ns, int(row[1]))


UNTIMED_BUCKET = -3  # aggregate_data: calls counted without a duration
DUTY_BUCKET = -4  # aggregate_data: ns the launch probes were on (always-on mode)


@dataclass(slots=True)
class Hist:
    """A log2 latency histogram merged over windows: bucket b holds [2^b, 2^(b+1))."""

    count: int = 0
    total: int = 0
    buckets: dict[int, tuple[int, int]] | None = None  # bucket -> (count, sum)
    # Calls counted without a duration (entry-only launches, aggregate bucket -3): the
    # buckets then hold a sample of the calls and ``total`` is an estimate from it.
    untimed: int = 0
    # The always-on mode (aggregate bucket -4): ns the launch probes were on, of the
    # windows' ns; count, total and buckets are then already scaled to the windows.
    duty_on_ns: int = 0
    duty_ns: int = 0

    @property
    def timed_sample(self) -> bool:
        """Whether durations come from a sample of the calls (count stays exact)."""
        return self.untimed > 0

    def add_bucket(self, bucket: int, count: int, total: int) -> None:
        if self.buckets is None:
            self.buckets = {}
        c, s = self.buckets.get(bucket, (0, 0))
        self.buckets[bucket] = (c + count, s + total)

    def merge(self, other: Hist) -> None:
        self.count += other.count
        self.total += other.total
        self.untimed += other.untimed
        self.duty_on_ns += other.duty_on_ns
        self.duty_ns += other.duty_ns
        for b, (c, s) in (other.buckets or {}).items():
            self.add_bucket(b, c, s)

    def quantile(self, q: float, hi: int | None = None) -> int | None:
        """Interpolated inside the bucket; exact to within the bucket's factor of two.

        Never outside what the buckets prove about the smallest and largest value
        (:meth:`bounds`), nor above ``hi`` (a larger proven maximum, the largest stored
        call, replaces the buckets' own): a p99 above the reported max is never shown.
        """
        if not self.buckets:
            return None
        n = sum(c for c, _ in self.buckets.values())
        if n == 0:
            return None
        target = q * n
        seen = 0
        value: int | None = None
        for b in sorted(self.buckets):
            c, s = self.buckets[b]
            if c and seen + c >= target:
                if c == 1:
                    value = s
                    break
                lo, up = _bucket_range(b)
                # The bucket's mean is known: spread its values evenly around it, inside
                # the bucket, rather than over the whole factor of two.
                mean = s / c
                half = max(0.0, min(mean - lo, up - mean))
                frac = (target - seen) / c
                value = int(mean - half + frac * 2 * half)
                break
            seen += c
        if value is None:
            return None
        low, high = self.bounds()
        if hi is not None:
            high = hi if high is None else max(high, hi)
        if high is not None:
            value = min(value, high)
        return max(value, low) if low is not None else value

    def top(self) -> int | None:
        """The start of the highest bucket used (whether a stored call outranks it)."""
        used = [b for b, (c, _) in (self.buckets or {}).items() if c]
        return (1 << max(used)) if used else None

    def bounds(self) -> tuple[int | None, int | None]:
        """(low, high): every value is at least ``low`` (the lowest bucket's start) and
        the largest is at least ``high`` (the highest bucket's mean, or its start if
        larger: some value of a bucket is at least their mean). (None, None) without
        buckets."""
        buckets = self.buckets or {}
        used = sorted(b for b, (c, _) in buckets.items() if c > 0)
        if not used:
            return None, None
        c, s = buckets[used[-1]]
        return _bucket_range(used[0])[0], max(_bucket_range(used[-1])[0], int(s // c))


def _bucket_range(b: int) -> tuple[int, int]:
    """[lo, hi) of log2 bucket ``b``; bucket 0 also holds 0."""
    return (0, 2) if b == 0 else (1 << b, 1 << (b + 1))


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
        if bucket == UNTIMED_BUCKET:
            h.untimed = round(count)
        elif bucket == DUTY_BUCKET:
            h.duty_on_ns, h.duty_ns = round(count), round(total)
        elif bucket < 0:
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


# ---- the ranks of one job --------------------------------------------------------------

NCCL_CODES: tuple[int, ...] = NCCL.codes


def job_peers(conn: sqlite3.Connection, node: Node, win: Window) -> dict[int, frozenset[int]]:
    """pid -> the other ranks of its job: processes with the same torchrun identity
    (job and world size, as collective arrival matches ranks; a process of the same rank,
    a DataLoader worker that inherited its parent's environment, is not another rank) or
    an NCCL communicator in common (the ``comm_hash`` of their calls in the window).

    Ranks are looked up in this node's process table and, when its sessions ran in one
    boot, in those of the file's other nodes of that boot (nodes recorded side by side
    on one machine: one pid namespace), so a rank traced by another node is known here.
    A rank waiting for a peer rank is the collective's wait, not a cause of its own."""
    keys = [node.key, *_same_boot_nodes(conn, node)]
    ident: dict[int, tuple[str | None, int, int]] = {}
    for key in keys:
        for pid, rank, size, job in _rank_rows(conn, key):
            if isinstance(pid, int) and isinstance(rank, int) and isinstance(size, int) \
                    and 0 <= rank < size:
                ident.setdefault(pid, (None if job is None else str(job), size, rank))
    peers: dict[int, set[int]] = {}
    groups: dict[tuple[str | None, int], list[tuple[int, int]]] = {}
    for pid, (job, size, rank) in ident.items():
        groups.setdefault((job, size), []).append((pid, rank))
    for members in groups.values():
        for pid, rank in members:
            others = {p for p, r in members if r != rank}
            if others:
                peers.setdefault(pid, set()).update(others)
    # Processes of a job seen here only as wakers carry the job without a rank; one is a
    # peer of every rank of the job but the one whose worker it is (its parent).
    for key in keys:
        for pid, ppid, size, job in _unranked_rows(conn, key):
            for member, _rank in groups.get((str(job), int(size)), []):
                if pid != member and ppid != member and pid not in ident:
                    peers.setdefault(member, set()).add(int(pid))
    by_comm: dict[str, set[int]] = {}
    for key in keys:
        n = Node(key, "")
        for pid, args in conn.execute(
                "SELECT e.pid, x.args FROM event_data e JOIN event_args x ON x.id = e.id "
                "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ? AND e.op IN "
                f"{in_list(NCCL_CODES)}{sparse_only(NCCL_CODES)} "
                "AND instr(x.args, 'comm_hash') > 0",
                (win.start_ns, win.end_ns, n.lo, n.hi)):
            comm = _comm_hash(args)
            if comm is not None and isinstance(pid, int):
                by_comm.setdefault(comm, set()).add(pid)
    for pids in by_comm.values():
        for pid in pids if len(pids) > 1 else ():
            peers.setdefault(pid, set()).update(pids - {pid})
    return {pid: frozenset(p) for pid, p in peers.items()}


def _rank_rows(conn: sqlite3.Connection, key: int) -> list[tuple[object, ...]]:
    """(pid, rank, world_size, job) of a node's processes that have a rank (job NULL in
    a file from before the column)."""
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(process_data)")}
    job = "job" if "job" in cols else "NULL"
    return conn.execute(f"SELECT pid, rank, world_size, {job} FROM process_data WHERE "
                        "node = ? AND rank IS NOT NULL", (key,)).fetchall()


def _unranked_rows(conn: sqlite3.Connection, key: int) -> list[tuple[int, int, int, str]]:
    """(pid, ppid, world_size, job) of processes known by their job but not their rank."""
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(process_data)")}
    if "job" not in cols:
        return []
    return [(pid, ppid, size, job) for pid, ppid, size, job in conn.execute(
        "SELECT pid, ppid, world_size, job FROM process_data WHERE node = ? AND rank IS NULL "
        "AND job IS NOT NULL AND world_size IS NOT NULL", (key,))
        if isinstance(pid, int) and isinstance(size, int) and isinstance(job, str)]


def _same_boot_nodes(conn: sqlite3.Connection, node: Node) -> list[int]:
    """The file's other nodes whose sessions all ran in the one boot this node's did
    (:func:`fleetd.store.clockinfo.node_boot`, as clock alignment reads it)."""
    sessions: dict[int, list[SessionClock] | None] = {}
    for key, *row in conn.execute(f"SELECT node, {SESSION_CLOCK_COLUMNS} FROM session_data"):
        got = sessions.setdefault(key, [])
        if got is None:
            continue
        try:
            got.append(session_clock(row))
        except ValueError:  # an unreadable session: that node's boot is not known
            sessions[key] = None
    boots = {k: node_boot(v)[0] for k, v in sessions.items() if v}
    mine = boots.get(node.key)
    if mine is None:
        return []
    return sorted(k for k, b in boots.items() if b == mine and k != node.key)


def args_object(raw: object) -> dict[str, object]:
    """An event's args as a dict: their JSON is untrusted (a merged or imported file),
    so anything that is not an object, or not JSON (orjson also bounds its nesting),
    is ``{}``; its values are unchecked (``object``): each reader checks the keys it
    reads."""
    if not isinstance(raw, str | bytes) or not raw:
        return {}
    try:
        got = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return got if isinstance(got, dict) else {}


def _comm_hash(args: object) -> str | None:
    """The ``comm_hash`` of an NCCL call's args."""
    v = args_object(args).get("comm_hash")
    return v if isinstance(v, str) and v else None
