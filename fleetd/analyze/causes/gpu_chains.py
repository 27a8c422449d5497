"""``gpu_idle``: the GPU sat idle while the thread that feeds it was kept from running.

Only databases with imported GPU timelines (``fleetd import``) have the device's side;
for them this rule joins the two halves of the story. Per process and device:

1. the GPU's idle gaps: the holes between the union of its kernels, copies and sets,
   inside the span the device was in use (first GPU start .. last GPU end) and the
   window, at least :data:`MIN_GAP_NS` long (shorter holes are the launch cadence itself);
2. the threads that launched the process's GPU work (the launch call of each GPU row);
3. those threads' host waits: off-CPU intervals (preempted, sleeping, D state) and
   run-queue waits, as the tracer or an nsys import recorded them;
4. the overlap of (1) with the union of (3): GPU idle time during which the launching
   thread could not have launched anything.

``explained`` is that overlap over the idle time of the gaps; ``impact`` the overlap over
the node's wall time, so severity reads as for every other chain. Without GPU tables, GPU
rows or host waits on a launching thread, it adds nothing.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleetd.analyze.causes.chains import Chain
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, RankedCulprit
from fleetd.analyze.reading.data import in_list
from fleetd.store.catalog import op_code
from fleetd.store.db import present_tables
from fleetd.store.imports import STATE_NOT_RECORDED
from fleetd.store.timeparse import format_ns

MIN_GAP_NS = 100_000  # a GPU idle hole shorter than this is launch cadence, not a stall
MIN_COVERED_NS = 1_000_000  # less host-covered idle than this is not worth a chain
EVIDENCE_GAPS = 3  # gaps shown, most covered first (then in time order)
EVIDENCE_PER_GAP = 3  # host waits shown per gap, largest overlap first
OFF_CPU, RUNQ = op_code("off_cpu"), op_code("runq_wait")
UNRECORDED = "off the CPU (state not recorded)"

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Wait:
    """A host wait of a launching thread: off CPU (state R, S or D) or in the run queue."""

    rowkey: int
    ts: int
    end: int
    tid: int
    kind: str  # off_cpu | runq_wait
    state: str | None  # R, S, D for off_cpu
    peer: int
    recorded: bool = True  # False: the import's source did not say why it left the CPU

    @property
    def label(self) -> str:
        if self.kind == "runq_wait":
            return "run queue"
        if not self.recorded:
            return UNRECORDED
        return {"R": "preempted", "D": "D-state"}.get(self.state or "", "sleeping")


def gpu_idle_rule(ctx: Context) -> list[Chain]:
    """One chain per process and device whose GPU idle overlaps its launchers' waits."""
    conn, node = ctx.view.conn, ctx.view.node
    if not present_tables(conn, ("gpu_data",)):
        return []
    lo, hi = ctx.view.win.start_ns, ctx.view.win.end_ns
    out: list[Chain] = []
    for pid, device in conn.execute(
            "SELECT DISTINCT pid, device FROM gpu_data WHERE id BETWEEN ? AND ? AND kind IN "
            "(1, 2, 3) AND ts_ns < ? AND ts_ns + dur_ns > ? AND pid != 0 ORDER BY 1, 2",
            (node.lo, node.hi, hi, lo)).fetchall():
        chain = _rank_chain(ctx, int(pid), int(device), lo, hi)
        if chain is not None:
            out.append(chain)
    return out


def idle_gaps(busy: Iterable[Span], lo: int, hi: int, min_gap: int = MIN_GAP_NS) -> list[Span]:
    """Holes of at least ``min_gap`` between the merged ``busy`` spans, inside their own
    extent clipped to [lo, hi)."""
    merged: list[list[int]] = []
    for s, e in sorted(busy):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    gaps = []
    for (_, e0), (s1, _) in zip(merged, merged[1:], strict=False):
        a, b = max(e0, lo), min(s1, hi)
        if b - a >= min_gap:
            gaps.append((a, b))
    return gaps


def covered(gap: Span, waits: Sequence[Wait]) -> int:
    """Time of ``gap`` inside the union of the waits."""
    spans = sorted((max(w.ts, gap[0]), min(w.end, gap[1])) for w in waits)
    total, cur = 0, gap[0]
    for s, e in spans:
        s = max(s, cur)
        if e > s:
            total += e - s
            cur = e
    return total


def _rank_chain(ctx: Context, pid: int, device: int, lo: int, hi: int) -> Chain | None:
    conn, node = ctx.view.conn, ctx.view.node
    busy = [(int(t), int(t) + int(d)) for t, d in conn.execute(
        "SELECT ts_ns, dur_ns FROM gpu_data WHERE id BETWEEN ? AND ? AND pid = ? AND "
        "device = ? AND kind IN (1, 2, 3) AND ts_ns < ? AND ts_ns + dur_ns > ?",
        (node.lo, node.hi, pid, device, hi, lo))]
    gaps = idle_gaps(busy, lo, hi)
    tids = [int(t) for (t,) in conn.execute(
        "SELECT DISTINCT e.tid FROM gpu_data g JOIN event_data e ON "
        "e.id = ((g.id >> 40) << 40) | g.launch WHERE g.id BETWEEN ? AND ? AND g.pid = ? "
        "AND g.device = ? AND g.launch != 0", (node.lo, node.hi, pid, device))]
    if not gaps or not tids:
        return None
    waits = _waits(conn, ctx, tids, gaps[0][0], gaps[-1][1])
    if not waits:
        return None
    per_gap = [(g, _overlapping(g, waits)) for g in gaps]
    cover = [(g, covered(g, ws), ws) for g, ws in per_gap]
    total_cover = sum(c for _, c, _ in cover)
    if total_cover < MIN_COVERED_NS:
        return None
    idle = sum(b - a for a, b in gaps)
    by_label: dict[str, int] = defaultdict(int)
    for g, _, ws in cover:
        for w in ws:
            by_label[w.label] += min(w.end, g[1]) - max(w.ts, g[0])
    detail: ChainDetail = {"kind": "gpu_idle", "device": device, "gaps": len(gaps), "idle_ns": idle,
              "covered_ns": total_cover, "gaps_covered": sum(1 for _, c, _ in cover if c),
              "launch_tids": tids, "waits_ns": dict(sorted(by_label.items())),
              "dominant": max(by_label.items(), key=lambda kv: (kv[1], kv[0]))[0]}
    ch = rule_chain(ctx, "gpu_idle", pid, None, total_cover / idle,
                    total_cover / max(1, ctx.span_ns), _evidence(ctx, cover, device), detail)
    ch.culprits = _culprits(ctx, cover, pid, set(tids))
    ch.start_ns = min(g[0] for g, c, _ in cover if c)
    ch.end_ns = max(g[1] for g, c, _ in cover if c)
    return ch


def _waits(conn: sqlite3.Connection, ctx: Context, tids: list[int], lo: int, hi: int
           ) -> list[Wait]:
    node = ctx.view.node
    out = []
    for key, ts, dur, tid, op, a0, peer in conn.execute(
            "SELECT id, ts_ns, dur_ns, tid, op, a0, peer FROM event_data WHERE id BETWEEN ? "
            f"AND ? AND op IN ({OFF_CPU}, {RUNQ}) AND tid IN {in_list(tids)} AND ts_ns < ? "
            "AND ts_ns + dur_ns > ? ORDER BY ts_ns", (node.lo, node.hi, hi, lo)):
        state = None
        if op == OFF_CPU:
            s = int(a0) & 0xFF
            state = "R" if s == 0 else "D" if s & 2 else "S"
        out.append(Wait(int(key), int(ts), int(ts) + int(dur), int(tid),
                        "off_cpu" if op == OFF_CPU else "runq_wait", state, int(peer or 0),
                        not (op == OFF_CPU and int(a0) & STATE_NOT_RECORDED)))
    return out


def _overlapping(gap: Span, waits: Sequence[Wait]) -> list[Wait]:
    return [w for w in waits if w.ts < gap[1] and w.end > gap[0]]


def _evidence(ctx: Context, cover: list[tuple[Span, int, list[Wait]]], device: int
              ) -> list[EvidenceItem]:
    """The most covered gaps in time order, each followed by its largest host waits."""
    view = ctx.view
    top = sorted((c for c in cover if c[1]), key=lambda c: (-c[1], c[0][0]))[:EVIDENCE_GAPS]
    out: list[EvidenceItem] = []
    for (a, b), cov, ws in sorted(top, key=lambda c: c[0][0]):
        gap_id = f"gpu{device}@{a}"
        out.append({"kind": "gpu_gap", "id": gap_id, "ts_ns": a, "time": format_ns(a),
                    "dur_ns": b - a, "device": device, "covered_ns": cov,
                    "text": f"GPU {device} idle {(b - a) / 1e6:.2f} ms, {cov / (b - a):.0%} of "
                            "it while a launching thread waited on the host"})
        biggest = sorted(ws, key=lambda w: -(min(w.end, b) - max(w.ts, a)))[:EVIDENCE_PER_GAP]
        for w in sorted(biggest, key=lambda w: w.ts):
            ov = min(w.end, b) - max(w.ts, a)
            item: EvidenceItem = {
                "kind": w.kind, "id": view.node.event_id(w.rowkey), "ts_ns": w.ts,
                "time": format_ns(w.ts), "dur_ns": w.end - w.ts, "overlap_ns": ov,
                "tid": w.tid, "spike": gap_id,
                "culprit": view.who(w.peer) if w.peer else None,
                "text": f"launching thread {w.tid} {w.label} for {(w.end - w.ts) / 1e6:.2f} ms "
                        "while the GPU was idle"}
            if w.state is not None and w.recorded:
                item["state"] = w.state
            out.append(item)
    return out


def _culprits(ctx: Context, cover: list[tuple[Span, int, list[Wait]]], victim_pid: int,
              launchers: set[int]) -> list[RankedCulprit]:
    """Who ran while a launcher was preempted or queued, weighted by the overlapped idle."""
    ns: dict[int, int] = defaultdict(int)
    for (a, b), _, ws in cover:
        for w in ws:
            if w.peer and w.peer not in launchers and (w.kind == "runq_wait" or w.state == "R"):
                ns[w.peer] += min(w.end, b) - max(w.ts, a)
    total = sum(ns.values())
    by_pid: dict[int, RankedCulprit] = {}
    for tid, t in sorted(ns.items(), key=lambda kv: -kv[1]):
        who = ctx.view.who(tid)
        d = by_pid.setdefault(int(who["pid"]), {
            "pid": int(who["pid"]), "comm": who["comm"], "tid": tid, "thread": who["thread"],
            "ns": 0, "self": int(who["pid"]) == victim_pid, "share": 0.0})  # share: below
        d["ns"] = d.get("ns", 0) + t
    out = sorted(by_pid.values(), key=lambda d: -d.get("ns", 0))
    for d in out:
        d["share"] = round(d.get("ns", 0) / max(1, total), 3)
    return out[:5]
