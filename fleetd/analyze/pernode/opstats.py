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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fleetd.analyze.reading.data import (
    Hist,
    Node,
    effective_span,
    histograms,
    in_list,
    in_window,
    name_of,
    nodes,
)
from fleetd.analyze.reading.data import comms as load_comms
from fleetd.analyze.reading.rows import KERNEL_COLUMNS as KERNEL_COLUMNS
from fleetd.analyze.reading.rows import OP_COLUMNS, KernelOpRow, OpRow
from fleetd.analyze.reading.sums import SYSCALL, TIMED_CODES, Sum, event_sums
from fleetd.analyze.reading.window import Window
from fleetd.store.catalog import BY_CODE, KERNEL_LAUNCHES
from fleetd.store.syscalls import SLEEPS, syscall_name

log = logging.getLogger("fleetd.analyze.pernode.opstats")

# Ops with a duration worth a percentile: calls and host intervals (TIMED_CODES).
# Syscalls are read apart, by their number (SYSCALL).
# The columns of an op row and (KERNEL_COLUMNS, ``--by kernel``: one row per kernel name
# and process, from the stored launches) of a kernel row, in order: the rows' own keys.
COLUMNS = OP_COLUMNS
LAUNCH_CODES: tuple[int, ...] = KERNEL_LAUNCHES.codes
UNNAMED = "(unnamed)"


QUANTILES = (0.5, 0.95, 0.99)


def _rank(q: float, n: int) -> int:
    """The nearest rank (1-based): the smallest value with at least q of the calls at or
    below it."""
    return max(1, min(n, int(q * n + 0.999999)))


@dataclass(slots=True)
class _Group:
    """The stored events of one (pid, op or syscall): how many, their sum, the largest,
    how many failed, and, once read (only the rows that print them need them), the
    values at the nearest ranks of :data:`QUANTILES` (quantile -> value)."""

    count: int = 0
    total: int = 0
    top: int = 0
    errors: int = 0
    at_q: dict[float, int] | None = None

    @classmethod
    def of(cls, durs: list[int], errors: int) -> _Group:
        """A group from its durations, as read one by one."""
        durs = sorted(durs)
        n = len(durs)
        return cls(n, sum(durs), durs[-1] if durs else 0, errors, _at_ranks(durs) if n else None)

    def quantile(self, q: float) -> int | None:
        """None where no duration was left to read (pruned since the count)."""
        assert self.at_q is not None, "read the exact percentiles first (Loaded.exact)"
        return self.at_q.get(q)

    def merge(self, other: _Group) -> None:
        self.count += other.count
        self.total += other.total
        self.top = max(self.top, other.top)
        self.errors += other.errors


@dataclass(frozen=True, slots=True)
class _Select:
    """Which stored events a group is read from: the key column next to pid (``op``,
    or ``a0`` for syscalls) and the WHERE clause. For ops the clause is the groups'
    own (each names its op: a timed op, as every group comes from the timed events'
    sums), so none is added: testing each row against the timed ops too cost 0.16 s
    of 1.3 on the ten-minute file."""

    key: str
    which: str | None


_SYSCALL_ROWS = f"op = {SYSCALL}"
EVENTS = _Select("op", None)
_PID_LIMIT = 1 << 50  # pid << 12 stays inside SQLite's 64-bit integers
assert max(BY_CODE) < 4096, "op codes are packed into 12 bits (_durations)"
SYSCALLS = _Select("a0", _SYSCALL_ROWS)


def _where(node: Node, win: Window, pid: int | None, which: str) -> tuple[str, list[int]]:
    sql, params = in_window(node, win, pid)
    return f"{sql} AND {which}", params


def _groups(sums: list[Sum]) -> dict[tuple[int, int], _Group]:
    """(pid, op) -> the stored events' count, sum, largest and failures, added up from
    the node's shared per-thread sums (:func:`event_sums`): the rows themselves stay in
    the file (percentiles are read apart, for the groups that print them:
    :meth:`Loaded.exact`)."""
    out: dict[tuple[int, int], _Group] = defaultdict(_Group)
    for s in sums:
        out[(s.pid, s.op)].merge(_Group(s.count, s.total, s.top, s.failed))
    return dict(out)


def _load_syscalls(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None
                   ) -> tuple[dict[tuple[int, int], _Group], dict[tuple[int, int], list[int]]]:
    """(pid, syscall number) -> its stored calls, and their sorted durations. A syscall
    has no histogram, so every row prints exact percentiles: one read gives both
    (a sum in SQL first would scan the window twice)."""
    where, params = _where(node, win, pid, _SYSCALL_ROWS)
    durs: dict[tuple[int, int], list[int]] = defaultdict(list)
    failed: dict[tuple[int, int], int] = defaultdict(int)
    for p, nr, dur, fails in conn.execute(  # a syscall fails with -errno
            f"SELECT pid, a0, dur_ns, ret < 0 FROM event_data WHERE {where}", params):
        durs[(p, nr)].append(dur)
        if fails:
            failed[(p, nr)] += 1
    for v in durs.values():
        v.sort()
    return {k: _Group.of(v, failed[k]) for k, v in durs.items()}, durs


def _durations(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None,
               sel: _Select, pairs: set[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """The stored durations of the (pid, key) ``pairs``, each list sorted: only the
    groups whose rows print exact percentiles are read (sorted here: Python sorts
    integers faster than SQLite ranks them with a window function)."""
    by_key: dict[int, list[int]] = defaultdict(list)
    for p, k in pairs:
        by_key[k].append(p)
    which = " OR ".join(f"({sel.key} = {int(k)} AND pid IN {in_list(sorted(ps))})"
                        for k, ps in sorted(by_key.items()))
    where, params = _where(node, win, pid, f"({which})" if sel.which is None
                           else f"{sel.which} AND ({which})")
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    if sel.key == "op" and all(0 <= p < _PID_LIMIT for p, _ in pairs):
        # One integer per row, pid << 12 | op, where that is exact (every op code is
        # below 4096; the only pids read are these): a (pid, op) tuple per row cost
        # 0.2 of 2.9 CPU s at 2.7M rows.
        packed: dict[int, list[int]] = defaultdict(list)
        for key, dur in conn.execute(f"SELECT pid << 12 | op, dur_ns FROM event_data "
                                     f"WHERE {where}", params):
            packed[key].append(dur)
        out.update(((key >> 12, key & 4095), durs) for key, durs in packed.items())
    else:
        for p, k, dur in conn.execute(f"SELECT pid, {sel.key}, dur_ns FROM event_data "
                                      f"WHERE {where}", params):
            out[(p, k)].append(dur)
    for durs in out.values():
        durs.sort()
    return out


def _at_ranks(durs: list[int]) -> dict[float, int]:
    """The sorted ``durs``' values at the nearest ranks of :data:`QUANTILES`, by
    quantile. Keyed by the quantile, not the rank: on a live database the durations are
    read after the counts, and rows committed in between make the two disagree (a rank
    of the count was then missing: HTTP 500 from a live agent's chains)."""
    n = len(durs)
    return {q: durs[_rank(q, n) - 1] for q in QUANTILES} if n else {}


def _needs_exact(g: _Group | None, h: Hist | None) -> bool:
    """Whether :func:`_row` prints percentiles of the stored events themselves: every
    call stored, or a histogram without buckets (totals only)."""
    return g is not None and g.count > 0 and (
        h is None or h.count <= g.count or h.quantile(0.5) is None)


def _row(
    node: Node, pid: int | None, op: int, g: _Group | None, h: Hist | None, span_s: float,
    comm: str | None, name: tuple[str, str] | None = None,
) -> OpRow:
    """One row; ``name`` is (op, source) where the op code alone does not say it."""
    stored = g.count if g else 0
    largest = g.top if g and stored else None
    sampled = h is not None and h.count > stored
    total: int | None
    if sampled and h is not None:
        count, total = h.count, h.total
        top = h.top()
        mx = max(largest or 0, h.bounds()[1] or 0) or None
        # Scaled inside their buckets, clamped to what is known: never above ``mx``.
        qs = [h.quantile(q, mx) for q in QUANTILES]
        # Exact only when a stored call is the largest and outranks the top bucket.
        exact = largest is not None and top is not None and largest >= 2 * top
        if qs[0] is None and g and stored:  # totals without buckets: the best we have
            qs = [g.quantile(q) for q in QUANTILES]
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
        count, total = stored, g.total if g else 0
        qs = [g.quantile(q) if g and stored else None for q in QUANTILES]
        mx = largest
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
        "events": stored,
    }


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :func:`node_op_stats` reads of one node and window: read once, it gives the
    rows per process and summed over processes alike (explain asks both)."""

    groups: dict[tuple[int, int], _Group]
    hists: dict[tuple[int, int], Hist]
    calls: dict[tuple[int, int], _Group]
    span_s: float
    # Where they were read from: the exact percentiles are read later, for the groups
    # whose rows print them (per process or summed, whichever is asked).
    conn: sqlite3.Connection
    node: Node
    win: Window
    pid: int | None

    # (pid, key) -> sorted stored durations, per selection's key column, as read.
    durs: dict[str, dict[tuple[int, int], list[int]]] = field(default_factory=dict)

    def exact(self, sel: _Select, groups: dict[tuple[int, int], _Group],
              hists: dict[tuple[int, int], Hist], per_process: bool) -> None:
        """Give the groups whose rows print percentiles of the stored events those
        (``groups`` per process, or summed over processes: pid 0). The durations are
        read once, per process, for both."""
        need = [(k, g) for k, g in groups.items()
                if g.at_q is None and _needs_exact(g, hists.get(k))]
        if not need:
            return
        base = self.calls if sel is SYSCALLS else self.groups
        keys = {k for (_, k), _ in need}
        pairs = {pk for pk, _ in need} if per_process else {pk for pk in base if pk[1] in keys}
        have = self.durs.setdefault(sel.key, {})
        missing = {pk for pk in pairs if pk not in have}
        if missing:
            have.update(_durations(self.conn, self.node, self.win, self.pid, sel, missing))
        for (p, k), g in need:
            if per_process:
                g.at_q = _at_ranks(have.get((p, k), []))
            else:  # every process's calls of the op together
                g.at_q = _at_ranks(_merged([ds for pk, ds in have.items() if pk[1] == k]))


def _merged(runs: list[list[int]]) -> list[int]:
    """Sorted lists as one sorted list: joined by list extension and sorted once (Python's
    sort merges the sorted runs it finds), not fed through a generator value by value."""
    out: list[int] = []
    for run in runs:
        out += run
    out.sort()
    return out


def load_op_stats(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
                  span: tuple[int, int] | None = None, sums: list[Sum] | None = None
                  ) -> Loaded:
    """``span``: the node's :func:`effective_span` in ``win``, and ``sums`` its
    :func:`event_sums` (of ``pid``), where the caller has them (each a whole pass over
    the window to read again)."""
    start, end = span if span is not None else effective_span(conn, node, win)
    calls, durs = _load_syscalls(conn, node, win, pid)
    return Loaded(_groups(sums if sums is not None else event_sums(conn, node, win, pid)),
                  histograms(conn, node, win, TIMED_CODES, pid), calls, (end - start) / 1e9,
                  conn, node, win, pid, {SYSCALLS.key: durs})


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
        calls = _merge_pids(calls)
    got.exact(EVENTS, groups, hists, per_process)
    got.exact(SYSCALLS, calls, {}, per_process)
    names = comms or {}
    rows = [
        _row(node, p if per_process else None, op, groups.get((p, op)), hists.get((p, op)),
             span_s, names.get(p) if per_process else None)
        for p, op in sorted(set(groups) | set(hists))
    ]
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
    out: dict[tuple[int, int], _Group] = defaultdict(_Group)
    for (_, op), g in groups.items():
        out[(0, op)].merge(g)
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
    durs: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    errors: dict[tuple[int, str, int], int] = defaultdict(int)
    stored: dict[tuple[int, int], int] = defaultdict(int)
    for p, op, dur, ret, kernel in conn.execute(sql, params):
        p = p if per_process else 0
        name = kernel if isinstance(kernel, str) and kernel else UNNAMED
        durs[(p, name, op)].append(dur)
        errors[(p, name, op)] += ret != 0
        stored[(p, op)] += 1
    groups = {k: _Group.of(v, errors[k]) for k, v in durs.items()}
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
        est = round(g.count * scale)
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

