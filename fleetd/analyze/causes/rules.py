"""Pattern rules: the problems users hit, as stable ``root_cause`` classes.

Time-aligned spikes (chains.py) name cpu_contention, lock_wait, block_io and
irq_preemption with their culprits. The rules here add what no single call shows:

- ``dataloader_oversubscription``: the tasks preempting the GPU thread are its own
  worker processes (children, or three or more siblings of one name), with their
  page-allocation rate as pressure evidence;
- ``host_sync``: one thread spends a large share of its time in sync calls issued every
  few launches, or reads a scalar back every step (``.item()``/``.cpu()``): the CPU
  cannot run ahead of the GPU;
- ``alloc_churn``: cudaMalloc/cudaFree keep happening after warm-up;
- ``graph_recapture``: repeated capture/instantiate with the launch rate dropping
  while it happens.

Each rule chain gets ``explained`` and ``impact`` in the same sense as a spike chain,
so one severity function (chains.severity) ranks them all. A rule whose cause is a
wait states its lost share from the victim thread's column of the per-thread breakdown
(:meth:`Context.share`, chains.REASON_COLUMN), the same figure the breakdown shows; the
records it reads otherwise are its evidence and name its culprits. The rules only find chains;
their summaries and fixes come from the registry in causes.py.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from fleetd.analyze.causes.chains import (
    OFF_CPU,
    Chain,
    NodeView,
    severity,
    task_state,
    thread_share,
)
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, RankedCulprit, Victim
from fleetd.analyze.reading.cgroup_samples import PLACE_KEYS
from fleetd.analyze.reading.data import (
    ALLOC_OPS,
    CALL_CODES,
    CAPTURE_OPS,
    LAUNCH_OPS,
    SYNC_OPS,
    Hist,
    code,
    histograms,
    in_list,
    name_of,
)
from fleetd.analyze.reading.rows import CgroupPlace, OpRow, ThreadRow
from fleetd.analyze.reading.spanreads import CallRow
from fleetd.analyze.reading.sums import Sum
from fleetd.store.catalog import READBACKS
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.analyze.causes.rules")

MIN_WORKERS = 3
MIN_SYNCS = 20
MAX_LAUNCHES_PER_SYNC = 100  # more launches per sync: a sync per many steps, not per step
MIN_SYNC_SHARE = 0.2
READBACK_MAX_BYTES = 64  # a few scalars: what .item() / .cpu() of a loss copies back
MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyKind
MIN_ALLOCS = 20
MIN_LATE_ALLOC_SHARE = 0.3  # share of allocations in the second half: not just warm-up
MIN_CAPTURES = 3
MIN_RATE_DROP = 0.5
PAGE_ALLOC = code("page_alloc")


@dataclass(slots=True)
class Context:
    """What the rules read about one node, computed once by explain."""

    view: NodeView
    span: tuple[int, int]
    ops: list[OpRow]  # per-process op stats
    threads: list[ThreadRow]
    parents: dict[int, int]
    pages: dict[tuple[int, int], Hist] = field(default_factory=dict)
    # What two rules read alike (a thread's sleeps: the wait and pipe rules), read once.
    memo: dict[tuple[str, int], Any] = field(default_factory=dict)

    @property
    def span_ns(self) -> int:
        return max(1, self.span[1] - self.span[0])

    def main_thread(self, pid: int) -> ThreadRow | None:
        """The process's GPU-feeding thread: the one with the most time in CUDA."""
        ts = [t for t in self.threads if t["pid"] == pid and t["in_cuda_ns"] > 0]
        return max(ts, key=lambda t: int(t["in_cuda_ns"]), default=None)

    def gpu_pids(self) -> list[int]:
        return gpu_pids(self.ops)

    def feeders(self) -> list[tuple[int, ThreadRow]]:
        """(pid, feeding thread) of every process with CUDA calls."""
        out = []
        for pid in self.gpu_pids():
            main = self.main_thread(pid)
            if main is not None:
                out.append((pid, main))
        return out

    def op_rows(self, pid: int, names: frozenset[str]) -> list[OpRow]:
        return [r for r in self.ops if r["pid"] == pid and r["op"] in names]

    def share(self, tid: int, column: str) -> float:
        """The share of its wall time thread ``tid`` spent in breakdown ``column``
        (``lock``, ``data``, ``runq``...): what a chain of that reason states."""
        return thread_share(self.threads, tid, column) or 0.0


def gpu_pids(ops: list[OpRow]) -> list[int]:
    """The processes with CUDA or NCCL calls in ``ops``, most time in them first."""
    seen: dict[int, int] = defaultdict(int)
    for r in ops:
        if r["source"] in ("cuda", "graph", "driver", "nccl") and r["pid"] is not None:
            seen[int(r["pid"])] += int(r["total_ns"] or 0)  # None: none timed
    return sorted(seen, key=lambda p: -seen[p])


def _victim(ctx: Context, pid: int) -> Victim:
    t = ctx.main_thread(pid)
    tid = int(t["tid"]) if t else pid
    return {"pid": pid, "tid": tid, "comm": ctx.view.names.get(pid) or ctx.view.who(tid)["comm"],
            "thread": t["thread"] if t else None}


def rule_chain(ctx: Context, root: str, pid: int, op: str | None, explained: float,
                impact: float, evidence: list[EvidenceItem], detail: ChainDetail,
                tid: int | None = None) -> Chain:
    """A rule's chain on thread ``tid`` of ``pid`` (default: its feeding thread). A rule
    whose cause is a wait passes as ``impact`` that thread's breakdown column for it
    (:meth:`Context.share`), named in ``detail['share_of']``."""
    victim = _victim(ctx, pid)
    if tid is not None:
        victim["tid"], victim["thread"] = tid, ctx.view.tasks.get(tid, (None, None))[1]
    ch = Chain(ctx.view.node.name, root, victim, op, [], ctx.span_ns,
               start_ns=ctx.span[0], end_ns=ctx.span[1])
    ch.explained, ch.impact = round(min(1.0, explained), 3), round(min(1.0, impact), 4)
    ch.severity = severity(ch.explained, ch.impact)
    ch.extra_evidence = evidence
    ch.detail = detail
    return ch


def with_place(detail: ChainDetail, place: CgroupPlace) -> None:
    """Add where a cgroup runs (cgroup_samples.place_of: those of its PLACE_KEYS the
    samples gave, in that order) to a chain's detail."""
    for k in PLACE_KEYS:
        if k in place:
            detail[k] = place[k]


def _stat_item(r: OpRow, text: str) -> EvidenceItem:
    return {"kind": "op_stats", "op": r["op"], "pid": r["pid"], "count": r["count"],
            "total_ns": r["total_ns"], "p50_ns": r["p50_ns"], "p99_ns": r["p99_ns"],
            "calls_per_s": r["calls_per_s"], "stats_from": r["stats_from"], "text": text}


def _examples(ctx: Context, pid: int, ops: frozenset[str], n: int = 3) -> list[EvidenceItem]:
    """The slowest stored calls of these ops: concrete, clickable evidence."""
    return _call_items(ctx, ctx.view.longest_calls(pid, (code(o) for o in ops), ctx.span[0],
                                                   ctx.span[1] + 1, n))


def _call_items(ctx: Context, rows: list[Any], notes: dict[int, str] | None = None
                ) -> list[EvidenceItem]:
    """Stored calls (id, ts_ns, dur_ns, tid, op) as ``call`` evidence in time order,
    with a note after the text of those ``notes`` names by id."""
    node, notes = ctx.view.node, notes or {}
    items: list[EvidenceItem] = [
        {"ts_ns": ts, "time": format_ns(ts), "dur_ns": dur, "kind": "call",
         "id": node.event_id(k), "tid": tid, "op": name_of(op),
         "text": f"{name_of(op)} took {dur / 1e6:.2f} ms{notes.get(k, '')}"}
        for k, ts, dur, tid, op in rows]
    return sorted(items, key=lambda e: e["ts_ns"])


# ---- dataloader oversubscription ---------------------------------------------------


def workers_of(ctx: Context, pid: int) -> set[int]:
    """Worker processes of ``pid``: its children, else a group of >= 3 same-name
    siblings (workers started by a launcher, or a parent we did not see)."""
    kids = {p for p, pp in ctx.parents.items() if pp == pid and p != pid}
    if len(kids) >= MIN_WORKERS:
        return kids
    parent = ctx.parents.get(pid)
    by_name: dict[str, set[int]] = defaultdict(set)
    for p, name in ctx.view.names.items():
        if p != pid and (parent is None or ctx.parents.get(p) in (parent, pid)):
            by_name[name].add(p)
    own = ctx.view.names.get(pid)
    groups = [g for n, g in by_name.items() if n != own and len(g) >= MIN_WORKERS]
    return max(groups, key=len, default=kids)


def _page_evidence(ctx: Context, pids: set[int]) -> tuple[float, EvidenceItem]:
    pages = sum(h.total for (p, op), h in ctx.pages.items() if p in pids and op == PAGE_ALLOC)
    allocs = sum(h.count for (p, op), h in ctx.pages.items() if p in pids and op == PAGE_ALLOC)
    rate = pages / (ctx.span_ns / 1e9)
    return rate, {"kind": "page_alloc", "pids": sorted(pids), "allocations": allocs,
                  "pages": pages, "pages_per_s": round(rate, 1),
                  "text": f"{len(pids)} workers allocated {pages} pages "
                          f"({rate * 4096 / 2**20:.1f} MiB/s) in {allocs} allocations"}


def refine_dataloader(ctx: Context, chains: list[Chain]) -> None:
    """A cpu_contention chain whose culprit is one of the victim's workers."""
    for ch in chains:
        if ch.root_cause != "cpu_contention" or not ch.culprits:
            continue
        workers = workers_of(ctx, int(ch.victim["pid"]))
        if len(workers) < MIN_WORKERS or int(ch.culprits[0]["pid"]) not in workers:
            continue
        ch.root_cause = "dataloader_oversubscription"
        _, item = _page_evidence(ctx, workers)
        ch.extra_evidence.append(item)
        ch.detail["workers"] = len(workers)


def dataloader_rule(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """Workers preempting the GPU thread between calls too (no single slow call needed)."""
    done = {int(c.victim["pid"]) for c in chains if c.root_cause == "dataloader_oversubscription"}
    out: list[Chain] = []
    for pid in ctx.gpu_pids():
        workers = workers_of(ctx, pid)
        main = ctx.main_thread(pid)
        if pid in done or len(workers) < MIN_WORKERS or main is None:
            continue
        stolen, total, top = _stolen_by(ctx, int(main["tid"]), workers)
        if total == 0 or stolen == 0:
            continue
        rate, pages = _page_evidence(ctx, workers)
        estimate = stolen / ctx.span_ns
        explained = stolen / total
        if estimate < 0.01:
            continue
        tid = int(main["tid"])
        share = ctx.share(tid, "runq")
        ch = rule_chain(ctx, "dataloader_oversubscription", pid, None, explained, share,
                         [{"kind": "preemption", "ns": stolen, "text":
                           f"{len(workers)} worker processes took the CPU from the GPU thread "
                           f"for {stolen / 1e6:.1f} ms ({explained:.0%} of its preemptions)"},
                          pages], {"workers": len(workers), "pages_per_s": round(rate, 1),
                                   "share": round(share, 6), "share_of": "runq",
                                   "estimate": round(estimate, 4)}, tid)
        ch.culprits = top
        out.append(ch)
    return out


def _stolen_by(ctx: Context, tid: int, workers: set[int]
               ) -> tuple[int, int, list[RankedCulprit]]:
    """Preempted time of ``tid`` in all, and with a worker running instead."""
    v = ctx.view
    per: dict[int, int] = defaultdict(int)
    total = 0
    for peer, a0, dur in v.conn.execute(
        "SELECT peer, a0, dur_ns FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND "
        "id BETWEEN ? AND ? AND tid = ? AND op = ?",
        (ctx.span[0], ctx.span[1] + 1, v.node.lo, v.node.hi, tid, OFF_CPU),
    ):
        if task_state(a0) != "R":
            continue
        total += dur
        who = v.who(peer)
        if int(who["pid"]) in workers:
            per[int(who["pid"])] += dur
    stolen = sum(per.values())
    top: list[RankedCulprit] = [
        {"pid": p, "comm": v.names.get(p) or v.who(p)["comm"], "ns": ns,
         "share": round(ns / max(1, stolen), 3), "self": False}
        for p, ns in sorted(per.items(), key=lambda kv: -kv[1])]
    return stolen, total, top


# ---- host sync, alloc churn, graph re-capture ---------------------------------------


def host_sync_rule(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """``chains``: the spike chains; sync time they already explain (a hog inflating
    the syncs) is not counted again as synchronization."""
    out: list[Chain] = []
    for pid in ctx.gpu_pids():
        ch = _timed_syncs(ctx, pid, chains) or _readbacks(ctx, pid)
        if ch is not None:
            out.append(ch)
    return out


def _timed_syncs(ctx: Context, pid: int, chains: list[Chain]) -> Chain | None:
    """Sync calls issued every few launches that take a large share of the thread's time."""
    known = sum(s.excess_ns * s.scale for c in chains for s in c.spikes
                if int(c.victim["pid"]) == pid and s.op in SYNC_OPS and s.kind == "call"
                and c.root_cause != "unexplained")
    syncs = ctx.op_rows(pid, SYNC_OPS)
    n = sum(int(r["count"]) for r in syncs)
    if n < MIN_SYNCS:
        return None
    launches = sum(int(r["count"]) for r in ctx.op_rows(pid, LAUNCH_OPS))
    per_sync = launches / n
    share = max(0.0, sum((r["total_ns"] or 0) for r in syncs) - known) / ctx.span_ns
    rate = n / (ctx.span_ns / 1e9)
    if per_sync > MAX_LAUNCHES_PER_SYNC or share < MIN_SYNC_SHARE or rate < 1.0:
        return None
    top = max(syncs, key=lambda r: (r["total_ns"] or 0))
    ev = [_stat_item(r, f"{r['op']}: {r['count']} calls, {(r['total_ns'] or 0) / 1e6:.0f} ms "
                        f"in all ({r['calls_per_s']}/s)") for r in syncs]
    ev.append({"kind": "ratio", "launches": launches, "syncs": n,
               "launches_per_sync": round(per_sync, 1),
               "text": f"a sync every {per_sync:.0f} launches; the thread spent "
                       f"{share:.0%} of its time waiting in syncs"})
    ev += _examples(ctx, pid, frozenset(r["op"] for r in syncs))
    return rule_chain(ctx, "host_sync", pid, str(top["op"]), share, share, ev,
                       {"syncs": n, "launches": launches, "sync_share": round(share, 3),
                        "syncs_per_s": round(rate, 2)})


def _readbacks(ctx: Context, pid: int) -> Chain | None:
    """Tiny device-to-host copies every step: ``loss.item()``, ``.cpu()`` of a scalar.

    Each one makes the CPU wait until the GPU has drained its queue, so the CPU can
    never run ahead. The pattern is the cause even where the waits are short (a GPU
    that keeps up, or none at all): severity then follows the time it measurably cost.
    """
    dtoh = code("cuMemcpyDtoH_v2")
    copies = [r for r in _span_calls(ctx, pid, READBACK_CODES) if 1 <= r[7] <= READBACK_MAX_BYTES
              and (r[5] == dtoh or r[6] == MEMCPY_DEVICE_TO_HOST)]
    n, total = len(copies), sum(r[2] for r in copies)
    biggest = max((r[7] for r in copies), default=0)
    launches = sum(int(r["count"]) for r in ctx.op_rows(pid, LAUNCH_OPS))
    rate = n / (ctx.span_ns / 1e9)
    if n < MIN_SYNCS or rate < 1.0 or launches / max(1, n) > MAX_LAUNCHES_PER_SYNC:
        return None
    share = total / ctx.span_ns
    per = launches / n
    ev: list[EvidenceItem] = [
        {"kind": "readback", "count": n, "max_bytes": biggest, "total_ns": total,
         "text": f"{n} device-to-host copies of at most {biggest} bytes ({rate:.1f}/s), "
                 f"one every {per:.0f} launches: a scalar read back each step"}]
    ev += _examples(ctx, pid, READBACKS.name_set)
    return rule_chain(ctx, "host_sync", pid, "cudaMemcpy", 1.0, share, ev,
                       {"syncs": n, "launches": launches, "sync_share": round(share, 4),
                        "syncs_per_s": round(rate, 2), "readbacks": n,
                        "readback_bytes": biggest})


def alloc_churn_rule(ctx: Context) -> list[Chain]:
    """Allocation calls after the process's start-up, again and again: churn. Those
    before its first launch (buffers allocated once, the CUDA context the first call
    creates) are start-up, stated by a LOW ``startup`` chain when they cost time."""
    out: list[Chain] = []
    for pid in ctx.gpu_pids():
        started = _first_launch(ctx, pid)
        early = _alloc_calls(ctx, pid, ctx.span[0], started)
        if started is not None and sum(r[2] for r in early) >= STARTUP_MIN_NS:
            out.append(_startup_chain(ctx, pid, started, early))
        begin = started if started is not None else ctx.span[0]
        ch = _churn(ctx, pid, begin)
        if ch is not None:
            out.append(ch)
    return out


AllocRows = list[CallRow]  # spanreads.SPAN_COLS (id, ts_ns, dur_ns, pid, tid, op...), by time
# The dense ops the rules read per process, read together (one walk of the span).
READBACK_CODES = (code("cudaMemcpy"), code("cuMemcpyDtoH_v2"))
ALLOC_CODES = tuple(sorted(code(o) for o in ALLOC_OPS))
_DENSE_READS = (ALLOC_CODES, READBACK_CODES)


def _first_launch(ctx: Context, pid: int) -> int | None:
    """When the process first launched work: its set-up ends there. None: no launch
    in the window (then the first call of each allocation op is the start-up)."""
    launches = tuple(sorted(code(o) for o in LAUNCH_OPS))
    return ctx.view.first_of(launches, ctx.span[0], ctx.span[1] + 1).get(pid)


def _span_calls(ctx: Context, pid: int, ops: tuple[int, ...]) -> list[CallRow]:
    """The process's stored events of ``ops`` in the span, in time order (rows of
    spanreads.SPAN_COLS: id, ts_ns, dur_ns, pid, tid, op, a0, bytes...): read once for
    every process (NodeView.calls_by_pid), the dense op sets of the rules together, and
    with them the feeding threads' sleeps (the wait and pipe rules': one walk of the
    span)."""
    if ops not in _DENSE_READS:
        return ctx.view.calls_by_pid(ops, ctx.span[0], ctx.span[1] + 1).get(pid, [])
    return ctx.view.calls_by_pid(ops, ctx.span[0], ctx.span[1] + 1, _DENSE_READS,
                                 _sleepers(ctx)).get(pid, [])


def _sleepers(ctx: Context) -> list[int]:
    return sorted({int(main["tid"]) for _, main in ctx.feeders()})


def dense_plan(span: tuple[int, int], sums: list[Sum]
               ) -> tuple[list[tuple[int, ...]], int, int, list[int]]:
    """The rules' one walk of the span (:func:`_span_calls`) as another process can
    make it before the breakdown exists: the dense op sets, the span, and the sleeps of
    every thread with a stored CUDA call (the feeders, the threads with the most CUDA
    time, are among them; NodeView.sleep_rows takes a read of more threads)."""
    tids = sorted({s.tid for s in sums if s.op in CALL_CODES})
    return list(_DENSE_READS), span[0], span[1] + 1, tids


def prefetch(ctx: Context, reopen: Callable[[], sqlite3.Connection]) -> None:
    """Start the rules' one walk of the span (:func:`_span_calls`' dense calls and the
    feeders' sleeps) in a thread on another connection (``reopen``), while the spike
    chains are found: the allocation rule reads it for every process that calls CUDA."""
    if ctx.gpu_pids():
        ctx.view.prefetch_calls(reopen, _DENSE_READS[0], ctx.span[0], ctx.span[1] + 1,
                                _DENSE_READS, _sleepers(ctx))


def _alloc_calls(ctx: Context, pid: int, t0: int, t1: int | None) -> AllocRows:
    """The process's allocation calls in [t0, t1) (all stored: they are always kept)."""
    rows = _span_calls(ctx, pid, ALLOC_CODES)
    end = ctx.span[1] + 1 if t1 is None else t1
    start = itemgetter(1)
    return rows[bisect.bisect_left(rows, t0, key=start):bisect.bisect_left(rows, end, key=start)]


STARTUP_MIN_NS = 10_000_000  # start-up allocation time below this is not worth a line


def _startup_chain(ctx: Context, pid: int, started: int, early: AllocRows) -> Chain:
    """The allocation calls before the first launch: one-time start-up (the first one
    also creates the CUDA context), LOW whatever it cost: it does not recur."""
    total = sum(r[2] for r in early)
    first = early[0]
    ev = _call_items(ctx, _longest(early),
                     {first[0]: " (its first allocation: a process's first CUDA call also "
                                "creates its context)"})
    ch = rule_chain(ctx, "startup", pid, name_of(first[5]), 1.0, total / ctx.span_ns,
                    ev, {"calls": len(early), "startup_ns": total, "first_ns": first[2],
                         "first_op": name_of(first[5]), "first_launch_ns": started})
    ch.severity = "LOW"  # paid once per process: no fix in the loop makes it go away
    return ch


def _churn(ctx: Context, pid: int, begin: int) -> Chain | None:
    """Allocation calls from ``begin`` on that keep coming in the second half of the
    rest of the window (not warm-up). Without a launch, each op's first call is left
    out as start-up."""
    calls = _alloc_calls(ctx, pid, begin, None)
    if begin == ctx.span[0]:
        firsts = {r[5]: r[0] for r in reversed(calls)}
        calls = [r for r in calls if firsts[r[5]] != r[0]]
    per_op = Counter(map(itemgetter(5), calls))  # op -> calls, in time order of first call
    frees = sum(n for op, n in per_op.items() if op in _FREE_CODES)
    allocs = len(calls) - frees
    if allocs < MIN_ALLOCS or frees < MIN_ALLOCS // 2:
        return None
    mid = (begin + ctx.span[1]) // 2
    # In time order: the calls from mid on are the tail.
    late = len(calls) - bisect.bisect_left(calls, mid, key=itemgetter(1))
    late_share = late / max(1, len(calls))
    if late_share < MIN_LATE_ALLOC_SHARE:
        return None
    by_op: dict[int, int] = dict.fromkeys(per_op, 0)
    for r in calls:
        by_op[r[5]] += r[2]
    share = sum(by_op.values()) / ctx.span_ns
    rate = allocs / (ctx.span_ns / 1e9)
    rows = ctx.op_rows(pid, ALLOC_OPS)
    ev = [_stat_item(r, f"{r['op']}: {r['count']} calls ({r['calls_per_s']}/s), "
                        f"{(r['total_ns'] or 0) / 1e6:.1f} ms in all") for r in rows]
    ev.append({"kind": "ratio", "late_share": round(late_share, 3),
               "text": f"{late_share:.0%} of the allocation calls after start-up came in the "
                       "second half of the rest of the window: allocation continues"})
    ev += _call_items(ctx, _longest(calls))
    top = max(by_op.items(), key=lambda kv: kv[1])[0]
    return rule_chain(ctx, "alloc_churn", pid, name_of(top), 2 * late_share, share, ev,
                      {"allocs": allocs, "frees": frees, "allocs_per_s": round(rate, 2),
                       "alloc_share": round(share, 4)})


_FREE_CODES = frozenset(code(o) for o in ALLOC_OPS if "Free" in o)


def _longest(calls: AllocRows, n: int = 3) -> list[tuple[int, int, int, int, int]]:
    """The ``n`` longest calls (the first in time order among equal ones), as
    :func:`_call_items` takes them."""
    # nlargest keeps equal ones in their order, as a stable sort by -dur_ns did.
    return [(r[0], r[1], r[2], r[4], r[5]) for r in heapq.nlargest(n, calls, key=itemgetter(2))]


def graph_recapture_rule(ctx: Context) -> list[Chain]:
    out: list[Chain] = []
    captures = tuple(sorted(code(o) for o in CAPTURE_OPS))
    for pid in ctx.gpu_pids():
        caps = [(r[1], r[2], r[5]) for r in _span_calls(ctx, pid, captures)]
        begins = sum(1 for _, _, op in caps if op in (code("cudaStreamBeginCapture"),
                                                      code("cudaGraphInstantiate")))
        if begins < MIN_CAPTURES:
            continue
        drop, affected, rates = _launch_rate_drop(ctx, pid, caps)
        cap_ns = sum(d for _, d, _ in caps)
        share = cap_ns / ctx.span_ns
        if drop < MIN_RATE_DROP and share < 0.05:
            continue
        impact = max(share, affected * drop)
        ev: list[EvidenceItem] = [{
            "kind": "launch_rate", "text": f"launch rate {rates[0]:.0f}/s outside capture, "
            f"{rates[1]:.0f}/s while capturing ({drop:.0%} drop); {begins} captures/"
            f"instantiations took {cap_ns / 1e6:.1f} ms", "rate_outside": round(rates[0], 1),
            "rate_during": round(rates[1], 1), "drop": round(drop, 3)}]
        ev += _examples(ctx, pid, CAPTURE_OPS)
        out.append(rule_chain(ctx, "graph_recapture", pid, "cudaGraphInstantiate",
                               max(drop, share), impact, ev,
                               {"captures": begins, "launch_rate_drop": round(drop, 3),
                                "capture_share": round(share, 4)}))
    return out


def _launch_rate_drop(ctx: Context, pid: int, caps: list[tuple[int, int, int]]
                      ) -> tuple[float, float, tuple[float, float]]:
    """Launch rate in time bins with capture activity vs bins without: (drop, share of
    bins affected, (rate outside, rate during))."""
    v = ctx.view
    nbins = 100
    width = max(1, ctx.span_ns // nbins)
    busy = set()
    for ts, dur, _ in caps:
        for b in range((ts - ctx.span[0]) // width, (ts + dur - ctx.span[0]) // width + 1):
            busy.add(b)
    counts = [0] * (nbins + 1)
    capturing = _capture_intervals(caps)
    for (t,) in v.conn.execute(
        "SELECT ts_ns FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
        f"AND pid = ? AND op IN {in_list(code(o) for o in LAUNCH_OPS)}",
        (ctx.span[0], ctx.span[1] + 1, v.node.lo, v.node.hi, pid),
    ):
        # A kernel "launched" into a capturing stream is recorded, not run.
        i = bisect.bisect_right(capturing, (t, 1 << 62)) - 1
        if i < 0 or not capturing[i][0] <= t <= capturing[i][1]:
            counts[min(nbins, (t - ctx.span[0]) // width)] += 1
    inside = [counts[b] for b in range(nbins) if b in busy]
    outside = [counts[b] for b in range(nbins) if b not in busy]
    if not inside or not outside:
        return 0.0, 0.0, (0.0, 0.0)
    sec = width / 1e9
    r_out = sum(outside) / len(outside) / sec
    r_in = sum(inside) / len(inside) / sec
    drop = max(0.0, 1 - r_in / r_out) if r_out > 0 else 0.0
    return drop, len(inside) / nbins, (r_out, r_in)


def _capture_intervals(caps: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """[BeginCapture start, EndCapture end] spans, in time order."""
    begin, end = code("cudaStreamBeginCapture"), code("cudaStreamEndCapture")
    out: list[tuple[int, int]] = []
    open_at: int | None = None
    for ts, dur, op in caps:
        if op == begin:
            open_at = ts
        elif op == end and open_at is not None:
            out.append((open_at, ts + dur))
            open_at = None
    return out


def page_hists(conn: sqlite3.Connection, ctx_view: NodeView) -> dict[tuple[int, int], Hist]:
    return histograms(conn, ctx_view.node, ctx_view.win, (PAGE_ALLOC,))

