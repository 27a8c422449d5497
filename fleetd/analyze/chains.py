"""Causal chains aligned in time: this slow call, on this thread, and what overlapped it.

A *spike* is one CUDA call slower than its op's normal (per process): above its p99 or
K x its median, whichever is lower (a host problem that hits a quarter of the calls moves
p99 into the slow calls), and at least 1.5 x the median and ``MIN_EXCESS_NS`` over it. Each
spike is tied only to the host events of the same thread that overlap that very call
(off-CPU intervals split into preempted / sleeping / D-state / run-queue parts, IRQ
preemption) and to block I/O overlapping its D-state waits, never to whole-window counts.
A *stall* is the same analysis for a long off-CPU interval of a GPU-feeding thread
between two calls (a checkpoint fsync in the loop delays the next launch, not a call).

Spikes and stalls of one thread with the same cause form one chain; its culprit is the
task that took the CPU (sched_switch next task) or that woke the victim from a D-state
wait (sched_waking waker), ranked by the time it accounts for. How much time the cause
cost is not read from the spikes (the stored calls are a sample, and short waits make no
spike): :func:`account` gives each chain its thread's share of wall time in the
breakdown column of its cause, the same figure ``fleetd explain``'s breakdown prints.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import sqlite3
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetd.analyze.data import (
    CALL_CODES,
    SYNC_OPS,
    Node,
    code,
    in_list,
    name_of,
)
from fleetd.analyze.frames import top_python_frame
from fleetd.analyze.waits import reason
from fleetd.analyze.window import Window
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.analyze.chains")

K_MEDIAN = 2.0  # "k x p50": a call this much slower than usual is a spike even below p99
MIN_CALLS = 20  # fewer calls than this and a p99 says nothing
MIN_EXCESS_NS = 50_000  # the tracer's own off-CPU threshold: less cannot be explained
MAX_SPIKES = 500  # per (process, op): the slowest are analyzed, the impact is scaled
STALL_MIN_NS = 2_000_000  # a between-call wait shorter than this is ordinary scheduling
MAX_STALLS = 500
EVIDENCE_SPIKES = 3  # spikes shown per chain, slowest first
EVIDENCE_PER_SPIKE = 6

OFF_CPU, RUNQ, WAKEUP = code("off_cpu"), code("runq_wait"), code("wakeup")
HARDIRQ, SOFTIRQ, BLOCK_IO = code("hardirq"), code("softirq"), code("block_io")
HOST_CODES = (OFF_CPU, WAKEUP, HARDIRQ, SOFTIRQ)
LAUNCH_OPS = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"})
_STATE_MASK = 0xFF  # above it the kernel reports TASK_REPORT_MAX for a preempted task


def task_state(prev_state: int) -> str:
    """R (preempted while runnable), D (uninterruptible) or S (any other sleep)."""
    s = prev_state & _STATE_MASK
    if s == 0:
        return "R"
    return "D" if s & 2 else "S"


@dataclass(slots=True)
class Ev:
    rowkey: int
    ts: int
    dur: int
    pid: int
    tid: int
    op: int
    peer: int = 0
    a0: int = 0
    a1: int = 0
    nbytes: int = 0
    ret: int = 0  # off-CPU records: the syscall the thread slept in, + 1 (waits.reason)

    @property
    def end(self) -> int:
        return self.ts + self.dur


def overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


@dataclass(slots=True)
class Spike:
    call: Ev
    kind: str  # "call" or "stall"
    op: str | None
    baseline_ns: int
    cause_ns: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (role, tid) -> ns; role "cpu" = ran instead, "wake" = woke us, "io" = issued the I/O
    culprit_ns: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    evidence: list[dict[str, Any]] = field(default_factory=list)
    root_cause: str = "unexplained"
    explained_ns: int = 0
    scale: float = 1.0  # stored calls are a sample: slow calls of its op per stored one
    # Sleeps (S state) inside the spike by wait reason (waits.REASONS): which breakdown
    # column a lock_wait of sleeps is part of.
    sleep_why: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def excess_ns(self) -> int:
        return max(1, self.call.dur - self.baseline_ns)


@dataclass(slots=True)
class Baseline:
    pid: int
    op: int
    count: int
    p50: int
    p99: int

    @property
    def threshold(self) -> int:
        return max(min(self.p99, int(K_MEDIAN * self.p50)), self.p50 * 3 // 2,
                   self.p50 + MIN_EXCESS_NS)


class NodeView:
    """Everything chains need from one node's window, read with bounded queries."""

    def __init__(self, conn: sqlite3.Connection, node: Node, win: Window,
                 tasks: dict[int, tuple[int | None, str | None]], names: dict[int, str]) -> None:
        self.conn, self.node, self.win = conn, node, win
        self.tasks, self.names = tasks, names
        self.blocks = self._load_blocks()
        self.block_starts = [b.ts for b in self.blocks]
        self.max_block = max((b.dur for b in self.blocks), default=0)

    def _load_blocks(self) -> list[Ev]:
        # Block requests: of the traced processes, plus any slow one of the system (a
        # neighbour saturating the disk). Few by construction; kept in memory.
        rows = self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, bytes FROM event_data WHERE ts_ns >= ? "
            "AND ts_ns < ? AND id BETWEEN ? AND ? AND op = ? ORDER BY ts_ns",
            (self.win.start_ns - 10**10, self.win.end_ns, self.node.lo, self.node.hi, BLOCK_IO),
        )
        return [Ev(r[0], r[1], r[2], r[3], r[4], BLOCK_IO, nbytes=r[5]) for r in rows]

    def blocks_overlapping(self, t0: int, t1: int) -> list[Ev]:
        i = bisect.bisect_left(self.block_starts, t0 - self.max_block)
        j = bisect.bisect_left(self.block_starts, t1)
        return [b for b in self.blocks[i:j] if b.end > t0]

    def host_events(self, tid: int, t0: int, t1: int) -> list[Ev]:
        """Off-CPU, wakeup and IRQ events of one thread starting in [t0, t1)."""
        rows = self.conn.execute(
            "SELECT id, ts_ns, dur_ns, pid, tid, op, peer, a0, a1, 0, ret FROM event_data "
            "WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND tid = ? "
            f"AND op IN {in_list(HOST_CODES)} ORDER BY ts_ns",
            (t0, t1, self.node.lo, self.node.hi, tid),
        )
        return [Ev(*r) for r in rows]

    def switch_peers(self, tid: int) -> dict[int, int]:
        """How often each task was the next to run when ``tid`` left the CPU, any reason.

        A task that is always runnable beside the victim (a busy loop on its CPU, or in
        its CPU-quota slice) takes over at nearly every switch, voluntary ones included;
        the task that happens to run first after a throttled or long wait does not.
        """
        rows = self.conn.execute(
            "SELECT peer, count(*) FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
            "AND id BETWEEN ? AND ? AND tid = ? AND op = ? AND peer != 0 GROUP BY peer",
            (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi, tid, OFF_CPU),
        )
        return {int(peer): int(n) for peer, n in rows}

    def cpu_takers(self, tid: int) -> dict[int, int]:
        """Who held the CPU while ``tid`` was runnable, over all its recorded run-queue
        time (the breakdown's ``runq`` column): a preemption goes to the task that ran
        instead, the queued tail of a sleep to the task that ran until it got the CPU
        back. The same attribution as a spike's, for the whole window."""
        out: dict[int, int] = defaultdict(int)
        for op, a0, peer, a1, dur in self.conn.execute(
            "SELECT op, a0, peer, a1, dur_ns FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
            "AND id BETWEEN ? AND ? AND tid = ? AND op IN (?, ?)",
            (self.win.start_ns, self.win.end_ns, self.node.lo, self.node.hi, tid, OFF_CPU,
             RUNQ),
        ):
            state = task_state(int(a0 or 0))
            if op == OFF_CPU and state == "R" and peer:
                out[int(peer)] += int(dur)
            elif op == RUNQ and state != "R" and a1:
                out[int(a1)] += int(dur)
        return out

    def wait_channel(self, ev: Ev) -> str | None:
        """The kernel function a D-state wait slept in, when the tracer recorded it."""
        row = self.conn.execute("SELECT json_extract(args, '$.wchan') FROM event_args "
                                "WHERE id = ?", (ev.rowkey,)).fetchone()
        return str(row[0]) if row and row[0] else None

    def kernel(self, ev: Ev) -> str | None:
        """The kernel a launch started, when the tracer named it."""
        row = self.conn.execute("SELECT json_extract(args, '$.kernel') FROM event_args "
                                "WHERE id = ?", (ev.rowkey,)).fetchone()
        return str(row[0]) if row and isinstance(row[0], str) and row[0] else None

    def stack(self, ev: Ev) -> list[str]:
        """The recorded stack of an event (innermost first), or [] when it has none."""
        row = self.conn.execute("SELECT s.frames FROM event_data e JOIN stacks s ON "
                                "s.hash = e.stack WHERE e.id = ? AND e.stack != 0",
                                (ev.rowkey,)).fetchone()
        try:
            value = orjson.loads(row[0]) if row else None
        except orjson.JSONDecodeError:  # a frames value from a foreign writer: one frame
            return [str(row[0])]
        return [str(f) for f in value] if isinstance(value, list) else []

    def next_call_stack(self, ev: Ev) -> list[str]:
        """The stack of the thread's next CUDA call after ``ev`` (within a second)."""
        row = self.conn.execute(
            "SELECT id FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
            f"AND tid = ? AND op IN {in_list(CALL_CODES)} ORDER BY ts_ns LIMIT 1",
            (ev.end, ev.end + 10**9, self.node.lo, self.node.hi, ev.tid)).fetchone()
        return self.stack(Ev(int(row[0]), 0, 0, 0, ev.tid, 0)) if row else []

    def who(self, tid: int) -> dict[str, Any]:
        """A task as the output shows it: pid, tid and the process name."""
        pid, thread = self.tasks.get(tid, (None, None))
        comm = self.names.get(pid) if pid is not None else None
        return {"pid": pid if pid is not None else tid, "tid": tid,
                "comm": comm or thread or f"tid {tid}", "thread": thread}

    def event_id(self, ev: Ev) -> str:
        return self.node.event_id(ev.rowkey)


# ---- spikes -----------------------------------------------------------------------


def find_spikes(view: NodeView, baselines: list[Baseline]) -> tuple[list[Spike], dict[
        tuple[int, int], float]]:
    """Spikes of every (pid, op) with enough calls; and the impact scale per group
    (all spike excess over the analyzed spikes' excess, for the capped groups)."""
    spikes: list[Spike] = []
    scale: dict[tuple[int, int], float] = {}
    node, win = view.node, view.win
    for b in baselines:
        if b.count < MIN_CALLS or b.p50 <= 0:
            continue
        thr = b.threshold
        where = ("WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND op = ? AND pid = ? "
                 "AND dur_ns >= ?")
        params = (win.start_ns, win.end_ns, node.lo, node.hi, b.op, b.pid, thr)
        n, total = view.conn.execute(
            f"SELECT count(*), coalesce(sum(dur_ns), 0) FROM event_data {where}", params
        ).fetchone()
        if not n:
            continue
        rows = view.conn.execute(
            f"SELECT id, ts_ns, dur_ns, pid, tid, op FROM event_data {where} "
            f"ORDER BY dur_ns DESC LIMIT {MAX_SPIKES}", params,
        ).fetchall()
        group = [Spike(Ev(*r), "call", name_of(b.op), b.p50) for r in rows]
        analyzed = sum(s.excess_ns for s in group)
        scale[(b.pid, b.op)] = max(1.0, (int(total) - int(n) * b.p50) / max(1, analyzed))
        spikes += group
    return spikes, scale


def find_stalls(view: NodeView, feeding: dict[int, int]) -> list[Spike]:
    """Long D-state or preempted waits of GPU-feeding threads outside any stored call.

    ``feeding`` maps tid -> pid of threads that made CUDA calls. A wait inside a call
    would make that call slow, and slow calls are always stored, so a wait not covered
    by a stored call really lies between calls.
    """
    if not feeding:
        return []
    node, win = view.node, view.win
    long_calls: dict[int, list[tuple[int, int]]] = defaultdict(list)
    span: dict[int, tuple[int, int]] = {}
    for tid, ts, dur in view.conn.execute(
        "SELECT tid, ts_ns, dur_ns FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND "
        f"id BETWEEN ? AND ? AND op IN {in_list(CALL_CODES)} AND tid IN {in_list(feeding)}",
        (win.start_ns, win.end_ns, node.lo, node.hi),
    ):
        lo, hi = span.get(tid, (ts, ts + dur))
        span[tid] = (min(lo, ts), max(hi, ts + dur))
        if dur >= STALL_MIN_NS:
            long_calls[tid].append((ts, ts + dur))
    for v in long_calls.values():
        v.sort()
    # Off the CPU between calls: preempted or in D state; and, after a voluntary sleep
    # (the thread's own choice), the run-queue wait before it could run again.
    rows = view.conn.execute(
        "SELECT id, ts_ns, dur_ns, pid, tid, op, peer, a0, a1, 0, ret FROM event_data WHERE "
        f"ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND op IN ({OFF_CPU}, {RUNQ}) "
        f"AND tid IN {in_list(feeding)} AND dur_ns >= ? ORDER BY dur_ns DESC "
        f"LIMIT {MAX_STALLS * 4}",
        (win.start_ns, win.end_ns, node.lo, node.hi, STALL_MIN_NS),
    ).fetchall()
    stalls: list[Spike] = []
    for r in rows:
        ev = Ev(*r)
        lo_hi = span.get(ev.tid)
        state = task_state(ev.a0)
        # A preempted thread's run-queue wait is its off-CPU interval: counted once.
        skip = state == "S" if ev.op == OFF_CPU else state == "R"
        # Before the first or after the last call is start-up or shutdown, not the loop.
        if skip or lo_hi is None or not lo_hi[0] < ev.ts < lo_hi[1]:
            continue
        if _inside(long_calls.get(ev.tid, []), ev.ts, ev.end):
            continue
        stalls.append(Spike(ev, "stall", _next_call(view, ev), 0))
        if len(stalls) >= MAX_STALLS:
            break
    return stalls


def _inside(calls: list[tuple[int, int]], t0: int, t1: int) -> bool:
    i = bisect.bisect_right(calls, (t0, 1 << 62))
    return any(c0 <= t0 and t1 <= c1 + 1 for c0, c1 in calls[max(0, i - 8):i])


def _next_call(view: NodeView, ev: Ev) -> str | None:
    """The CUDA call the stall delayed: the thread's next one (within a second)."""
    row = view.conn.execute(
        "SELECT op FROM event_data WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
        f"AND tid = ? AND op IN {in_list(CALL_CODES)} ORDER BY ts_ns LIMIT 1",
        (ev.end, ev.end + 10**9, view.node.lo, view.node.hi, ev.tid),
    ).fetchone()
    return name_of(int(row[0])) if row else None


# ---- attribution ------------------------------------------------------------------


def attribute(view: NodeView, spike: Spike) -> None:
    """Split the spike's time by what its thread was doing, and classify it."""
    c = spike.call
    t0, t1 = c.ts, c.end
    evs = view.host_events(c.tid, t0 - 1, t1) if spike.kind == "call" else [
        c, *[e for e in view.host_events(c.tid, t0, t1) if e.op == WAKEUP]]
    wakes = sorted((e.ts, e.peer) for e in evs if e.op == WAKEUP)
    spike.evidence.append(_spike_item(view, spike))
    for e in evs:
        if e.op == OFF_CPU:
            _off_cpu(view, spike, e, wakes)
        elif e.op == RUNQ:
            _runq(view, spike, e)
        elif e.op in (HARDIRQ, SOFTIRQ):
            ov = overlap(t0, t1, e.ts, e.end)
            if ov:
                spike.cause_ns["irq"] += ov
                spike.evidence.append(_item(view, e, "softirq" if e.op == SOFTIRQ else "hardirq",
                                            ov, f"{'soft' if e.op == SOFTIRQ else 'hard'}irq "
                                            f"{e.a0} preempted the thread", irq=e.a0))
    _classify(view, spike)


def _runq(view: NodeView, spike: Spike, e: Ev) -> None:
    """Woken, then kept waiting for the CPU: the task that held it until then is blamed."""
    ov = overlap(spike.call.ts, spike.call.end, e.ts, e.end)
    if not ov:
        return
    spike.cause_ns["runq"] += ov
    held = view.who(e.a1) if e.a1 else None
    if held:
        spike.culprit_ns[("cpu", e.a1)] += ov
    text = "runnable, waiting for the CPU" + (
        f" while {held['comm']} (pid {held['pid']}) ran" if held else "")
    spike.evidence.append(_item(view, e, "runq_wait", ov, text, culprit=held))


def _off_cpu(view: NodeView, spike: Spike, e: Ev, wakes: list[tuple[int, int]]) -> None:
    c = spike.call
    state = task_state(e.a0)
    if state == "R":
        ov = overlap(c.ts, c.end, e.ts, e.end)
        if ov:
            spike.cause_ns["preempted"] += ov
            spike.culprit_ns[("cpu", e.peer)] += ov
            ran = view.who(e.peer)
            spike.evidence.append(_item(view, e, "off_cpu", ov,
                                        f"preempted; {ran['comm']} (pid {ran['pid']}) ran instead",
                                        state="R", culprit=ran))
        return
    i = bisect.bisect_left(wakes, (e.ts, -1))
    wake, waker = wakes[i] if i < len(wakes) and wakes[i][0] <= e.end else (e.end, 0)
    slept = overlap(c.ts, c.end, e.ts, wake)
    queued = overlap(c.ts, c.end, wake, e.end)
    if queued:
        spike.cause_ns["runq"] += queued
        if e.a1:
            # Woken but kept waiting: whoever held the CPU until it came back.
            spike.culprit_ns[("cpu", e.a1)] += queued
    if not slept:
        return
    by = view.who(waker) if waker else None
    if state == "D":
        ios = view.blocks_overlapping(e.ts, wake)
        if ios:
            spike.cause_ns["block_io"] += slept
            top = max(ios, key=lambda b: overlap(e.ts, wake, b.ts, b.end))
            spike.culprit_ns[("io", top.tid)] += slept
            who = view.who(top.tid)
            spike.evidence.append(_item(view, e, "off_cpu", slept,
                                        f"D-state wait during {len(ios)} block I/O request(s) "
                                        f"({sum(b.nbytes for b in ios)} bytes)", state="D",
                                        culprit=who))
            spike.evidence += [_item(view, b, "block_io", overlap(e.ts, wake, b.ts, b.end),
                                     f"block I/O by {view.who(b.tid)['comm']}: {b.nbytes} bytes",
                                     culprit=view.who(b.tid)) for b in ios[:3]]
            return
        spike.cause_ns["d_state"] += slept
    else:
        why = reason(e.ret)
        spike.cause_ns["sleep"] += slept
        spike.sleep_why[why] += slept
        if why == "timer":
            # A sleep the thread asked for ends by its own timer: the task that happened
            # to be on the CPU when it fired is no culprit.
            waker, by = 0, None
    if waker:
        spike.culprit_ns[("wake", waker)] += slept
    wchan = view.wait_channel(e) if state == "D" else None
    text = ("D-state (uninterruptible) wait" if state == "D" else "sleep") + (
        f" in {wchan}" if wchan else "") + (
        f", woken by {by['comm']} (pid {by['pid']})" if by else "")
    spike.evidence.append(_item(view, e, "off_cpu", slept, text, state=state, culprit=by))


def _classify(view: NodeView, spike: Spike) -> None:
    c = spike.cause_ns
    victim_pid = spike.call.pid
    # Sleeping inside a sync call is waiting for the GPU: not a host cause. Elsewhere a
    # sleep ended by another process is a lock (futex, pipe) held by that process.
    foreign_wake = sum(ns for (role, tid), ns in spike.culprit_ns.items()
                       if role == "wake" and _real_pid(view, tid) not in (None, victim_pid))
    lockish_sleep = 0 if spike.op in SYNC_OPS else min(c.get("sleep", 0), foreign_wake)
    classes = {
        "cpu_contention": c.get("preempted", 0) + c.get("runq", 0),
        "block_io": c.get("block_io", 0),
        "lock_wait": c.get("d_state", 0) + lockish_sleep,
        "irq_preemption": c.get("irq", 0),
    }
    root, ns = max(classes.items(), key=lambda kv: kv[1])
    if ns <= 0:
        return
    spike.root_cause, spike.explained_ns = root, min(ns, spike.excess_ns)


def _real_pid(view: NodeView, tid: int) -> int | None:
    pid = view.who(tid)["pid"]
    return None if tid == 0 or pid == 0 else int(pid)


def _spike_item(view: NodeView, spike: Spike) -> dict[str, Any]:
    """The slow call (or the stall and the call it delayed), with the call's recorded
    stack where there is one: its top Python frame is the user's line."""
    c = spike.call
    kernel = None
    if spike.kind == "call":
        kernel = view.kernel(c) if spike.op in LAUNCH_OPS else None
        of = f" of {kernel}" if kernel else ""
        text = (f"{spike.op}{of} took {_ms(c.dur)} (usual {_ms(spike.baseline_ns)}) "
                f"on thread {c.tid}")
        kind, frames = "spike", view.stack(c)
    else:
        kind, frames = "stall", view.next_call_stack(c) if spike.op else []
        text = f"thread {c.tid} off CPU for {_ms(c.dur)} between CUDA calls"
    where = top_python_frame(frames)
    if spike.kind != "call" and spike.op:
        text += f" (delaying {spike.op}{f' at {where}' if where else ''})"
    elif where:
        text += f" at {where}"
    item = _spike_base(view, spike, kind, text)
    if frames:
        item.update(where=where, stack=frames)
    if kernel:
        item["kernel"] = kernel
    return item


def _spike_base(view: NodeView, spike: Spike, kind: str, text: str) -> dict[str, Any]:
    c = spike.call
    return {"ts_ns": c.ts, "time": format_ns(c.ts), "dur_ns": c.dur, "kind": kind,
            "id": view.event_id(c), "tid": c.tid, "op": spike.op, "text": text}


def _item(view: NodeView, e: Ev, kind: str, ov: int, text: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ts_ns": e.ts, "time": format_ns(e.ts), "dur_ns": e.dur,
                           "overlap_ns": ov, "kind": kind, "id": view.event_id(e),
                           "tid": e.tid, "text": text}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def _ms(ns: int) -> str:
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


# ---- chains -----------------------------------------------------------------------


@dataclass(slots=True)
class Chain:
    node: str
    root_cause: str
    victim: dict[str, Any]
    op: str | None
    spikes: list[Spike]
    span_ns: int
    scale: float = 1.0
    culprits: list[dict[str, Any]] = field(default_factory=list)
    extra_evidence: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""
    fixes: list[str] = field(default_factory=list)
    severity: str = "LOW"
    explained: float = 0.0
    impact: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0  # for rule chains, which have no spikes
    end_ns: int = 0

    @property
    def key(self) -> str:
        culprit = self.culprits[0]["comm"] if self.culprits else "-"
        kind = self.detail.get("kind", "rule")
        return (f"{self.root_cause}|{kind}|{self.victim.get('comm')}|{self.victim.get('tid')}|"
                f"{self.op}|{culprit}")

    @property
    def chain_id(self) -> str:
        return f"{self.node}:{hashlib.sha1(self.key.encode()).hexdigest()[:12]}"

    @property
    def ts_ns(self) -> int:
        return min((s.call.ts for s in self.spikes), default=self.start_ns)

    @property
    def dur_ns(self) -> int:
        end = max((s.call.end for s in self.spikes), default=self.end_ns)
        return max(0, end - self.ts_ns)


# Severities, most severe first: the order every list of chains is sorted in.
SEVERITY_RANK = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}


def severity(explained: float, impact: float) -> str:
    """HIGH: the host explains most of the spikes and they cost >= 5 % of the time;
    MEDIUM: a quarter explained and >= 1 % of the time; LOW: everything else."""
    if explained >= 0.5 and impact >= 0.05:
        return "HIGH"
    if explained >= 0.25 and impact >= 0.01:
        return "MEDIUM"
    return "LOW"


def build_chains(view: NodeView, spikes: list[Spike], scale: dict[tuple[int, int], float],
                 span_ns: int) -> list[Chain]:
    """Group classified spikes per (thread, cause) and measure each group.

    One chain per thread and cause, whichever calls or stalls the time showed up in: the
    lost share a chain states is its thread's whole time for that reason (``account``),
    so two chains of one cause on one thread would state it twice. Unexplained spikes
    stay per op (GPU-side time of one op says nothing about another's)."""
    groups: dict[tuple[int, int, str, str | None], list[Spike]] = defaultdict(list)
    for s in spikes:
        if s.kind == "call" and s.op:
            s.scale = scale.get((s.call.pid, code(s.op)), 1.0)
        groups[(s.call.pid, s.call.tid, s.root_cause,
                s.op if s.root_cause == "unexplained" else None)].append(s)
    chains: list[Chain] = []
    for (pid, tid, root, _), group in groups.items():
        victim = {"pid": pid, "tid": tid, "comm": view.names.get(pid) or view.who(tid)["comm"],
                  "thread": view.tasks.get(tid, (None, None))[1]}
        by_op: dict[tuple[str, str | None], int] = defaultdict(int)
        for s in group:
            by_op[(s.kind, s.op)] += s.excess_ns
        kind, op = max(by_op.items(), key=lambda kv: (kv[1], str(kv[0])))[0]
        factor = max((s.scale for s in group if s.op == op and s.kind == kind), default=1.0)
        ch = Chain(view.node.name, root, victim, op, group, span_ns, factor)
        excess = sum(s.excess_ns for s in group)
        ch.explained = round(sum(s.explained_ns for s in group) / max(1, excess), 3)
        ch.impact = round(min(1.0, sum(s.excess_ns * s.scale for s in group)
                              / max(1, span_ns)), 4)
        ch.culprits = _rank_culprits(view, group, root, pid)
        ch.severity = "LOW" if root == "unexplained" else severity(ch.explained, ch.impact)
        ch.detail = _detail(group, kind, op)
        chains.append(ch)
    return chains


_ROLES = {"cpu_contention": ("cpu",), "lock_wait": ("wake",), "block_io": ("io",),
          "irq_preemption": ()}


def _rank_culprits(view: NodeView, group: list[Spike], root: str, victim_pid: int
                   ) -> list[dict[str, Any]]:
    roles = _ROLES.get(root, ())
    by_pid: dict[int, dict[str, Any]] = {}
    total = 0
    taken: list[tuple[tuple[str, int], int, str | None]] = [
        (key, ns, s.op) for s in group for key, ns in s.culprit_ns.items()]
    if root == "cpu_contention" and group:
        # The chain states all of the thread's run-queue time: its culprits are who held
        # the CPU in all of it, not only in the spikes (the same attribution).
        taken = [(("cpu", tid), ns, None)
                 for tid, ns in view.cpu_takers(group[0].call.tid).items()] or taken
    for (role, tid), ns, op in taken:
        if role not in roles or tid == 0:
            continue
        who = view.who(tid)
        pid = int(who["pid"])
        if pid == 0 or (root == "lock_wait" and pid == victim_pid and role == "wake"
                        and op in SYNC_OPS):
            continue
        entry = by_pid.setdefault(pid, {"pid": pid, "comm": who["comm"], "tids": set(),
                                        "ns": 0, "by_tid": defaultdict(int)})
        entry["tids"].add(tid)
        entry["by_tid"][tid] += ns
        entry["ns"] += ns
        total += ns
    for d in by_pid.values():
        d["share"] = round(d["ns"] / max(1, total), 3)
        d["self"] = d["pid"] == victim_pid
    if root == "cpu_contention" and group:
        # Who ran first after each preemption is only part of the story: under a CPU
        # quota the victim is throttled and whatever is runnable elsewhere goes first.
        # Rank by that time share plus how often each one took over from the victim.
        _add_presence(view, group[0].call.tid, by_pid)
    ranked = sorted(by_pid.values(), key=lambda d: -(d["share"] + d.get("presence", 0.0)))
    for d in ranked:
        d["tids"] = sorted(d["tids"])
        # The thread that accounts for most of the time: the culprit when it is a thread.
        d["tid"] = max(d["by_tid"].items(), key=lambda kv: kv[1])[0]
        d["thread"] = view.tasks.get(d["tid"], (None, None))[1]
        del d["by_tid"]
    return ranked


def _add_presence(view: NodeView, victim_tid: int, by_pid: dict[int, dict[str, Any]]) -> None:
    peers = view.switch_peers(victim_tid)
    counts: dict[int, int] = defaultdict(int)
    for tid, n in peers.items():
        counts[int(view.who(tid)["pid"])] += n
    total = sum(counts.values())
    for pid, d in by_pid.items():
        d["presence"] = round(counts.get(pid, 0) / max(1, total), 3)


def _detail(group: list[Spike], kind: str, op: str | None) -> dict[str, Any]:
    causes: dict[str, int] = defaultdict(int)
    for s in group:
        for k, v in s.cause_ns.items():
            causes[k] += v
    durs = sorted(s.call.dur for s in group)
    stalls = sum(1 for s in group if s.kind == "stall")
    calls = round(sum(s.scale for s in group if s.kind == "call"))
    base = [s.baseline_ns for s in group if s.kind == kind and s.op == op]
    return {"spikes": len(group), "spikes_scaled": stalls + calls, "stalls": stalls,
            "slow_calls": calls, "worst_ns": durs[-1], "median_spike_ns": durs[len(durs) // 2],
            "baseline_ns": base[0] if base else group[0].baseline_ns, "kind": kind,
            "ops": sorted({str(s.op) for s in group if s.op}),
            "excess_ns": sum(s.excess_ns for s in group),
            "host_ns": dict(sorted(causes.items()))}


# ---- the lost share: from the complete accounting ---------------------------------

# The breakdown column (fleetd.analyze.breakdown, per thread) that holds each root
# cause's time. The breakdown counts every recorded wait of the thread, so a chain states
# its lost share from there; the spikes, stalls and sleeps the analyzers read are where
# the time showed up and who caused it (evidence and culprits), not how much of it there
# was: CUDA calls are a sample, and a wait's cause is known only for some waits.
REASON_COLUMN: Mapping[str, str] = {
    "cpu_contention": "runq", "dataloader_oversubscription": "runq", "cpu_throttled": "runq",
    "block_io": "d_state", "lock_wait": "d_state", "irq_preemption": "irq",
    "lock_contention": "lock", "data_starvation": "data", "memory_reclaim": "reclaim",
}
# How each column reads in a summary: "(12.0% of wall time <this>)".
COLUMN_WORDS: Mapping[str, str] = {
    "runq": "preempted or queued for a CPU", "d_state": "in D state",
    "irq": "in interrupts", "lock": "waiting for locks", "data": "waiting for input",
    "timer": "in sleeps of its own", "gpu_sync": "waiting for the GPU",
    "other": "in other waits", "reclaim": "reclaiming memory for its own allocations",
    "lock_spin": "on the CPU spinning in the kernel for a lock",
}


def column_of(ch: Chain) -> str | None:
    """The breakdown column ``ch`` states its share from (None: a cause that is no
    wait, such as host_sync, or an unexplained chain)."""
    if ch.detail.get("share_of"):
        return str(ch.detail["share_of"])
    col = REASON_COLUMN.get(ch.root_cause)
    if ch.root_cause == "lock_wait" and ch.spikes:
        host = ch.detail.get("host_ns") or {}
        if int(host.get("sleep", 0)) > int(host.get("d_state", 0)):
            # Sleeps woken by another process: a futex (lock), a pipe or socket (data).
            why: dict[str, int] = defaultdict(int)
            for s in ch.spikes:
                for k, v in s.sleep_why.items():
                    why[k] += v
            col = max(why.items(), key=lambda kv: kv[1])[0] if why else "other"
    return col


def thread_share(threads: list[dict[str, Any]], tid: int, col: str) -> float | None:
    """The share of its wall time thread ``tid`` spent in breakdown column ``col``."""
    row = next((t for t in threads if int(t["tid"]) == tid), None)
    if row is None or not int(row["wall_ns"]):
        return None
    return min(1.0, int(row[f"{col}_ns"]) / int(row["wall_ns"]))


def account(chains: list[Chain], threads: list[dict[str, Any]]) -> list[Chain]:
    """Each chain's lost share from its victim thread's breakdown column, one chain per
    thread and column.

    Chains of one thread whose causes fall in the same column (a block_io and a
    lock_wait chain both in D state; a lock_contention rule and a lock_wait spike chain
    both on futexes) would state the same time twice: the one whose own evidence
    accounts for the most time keeps the column, the others are listed in its
    ``detail.also``. ``impact`` becomes the column's share (``detail.share``, of
    ``detail.share_of``), what the chain's own records measured stays beside it
    (``detail.estimate``), and the severity is taken again from the share.
    """
    out: list[Chain] = []
    groups: dict[tuple[int, str], list[Chain]] = defaultdict(list)
    for ch in chains:
        col = column_of(ch) if ch.root_cause != "unexplained" else None
        tid = int(ch.victim.get("tid") or 0)
        if col is None or thread_share(threads, tid, col) is None:
            out.append(ch)
            continue
        groups[(tid, col)].append(ch)
    for (tid, col), group in groups.items():
        group.sort(key=lambda c: (-float(c.detail.get("estimate", c.impact)),
                                  SEVERITY_RANK[c.severity], c.key))
        top = group[0]
        share = thread_share(threads, tid, col) or 0.0
        top.detail.setdefault("estimate", top.impact)
        top.detail.update(share=round(share, 6), share_of=col)
        if len(group) > 1:
            top.detail["also"] = [
                {"root_cause": c.root_cause, "op": c.op,
                 "estimate": c.detail.get("estimate", c.impact),
                 "culprit": culprit_json(c.culprits[0]) if c.culprits else None}
                for c in group[1:]]
        top.impact = round(share, 6)
        top.severity = severity(top.explained, top.impact)
        out.append(top)
    return out


def culprit_json(top: Mapping[str, Any]) -> dict[str, Any]:
    """A ranked culprit as a chain's JSON shows it; a thread culprit also names its
    thread. (Also applied to culprits a node sent, so ``self`` may be missing.)"""
    out = {"pid": top["pid"], "comm": top["comm"], "self": top.get("self", False)}
    if top.get("tid") is not None:
        out["tid"], out["thread"] = top["tid"], top.get("thread")
    if top.get("where"):  # a lock holder traced with stacks: its line and frames
        out["where"], out["stack"] = top["where"], top.get("stack") or []
    out.update({k: top[k] for k in ("pod", "namespace", "container", "pod_uid")
                if top.get(k)})  # where it runs (analyze.pods)
    return out


def evidence_timeline(chain: Chain) -> list[dict[str, Any]]:
    """The slowest spikes, each followed by the host events that overlapped it."""
    out: list[dict[str, Any]] = []
    worst = sorted(chain.spikes, key=lambda s: -s.call.dur)[:EVIDENCE_SPIKES]
    for s in sorted(worst, key=lambda s: s.call.ts):
        head, rest = s.evidence[0], s.evidence[1:]
        rest = sorted(rest, key=lambda e: -int(e.get("overlap_ns", 0)))[:EVIDENCE_PER_SPIKE]
        out.append(head)
        for e in sorted(rest, key=lambda e: int(e["ts_ns"])):
            out.append({**e, "spike": head["id"]})
    return out + chain.extra_evidence
