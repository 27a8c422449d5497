"""Spikes and stalls: the slow calls and long between-call waits, and what overlapped them.

A *spike* is one CUDA call slower than its op's normal (per process): above its p99 or
K x its median, whichever is lower (a host problem that hits a quarter of the calls moves
p99 into the slow calls), and at least 1.5 x the median and ``MIN_EXCESS_NS`` over it. A
*stall* is a long off-CPU interval of a GPU-feeding thread between two calls (a
checkpoint fsync in the loop delays the next launch, not a call). :func:`find_spikes`
and :func:`find_stalls` find them; :func:`attribute` splits each one's time by what its
thread was doing (preempted / sleeping / D-state / run-queue parts, IRQ preemption, the
block I/O overlapping its D-state waits), names who took the time, and classifies it.
fleetd.analyze.causes.chains groups the classified spikes into chains.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from fleetd.analyze.causes.io_owner import Charge, charge, queues_for
from fleetd.analyze.reading.answers_chain import EvidenceItem, Task
from fleetd.analyze.reading.data import CALL_CODES, SYNC_OPS, in_list, name_of
from fleetd.analyze.reading.frames import top_python_frame
from fleetd.analyze.reading.nodeview import (
    HARDIRQ,
    OFF_CPU,
    RUNQ,
    SOFTIRQ,
    STALL_MIN_NS,
    WAKEUP,
    Ev,
    NodeView,
    overlap,
    preempt_takers,
    task_state,
)
from fleetd.analyze.reading.waits import reason
from fleetd.store.catalog import KERNEL_LAUNCHES
from fleetd.store.timeparse import format_ns

K_MEDIAN = 2.0  # "k x p50": a call this much slower than usual is a spike even below p99
MIN_CALLS = 20  # fewer calls than this and a p99 says nothing
MIN_EXCESS_NS = 50_000  # the tracer's own off-CPU threshold: less cannot be explained
MAX_SPIKES = 500  # per (process, op): the slowest are analyzed, the impact is scaled
MAX_STALLS = 500


@dataclass(slots=True)
class Spike:
    call: Ev
    kind: str  # "call" or "stall"
    op: str | None
    baseline_ns: int
    cause_ns: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (role, tid) -> ns; role "cpu" = ran instead, "wake" = woke us, "io" = issued the I/O
    culprit_ns: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    evidence: list[EvidenceItem] = field(default_factory=list)
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


# ---- spikes -----------------------------------------------------------------------


def find_spikes(view: NodeView, baselines: list[Baseline]) -> tuple[list[Spike], dict[
        tuple[int, int], float]]:
    """Spikes of every (pid, op) with enough calls; and the impact scale per group
    (all spike excess over the analyzed spikes' excess, for the capped groups)."""
    spikes: list[Spike] = []
    scale: dict[tuple[int, int], float] = {}
    kept = [b for b in baselines if b.count >= MIN_CALLS and b.p50 > 0]
    slow = view.slow_calls({(b.pid, b.op): b.threshold for b in kept})
    for b in kept:
        calls = slow.get((b.pid, b.op))
        if not calls:
            continue
        group = [Spike(ev, "call", name_of(b.op), b.p50) for ev in calls[:MAX_SPIKES]]
        analyzed = sum(s.excess_ns for s in group)
        total = sum(ev.dur for ev in calls)
        scale[(b.pid, b.op)] = max(1.0, (total - len(calls) * b.p50) / max(1, analyzed))
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
    # Off the CPU between calls: preempted or in D state; and, after a voluntary sleep
    # (the thread's own choice), the run-queue wait before it could run again.
    reads = view.stall_reads(sorted(feeding), STALL_MIN_NS, MAX_STALLS * 4)
    span, long_calls = reads.spans, reads.long_calls
    stalls: list[Spike] = []
    for r in reads.waits:
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
            takers = preempt_takers(c.tid, e.peer, e.a1, ov)
            for tid, ns in takers:
                spike.culprit_ns[("cpu", tid)] += ns
            ran = view.who(e.peer)
            text = f"preempted; {ran['comm']} (pid {ran['pid']}) ran instead"
            if len(takers) > 1:
                last = view.who(e.a1)
                text += f", {last['comm']} (pid {last['pid']}) last before it got the CPU back"
            spike.evidence.append(_item(view, e, "off_cpu", ov, text, state="R", culprit=ran))
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
    wchan = view.wait_channel(e) if state == "D" else None
    if state == "D":
        io = charge(view, queues_for(view), c.pid, c.tid, e.ts, wake, wchan, waker)
        if io.is_io:
            _io_wait(view, spike, e, slept, wake - e.ts, io, wchan)
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
    text = ("D-state (uninterruptible) wait" if state == "D" else "sleep") + (
        f" in {wchan}" if wchan else "") + (
        f", woken by {by['comm']} (pid {by['pid']})" if by else "")
    spike.evidence.append(_item(view, e, "off_cpu", slept, text, state=state, culprit=by))


def _io_wait(view: NodeView, spike: Spike, e: Ev, slept: int, whole: int, io: Charge,
             wchan: str | None) -> None:
    """A D-state wait for block I/O: its time (the part inside the spike) charged as
    :func:`charge` splits the whole wait, the victim's own requests first."""
    spike.cause_ns["block_io"] += slept
    for tid, ns in io.by_tid.items():
        spike.culprit_ns[("io", tid)] += ns * slept // max(1, whole)
    top = max(io.by_tid.items(), key=lambda kv: kv[1])[0] if io.by_tid else None
    own = f"{len(io.own)} request(s) of its own ({sum(b.nbytes for b in io.own)} bytes)" \
        if io.own else ("its own read (its request not recorded)" if not io.others
                        else "other processes' I/O")
    behind = f", {_ms(io.queued_ns)} of it queued behind other processes' requests" \
        if io.queued_ns else ""
    where = f" in {wchan}" if wchan else ""
    queues = queues_for(view)
    path = queues.file_of(e)
    on = f" on {path}" if path else (" (a page fault on a mapped file)"
                                      if queues.faulted(e) else "")
    spike.evidence.append(_item(view, e, "off_cpu", slept,
                                f"D-state wait{where}{on} for {own}{behind}", state="D",
                                culprit=view.who(top) if top else None, file=path))
    spike.evidence += [_item(view, b, "block_io", overlap(e.ts, e.ts + whole, b.ts, b.end),
                             f"block I/O of {view.who(b.tid)['comm']}: {b.nbytes} bytes",
                             culprit=view.who(b.tid)) for b in [*io.own[:2], *io.others[:2]]]


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


def _spike_item(view: NodeView, spike: Spike) -> EvidenceItem:
    """The slow call (or the stall and the call it delayed), with the call's recorded
    stack where there is one: its top Python frame is the user's line."""
    c = spike.call
    kernel = None
    if spike.kind == "call":
        kernel = view.kernel(c) if spike.op in KERNEL_LAUNCHES.name_set else None
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
        item["where"], item["stack"] = where, frames
    if kernel:
        item["kernel"] = kernel
    return item


def _spike_base(view: NodeView, spike: Spike, kind: str, text: str) -> EvidenceItem:
    c = spike.call
    return {"ts_ns": c.ts, "time": format_ns(c.ts), "dur_ns": c.dur, "kind": kind,
            "id": view.event_id(c), "tid": c.tid, "op": spike.op, "text": text}


def _item(view: NodeView, e: Ev, kind: str, ov: int, text: str, *, irq: int | None = None,
          state: str | None = None, culprit: Task | None = None, file: str | None = None
          ) -> EvidenceItem:
    """A host event overlapping a spike; the keyword keys only when given (not None)."""
    out: EvidenceItem = {"ts_ns": e.ts, "time": format_ns(e.ts), "dur_ns": e.dur,
                         "overlap_ns": ov, "kind": kind, "id": view.event_id(e),
                         "tid": e.tid, "text": text}
    if irq is not None:
        out["irq"] = irq
    if state is not None:
        out["state"] = state
    if culprit is not None:
        out["culprit"] = culprit
    if file is not None:
        out["file"] = file
    return out


def _ms(ns: int) -> str:
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"

