"""What the feeding thread does while it runs: ``gc_pause`` and ``host_cpu_bound``.

Both rules read the tracer's on-CPU samples of the feeding thread (:mod:`fleetd.analyze.
reading.profile`): one sample per period while the thread was on a CPU, with its stack and
whether its interpreter was collecting garbage. A share they state is ``samples x
period / wall``, the sampler's own accounting; the breakdown's ``running`` share of the
same thread is put beside it (``detail.running_share``), and the two agree to within
the sampling error.

* ``gc_pause``: the thread stalled in CPython's collector between CUDA calls. The
  pauses are the tracer's ``gc_pause`` events (runs of consecutive samples in the
  collector): how many, the longest, and the share of wall time all GC samples stand
  for. No other task is a culprit: the thread itself collected.
* ``host_cpu_bound``: the thread was on the CPU outside CUDA calls for most of the time
  it could run (its run-queue time is ``cpu_contention``'s) while waiting little for the
  GPU: the host, not the device, sets the pace. The chain
  names the frames that took the time (innermost Python frame of each sample, a native
  frame where no Python frame is known), by share of the thread's samples. A thread that
  is busy but keeps the GPU fed waits on it (sync calls, launches that block), so it
  does not fire there; GC samples belong to ``gc_pause`` and are left out of it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fleetd.analyze.causes.chains import Chain, severity
from fleetd.analyze.causes.idle_frames import during_idle, rank_frames
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem, GcTrigger, TopFrame
from fleetd.analyze.reading.data import code
from fleetd.analyze.reading.frames import short_frame, top_python_frame
from fleetd.analyze.reading.profile import GC_FRAME, StackCount, flame_stacks
from fleetd.analyze.reading.rows import ThreadRow

GC_PAUSE = code("gc_pause")
MIN_GC_SHARE = 0.02  # of wall time in the collector: below, collections are noise
MIN_GC_SAMPLES = 3
MIN_SAMPLES = 20  # on-CPU samples of the thread before a profile is worth a verdict
MIN_HOST_SHARE = 0.5  # on the CPU outside CUDA calls, of the time it was not queued for one
MAX_GPU_WAIT_SHARE = 0.2  # of wall time in CUDA calls or waiting for the GPU


@dataclass(slots=True)
class ThreadSamples:
    """One feeding thread's samples over the window."""

    pid: int
    tid: int
    stacks: list[StackCount]
    period_ns: int

    @property
    def total(self) -> int:
        return sum(s.samples for s in self.stacks)

    @property
    def gc(self) -> int:
        return sum(s.gc for s in self.stacks)

    @property
    def host(self) -> list[StackCount]:
        """Samples outside CUDA calls, the collector and kernel lock spinning (a wait
        for another task that burns CPU: the lock's chain states it)."""
        return [s for s in self.stacks if not s.in_cuda and not s.gc and not s.lock_spin]

    @property
    def spin(self) -> list[StackCount]:
        return [s for s in self.stacks if s.lock_spin and not s.gc]


def _feeding_threads(ctx: Context) -> list[ThreadSamples]:
    out = []
    for pid in ctx.gpu_pids():
        t = ctx.main_thread(pid)
        if t is None:
            continue
        tid = int(t["tid"])
        stacks, period = ctx.view.thread_stacks(pid, tid)  # one read for all threads
        if stacks and period > 0:
            out.append(ThreadSamples(pid, tid, stacks, period))
    return out


def oncpu_rules(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """``gc_pause`` and ``host_cpu_bound`` chains of the feeding threads; the time a
    thread spun in the kernel for a lock joins its ``lock_wait`` chain in ``chains``."""
    out: list[Chain] = []
    for ts in _feeding_threads(ctx):
        _add_lock_spin(ctx, ts, chains)
        gc = _gc_chain(ctx, ts)
        if gc is not None:
            out.append(gc)
        bound = _cpu_bound_chain(ctx, ts)
        if bound is not None:
            out.append(bound)
    return out


# ---- lock spinning ------------------------------------------------------------------------


def _add_lock_spin(ctx: Context, ts: ThreadSamples, chains: list[Chain]) -> None:
    """A thread that waits for a kernel lock (a file's inode lock another process holds
    while it rewrites the file) sleeps in D state only part of the wait: while the holder
    runs, the kernel spins the waiter on its CPU (optimistic spinning), and the
    scheduler counts that as running. The breakdown's ``lock_spin`` column holds that
    part, from the samples taken in the spinning functions; the thread's ``lock_wait``
    chain states both columns (``detail.share_of`` and ``detail.share_also``), and its
    severity follows the sum."""
    target = next((c for c in chains if c.root_cause == "lock_wait"
                   and int(c.victim.get("tid") or -1) == ts.tid), None)
    share = ctx.share(ts.tid, "lock_spin")
    spin = ts.spin
    if target is None or share < MIN_GC_SHARE or not spin:
        return
    n = sum(s.samples for s in spin)
    kernel = Counter(s.kernel for s in spin).most_common(1)[0][0]
    where = _top_frames(spin, ts.total)[0]["frame"]
    hz = round(1e9 / ts.period_ns)
    target.extra_evidence.append({
        "kind": "lock_spin", "text":
        f"{n} of the thread's {ts.total} on-CPU samples at {hz} Hz were taken spinning in "
        f"the kernel for a lock ({kernel}) under {where}: {share:.1%} of the window on "
        "the CPU waiting (the breakdown's lock_spin column)"})
    target.detail["lock_spin_share"] = round(share, 4)
    target.detail["spin_samples"] = n
    target.detail["share_also"] = ["lock_spin"]
    target.impact = round(target.impact + share, 6)
    target.severity = severity(target.explained, target.impact)


# ---- gc_pause ---------------------------------------------------------------------------


def _pauses(ctx: Context, tid: int) -> list[tuple[int, int, int, int]]:
    """(start, length, samples, generation) of the thread's GC pauses in the window:
    from runs of samples (generation -1), or measured by the interpreter's USDT probes
    (samples 0, generation known)."""
    v = ctx.view
    return [(int(ts), int(dur), int(n), int(g)) for ts, dur, n, g in v.conn.execute(
        "SELECT ts_ns, dur_ns, a0, a1 FROM event_data WHERE op = ? AND tid = ? AND ts_ns >= ? "
        "AND ts_ns < ? AND id BETWEEN ? AND ? ORDER BY ts_ns",
        (GC_PAUSE, tid, v.win.start_ns, v.win.end_ns, v.node.lo, v.node.hi))]


def _gc_chain(ctx: Context, ts: ThreadSamples) -> Chain | None:
    gc_ns = ts.gc * ts.period_ns
    share = min(1.0, gc_ns / ctx.span_ns)
    if ts.gc < MIN_GC_SAMPLES or share < MIN_GC_SHARE:
        return None
    pauses = _pauses(ctx, ts.tid)
    longest = max((d for _, d, _, _ in pauses), default=ts.period_ns)
    gens = Counter(g for _, _, n, g in pauses if n == 0 and g >= 0)
    exact = any(n == 0 for _, _, n, _ in pauses)
    host = ts.gc + sum(s.samples for s in ts.host)
    triggers = _gc_triggers(ts.stacks)
    hz = round(1e9 / ts.period_ns)
    detail: ChainDetail = {
        "pauses": len(pauses), "longest_ns": longest, "gc_ns": gc_ns,
        "gc_share": round(share, 4), "gc_samples": ts.gc, "samples": ts.total,
        "period_ns": ts.period_ns, "generation": max(gens) if gens else None,
        "by_generation": {str(g): n for g, n in sorted(gens.items())},
        "measured": "usdt" if exact else "samples",
        "running_share": round(ctx.share(ts.tid, "running"), 4),
        "triggers": triggers, "share_from": "on_cpu_samples"}
    how = (" (measured by the interpreter's gc__start/gc__done probes; generations "
           + ", ".join(f"{g}: {n}" for g, n in sorted(gens.items())) + ")") if exact else ""
    evidence: list[EvidenceItem] = [{"kind": "gc_pause", "text":
                 f"{len(pauses)} pause(s) in the garbage collector between CUDA calls, "
                 f"longest {longest / 1e6:.0f} ms{how}; {ts.gc} of the thread's {ts.total} "
                 f"on-CPU samples at {hz} Hz were in the collector: about "
                 f"{gc_ns / 1e6:.0f} ms, {share:.1%} of the window",
                 "pauses": [{"ts_ns": t, "dur_ns": d, "samples": n, "generation": g}
                            for t, d, n, g in pauses[:20]]}]
    if triggers:
        evidence.append({"kind": "cpu_profile", "text": "collections started from "
                         + ", ".join(f"{t['frame']} ({t['samples']} samples)"
                                     for t in triggers[:3])})
    # Of the thread's time on the CPU outside CUDA, the share the collector took.
    return rule_chain(ctx, "gc_pause", ts.pid, None, ts.gc / max(1, host), share, evidence,
                      detail, tid=ts.tid)


def _gc_triggers(stacks: list[StackCount]) -> list[GcTrigger]:
    """The Python lines that were running when the collector started (the allocation
    that crossed a threshold), by GC samples."""
    by: Counter[str] = Counter()
    for s in stacks:
        if s.gc and s.frames and s.frames[0] == GC_FRAME:
            by[top_python_frame(list(s.frames[1:])) or short_frame(s.frames[-1])] += s.gc
    return [{"frame": f, "samples": n} for f, n in by.most_common(5)]


# ---- host_cpu_bound ---------------------------------------------------------------------


def _cpu_bound_chain(ctx: Context, ts: ThreadSamples) -> Chain | None:
    host = ts.host
    host_samples = sum(s.samples for s in host)
    t = ctx.main_thread(ts.pid)
    host_ns = _host_ns(ts, host_samples, t)
    share = min(1.0, host_ns / ctx.span_ns)
    wall = max(1, (t["wall_ns"] if t else 0) or ctx.span_ns)
    gpu_wait = min(1.0, ((t["in_cuda_ns"] + t["gpu_sync_ns"]) if t else 0) / wall)
    # Of the time it could run: the run-queue time is another chain's (cpu_contention,
    # cpu_throttled), and a thread CPU-bound on a crowded machine still is CPU-bound.
    runnable = max(1, wall - ((t["runq_ns"] + t["irq_ns"]) if t else 0))
    of_runnable = min(1.0, host_ns / runnable)
    if ts.total < MIN_SAMPLES or of_runnable < MIN_HOST_SHARE or gpu_wait > MAX_GPU_WAIT_SHARE:
        return None
    top = _top_frames(host, ts.total)
    hz = round(1e9 / ts.period_ns)
    detail: ChainDetail = {
        "host_share": round(share, 4), "host_share_of_runnable": round(of_runnable, 4),
        "host_ns": host_ns, "host_samples": host_samples,
        "samples": ts.total, "gc_samples": ts.gc,
        "cuda_samples": sum(s.samples for s in ts.stacks if s.in_cuda),
        "gpu_wait_share": round(gpu_wait, 4), "period_ns": ts.period_ns,
        "running_share": round(ctx.share(ts.tid, "running"), 4),
        "top_frames": top, "share_from": "on_cpu_samples",
        "flame": flame_stacks(ts.stacks)}
    lines = "; ".join(f"{f['frame']} {f['share']:.0%}" for f in top[:3])
    evidence: list[EvidenceItem] = [{"kind": "cpu_profile", "text":
                 f"{host_samples} of the thread's {ts.total} on-CPU samples at {hz} Hz were "
                 f"outside CUDA calls and the collector ({share:.1%} of the window on the "
                 f"CPU; {gpu_wait:.1%} in CUDA calls or waiting for the GPU); top frames: "
                 f"{lines}", "top_frames": top}]
    # Where a GPU timeline was imported: what it ran while the GPU sat idle.
    idle = during_idle(ctx.view.conn, ctx.view.node, ctx.view.win, ts.pid, ts.tid)
    if idle is not None:
        detail["gpu_idle"] = idle
        evidence.append({"kind": "gpu_idle_frames", "text": idle.pop("text"),
                         "top_frames": idle["top_frames"]})
    return rule_chain(ctx, "host_cpu_bound", ts.pid, None, host_samples / max(1, ts.total),
                      share, evidence, detail, tid=ts.tid)


def _host_ns(ts: ThreadSamples, host_samples: int, t: ThreadRow | None) -> int:
    """The thread's time on the CPU outside CUDA calls: a period per sample, at most
    the samples' share of the time its scheduler records say it ran. The records are
    exact where it has them (each switch out and back in); a sample count is an
    estimate that has read 2.6 times the recorded time (117 samples at 49 Hz, 2.4 s,
    for a thread that ran 0.9 s of 4.2: accuracy's first_alloc under busy-node.sh, in 2
    of 5 runs, cause not found), which made a HIGH host_cpu_bound of a quiet loop."""
    host_ns = host_samples * ts.period_ns
    if t is not None and t["switches"]:
        host_ns = min(host_ns, int(t["running_ns"]) * host_samples // max(1, ts.total))
    return host_ns


def _top_frames(host: list[StackCount], total: int) -> list[TopFrame]:
    """Where the host samples were, by function: the innermost Python frame of each
    sample (the user's code; a native frame above it is a call that code made), else
    the innermost frame. Each function is shown at its hottest line."""
    return rank_frames([(s, s.samples) for s in host], max(1, total))
