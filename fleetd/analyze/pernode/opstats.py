"""Per-op (and per-process) latency statistics: count, percentiles, total, errors, rate.

CUDA calls are sampled in the kernel (1 in N ordinary calls become events; slow, sync,
graph, alloc and failing calls always do), while the in-kernel histograms count every
call. So each row says where its numbers come from:

- ``events``: every call is stored; percentiles are exact.
- ``histogram``: some calls exist only in the histograms (or, for host ops, only
  intervals above a threshold are stored); count and total are exact, percentiles are
  interpolated inside log2 buckets (within a factor of two, usually much closer).
  Percentiles over the stored events would be wrong here: the always-emitted slow calls
  would dominate them. ``max_ns`` is then a lower bound (the mean of the highest bucket
  used, or the largest stored call if that is larger): ``max_exact`` says so. The
  interpolated percentiles never leave what is known: at least the lowest bucket's
  start, at most ``max_ns`` (:meth:`~fleetd.analyze.reading.data.Hist.quantile`, the one place
  percentiles are scaled from buckets, for ops, overview, explain, the node API, MCP
  and the HTML report alike).
- ``timed_sample``: launches traced at their entry (``fleetd trace
  --no-launch-returns``): the count is exact, but only the sampled calls were timed, so
  the percentiles are over that uniform sample and the total is the sample's scaled to
  every call (estimates); with no call timed they are unknown (null), never 0.
- ``duty_cycle``: the always-on mode (``--mode always-on``): the launch probes ran a
  part of each aggregate window and every figure is scaled from that part (estimates).

Syscalls get one row per syscall (``futex``, ``read``...), from the stored events, which
hold the calls slower than the tracer's threshold; sleeps the program asked for
(``clock_nanosleep``...) have source ``sleep`` and sort last, since their time is the
program's choice and not latency.
"""

from __future__ import annotations

import logging
import sqlite3
from array import array
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fleetd.analyze.reading.data import (
    Hist,
    Node,
    effective_span,
    histograms,
    in_list,
    name_of,
    nodes,
)
from fleetd.analyze.reading.data import comms as load_comms
from fleetd.analyze.reading.rows import KERNEL_COLUMNS as KERNEL_COLUMNS
from fleetd.analyze.reading.rows import OP_COLUMNS, KernelOpRow, OpRow
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import BY_CODE, BY_NAME, KERNEL_LAUNCHES, TIMED
from fleetd.store.syscalls import SLEEPS, syscall_name

log = logging.getLogger("fleetd.analyze.pernode.opstats")

SYSCALL = BY_NAME["syscall"].code
# Ops with a duration worth a percentile: calls and host intervals. Syscalls are read
# apart, by their number.
TIMED_CODES: tuple[int, ...] = tuple(c for c in TIMED.codes if c != SYSCALL)
# The columns of an op row and (KERNEL_COLUMNS, ``--by kernel``: one row per kernel name
# and process, from the stored launches) of a kernel row, in order: the rows' own keys.
COLUMNS = OP_COLUMNS
LAUNCH_CODES: tuple[int, ...] = KERNEL_LAUNCHES.codes
UNNAMED = "(unnamed)"


@dataclass(slots=True)
class _Group:
    durs: array[int]
    errors: int = 0


def _load_events(
    conn: sqlite3.Connection, node: Node, win: Window, pid: int | None
) -> dict[tuple[int, int], _Group]:
    """(pid, op) -> stored durations. Bounded by the window; 8 bytes per event."""
    # block_io keeps the request's error in ret; CUDA calls their cudaError.
    failed = {code for code in TIMED_CODES if BY_CODE[code].source != "sched"}
    return _load(conn, node, win, pid, "op", f"op IN {in_list(TIMED_CODES)}",
                 lambda key, ret: ret != 0 and key in failed)


def _load_syscalls(
    conn: sqlite3.Connection, node: Node, win: Window, pid: int | None
) -> dict[tuple[int, int], _Group]:
    """(pid, syscall number) -> stored durations of the slow syscalls."""
    return _load(conn, node, win, pid, "a0", f"op = {SYSCALL}",
                 lambda key, ret: ret < 0)  # a syscall fails with -errno


def _load(
    conn: sqlite3.Connection, node: Node, win: Window, pid: int | None, key: str,
    which: str, failed: Callable[[int, int], bool],
) -> dict[tuple[int, int], _Group]:
    """(pid, ``key`` column) -> durations of the stored events ``which`` selects."""
    sql = (f"SELECT pid, {key}, dur_ns, ret FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
           f"AND id BETWEEN ? AND ? AND {which}")
    params: list[int] = [win.start_ns, win.end_ns, node.lo, node.hi]
    if pid is not None:
        sql += " AND pid = ?"
        params.append(pid)
    groups: dict[tuple[int, int], _Group] = {}
    for p, k, dur, ret in conn.execute(sql, params):
        g = groups.get((p, k))
        if g is None:
            g = groups[(p, k)] = _Group(array("q"))
        g.durs.append(dur)
        if failed(k, ret):
            g.errors += 1
    return groups


def _exact_quantile(sorted_durs: array[int], q: float) -> int:
    # Nearest rank: the smallest value with at least q of the calls at or below it.
    idx = max(0, min(len(sorted_durs) - 1, int(q * len(sorted_durs) + 0.999999) - 1))
    return int(sorted_durs[idx])


def _row(
    node: Node, pid: int | None, op: int, g: _Group | None, h: Hist | None, span_s: float,
    comm: str | None, name: tuple[str, str] | None = None,
) -> OpRow:
    """One row; ``name`` is (op, source) where the op code alone does not say it."""
    durs = array("q", sorted(g.durs)) if g else array("q")
    sampled = h is not None and h.count > len(durs)
    total: int | None
    if sampled and h is not None:
        count, total = h.count, h.total
        top = h.top()
        mx = max(int(durs[-1]) if durs else 0, h.bounds()[1] or 0) or None
        # Scaled inside their buckets, clamped to what is known: never above ``mx``.
        qs = [h.quantile(q, mx) for q in (0.5, 0.95, 0.99)]
        # Exact only when a stored call is the largest and outranks the top bucket.
        exact = bool(durs) and top is not None and int(durs[-1]) >= 2 * top
        if qs[0] is None and durs:  # totals without buckets: the best we have
            qs = [_exact_quantile(durs, q) for q in (0.5, 0.95, 0.99)]
        source = "histogram"
        if h.timed_sample:
            # Entry-only launches: the count is exact, the durations a sample of the
            # calls (total scaled from it); none timed: unknown, never a 0.
            source = "timed_sample"
            if h.untimed >= h.count:
                total, qs, mx, exact = None, [None, None, None], None, False
        if h.duty_ns:
            # Always-on mode: the launch probes ran part of each window; the figures
            # are scaled from those parts (estimates).
            source = "duty_cycle"
    else:
        count, total = len(durs), int(sum(durs))
        qs = [_exact_quantile(durs, q) if durs else None for q in (0.5, 0.95, 0.99)]
        mx = int(durs[-1]) if durs else None
        exact = True
        source = "events"
    return {
        "node": node.name,
        "pid": pid,
        "comm": comm,
        "op": name[0] if name else name_of(op),
        "source": name[1] if name else BY_CODE[op].source,
        "count": count,
        "errors": g.errors if g else 0,
        "total_ns": total,
        "mean_ns": total // count if count and total is not None else None,
        "p50_ns": qs[0],
        "p95_ns": qs[1],
        "p99_ns": qs[2],
        "max_ns": mx,
        "max_exact": exact,
        "calls_per_s": round(count / span_s, 3) if span_s > 0 else None,
        "stats_from": source,
        "events": len(durs),
    }


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :func:`node_op_stats` reads of one node and window: read once, it gives the
    rows per process and summed over processes alike (explain asks both)."""

    groups: dict[tuple[int, int], _Group]
    hists: dict[tuple[int, int], Hist]
    calls: dict[tuple[int, int], _Group]
    span_s: float


def load_op_stats(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None
                  ) -> Loaded:
    start, end = effective_span(conn, node, win)
    return Loaded(_load_events(conn, node, win, pid), histograms(conn, node, win, TIMED_CODES,
                  pid), _load_syscalls(conn, node, win, pid), (end - start) / 1e9)


def node_op_stats(
    conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
    per_process: bool = True, comms: dict[int, str] | None = None,
    loaded: Loaded | None = None,
) -> list[OpRow]:
    """Stats rows for one node, sorted by total time, largest first (from ``loaded``
    when the caller has read the same node, window and pid already)."""
    got = loaded if loaded is not None else load_op_stats(conn, node, win, pid)
    groups, hists, calls, span_s = got.groups, got.hists, got.calls, got.span_s
    if not per_process:
        groups, hists = _merge_pids(groups), _merge_pid_hists(hists)
    names = comms or {}
    rows = [
        _row(node, p if per_process else None, op, groups.get((p, op)), hists.get((p, op)),
             span_s, names.get(p) if per_process else None)
        for p, op in sorted(set(groups) | set(hists))
    ]
    if not per_process:
        calls = _merge_pids(calls)
    for p, nr in sorted(calls):
        sc = syscall_name(nr)
        rows.append(_row(node, p if per_process else None, SYSCALL, calls[(p, nr)], None,
                         span_s, names.get(p) if per_process else None,
                         (sc, "sleep" if sc in SLEEPS else "syscall")))
    rows = [r for r in rows if r["count"]]
    # Sleeps last: a program that sleeps on purpose is not slow.
    rows.sort(key=lambda r: (r["source"] == "sleep", -int(r["total_ns"] or 0), str(r["op"])))
    return rows


def _merge_pids(groups: dict[tuple[int, int], _Group]) -> dict[tuple[int, int], _Group]:
    out: dict[tuple[int, int], _Group] = defaultdict(lambda: _Group(array("q")))
    for (_, op), g in groups.items():
        m = out[(0, op)]
        m.durs.extend(g.durs)
        m.errors += g.errors
    return dict(out)


def _merge_pid_hists(hists: dict[tuple[int, int], Hist]) -> dict[tuple[int, int], Hist]:
    out: dict[tuple[int, int], Hist] = {}
    for (_, op), h in hists.items():
        out.setdefault((0, op), Hist()).merge(h)
    return out


def op_stats(
    conn: sqlite3.Connection, win: Window, pid: int | None = None, per_process: bool = False,
    node: str | None = None,
) -> list[OpRow]:
    """Stats rows per op for every node in the file (or one), node by node."""
    return _every_node(conn, node, lambda n, names: node_op_stats(
        conn, n, win, pid, per_process, names), "op")


def kernel_stats(
    conn: sqlite3.Connection, win: Window, pid: int | None = None, per_process: bool = False,
    node: str | None = None,
) -> list[KernelOpRow]:
    """Stats rows per kernel name for every node in the file (or one), node by node."""
    return _every_node(conn, node, lambda n, names: node_kernel_stats(
        conn, n, win, pid, per_process, names), "kernel")


Row = TypeVar("Row", OpRow, KernelOpRow)


def _every_node(conn: sqlite3.Connection, node: str | None,
                rows_of: Callable[[Node, dict[int, str]], list[Row]], what: str) -> list[Row]:
    """``rows_of`` each node of the file (or the one), with its process names."""
    rows: list[Row] = []
    for n in nodes(conn, node):
        names, _ = load_comms(conn, n)
        rows += rows_of(n, names)
    log.debug("%s stats: %d rows", what, len(rows))
    return rows


def node_kernel_stats(
    conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
    per_process: bool = True, comms: dict[int, str] | None = None,
) -> list[KernelOpRow]:
    """Launch statistics per kernel name (and process), largest total first.

    Launches are sampled in the kernel, so only the stored ones carry a name: ``count``
    is stored launches and the percentiles are over them (``stats_from`` is ``sample``
    when the op's histogram counted more calls than were stored). ``est_calls`` scales
    each kernel's stored count by its op's calls-per-stored ratio: an estimate that
    assumes the sample picks kernels in proportion, which the always-kept slow
    launches bend towards slow kernels.
    """
    sql = ("SELECT e.pid, e.op, e.dur_ns, e.ret, json_extract(x.args, '$.kernel') "
           "FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
           "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ? "
           f"AND e.op IN {in_list(LAUNCH_CODES)}")
    params: list[int] = [win.start_ns, win.end_ns, node.lo, node.hi]
    if pid is not None:
        sql += " AND e.pid = ?"
        params.append(pid)
    groups: dict[tuple[int, str, int], _Group] = {}
    stored: dict[tuple[int, int], int] = defaultdict(int)
    for p, op, dur, ret, kernel in conn.execute(sql, params):
        p = p if per_process else 0
        name = kernel if isinstance(kernel, str) and kernel else UNNAMED
        g = groups.get((p, name, op))
        if g is None:
            g = groups[(p, name, op)] = _Group(array("q"))
        g.durs.append(dur)
        g.errors += ret != 0
        stored[(p, op)] += 1
    hists = histograms(conn, node, win, LAUNCH_CODES, pid)
    if not per_process:
        hists = _merge_pid_hists(hists)
    start, end = effective_span(conn, node, win)
    span_s = (end - start) / 1e9
    names = comms or {}
    rows: list[KernelOpRow] = []
    for (p, name, op), g in groups.items():
        h = hists.get((p, op))
        scale = h.count / stored[(p, op)] if h is not None and h.count > stored[(p, op)] else 1.0
        base = _row(node, p if per_process else None, op, g, None, span_s,
                    names.get(p) if per_process else None)
        est = round(len(g.durs) * scale)
        rows.append({
            "node": base["node"], "pid": base["pid"], "comm": base["comm"], "kernel": name,
            "op": base["op"], "count": base["count"], "est_calls": est,
            "errors": base["errors"], "total_ns": base["total_ns"], "mean_ns": base["mean_ns"],
            "p50_ns": base["p50_ns"], "p95_ns": base["p95_ns"], "p99_ns": base["p99_ns"],
            "max_ns": base["max_ns"],
            "calls_per_s": round(est / span_s, 3) if span_s > 0 else None,
            "stats_from": "sample" if scale > 1.0 else "events"})
    rows.sort(key=lambda r: (-int(r["total_ns"] or 0), str(r["kernel"])))
    return rows

