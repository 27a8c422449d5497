"""``cpu_throttled``: the feeding thread kept off the CPU by its cgroup's CPU quota.

A Kubernetes CPU limit is a CFS quota: once the cgroup has used ``quota`` of a
``period`` the kernel takes all its threads off the CPU, runnable, until the next
period, whether or not the CPU has other work. Whatever runs in that time (the idle
task, a kernel thread, any other process) took nothing from the victim, so it is never
named a culprit: the chain names the cgroup, its quota and period, and how much of the
window it was throttled, from the cgroup's own accounting (the tracer's
``cpu_throttle`` samples of ``cpu.stat``). A busy neighbour *inside* the same quota does
take from it: it stays a ``cpu_contention`` culprit beside this chain.

The quota is tied to the thread's run-queue time where the two happened together: per
sample interval (about a second), the thread's run-queue time in it up to the cgroup's
throttled time in it. A window that holds both a throttled stretch and a crowded one (a
quota set in the middle of it; a busy CPU before) splits the column between the two
causes by when each held the thread, not by their totals over the whole window.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from fleetd.analyze.causes.chains import Chain, severity
from fleetd.analyze.causes.rules import Context, rule_chain, with_place
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers_chain import (
    ChainDetail,
    EvidenceItem,
    QuotaFigures,
    RankedCulprit,
)
from fleetd.analyze.reading.cgroup_samples import place_of, sampled_pids, samples
from fleetd.analyze.reading.nodeview import OFF_CPU, RUNQ, overlap, task_state
from fleetd.analyze.reading.rows import CgroupPlace
from fleetd.store.catalog import op_code

CPU_THROTTLE = op_code("cpu_throttle")
MIN_THROTTLED_SHARE = 0.01  # of the window: below this a quota is not what slows it
INSIDE_SHARE = 0.1  # of the contention's taker time: neighbours inside the quota that spend it
# A thread that ran more CPU per second than the quota allows (by this much, in at least
# RAN_PAST_SLICES one-second slices of the window or the half minute before it) while
# the cgroup's samples show a higher limit or none: the quota was lowered below what the
# thread needs alone, so it is the cause whoever else spends it. The thread's CPU time is
# inferred (the slice less its recorded off-CPU time: sleeps under the tracer's 50 us
# threshold and records lost on a loaded node count as CPU), so a slice counts only
# where the cgroup's own samples say the limit was higher: under an unchanged quota no
# slice can, however the inference errs.
RAN_PAST = 1.5
RAN_PAST_SLICES = 2
RAN_PAST_LOOKBACK_NS = 30 * 10**9
SLICE_NS = 10**9
# A cgroup the sampler (about once a second) first saw limited this long after the
# thread's first record had no limit before: the slices before its first sample count
# as unlimited. Nearer the start of the trace the sampler may not have looked yet.
UNSAMPLED_GRACE_NS = 3 * 10**9
SAMPLE_REACH_NS = 5 * 10**9  # a sample that began this long before the window may end in it
MAX_WAIT_NS = 10**9  # a run-queue wait that began this long before a span still counts in it


@dataclass(slots=True)
class Quota:
    """One limited cgroup over the window, summed from its samples. ``quota_us`` and
    ``period_us`` are those of the samples with the most throttled time (a quota changed
    in the window is named as it was while it throttled); ``spans`` are the samples'
    intervals with the throttled time in each, oldest first."""

    cgroup: str
    quota_us: int
    period_us: int
    throttled_ns: int = 0
    throttled_periods: int = 0
    periods: int = 0
    members: set[int] = field(default_factory=set)
    place: CgroupPlace = field(default_factory=lambda: CgroupPlace())  # container, pod, ...
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, ns)
    by_limit: dict[tuple[int, int], int] = field(default_factory=dict)  # -> throttled ns

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


def quotas(ctx: Context) -> list[Quota]:
    """The limited cgroups the traced processes ran in, over the window: each sample's
    figures clipped to the part of its interval inside the window (spread evenly), so a
    short window starting mid-interval counts what fell inside it."""
    found: dict[str, Quota] = {}
    w0, w1 = ctx.view.win.start_ns, ctx.view.win.end_ns
    for (pid, throttled, t_periods, periods, ts, dur), a in samples(
            ctx.view, CPU_THROTTLE, ("pid", "bytes", "a0", "a1", "ts_ns", "dur_ns"),
            by_time=True, reach_ns=SAMPLE_REACH_NS):
        limit = _limit_of(a)
        if limit is None:
            continue
        path, quota, period = limit
        q = found.setdefault(path, Quota(path, quota, period))
        t0, t1 = int(ts), int(ts) + max(0, int(dur or 0))
        s0, s1 = max(t0, w0), min(t1, w1)
        part = (s1 - s0) / (t1 - t0) if t1 > t0 else 1.0
        ns = round(max(0, int(throttled or 0)) * part)
        q.throttled_ns += ns
        q.throttled_periods += round(max(0, int(t_periods or 0)) * part)
        q.periods += round(max(0, int(periods or 0)) * part)
        q.members.update(sampled_pids(pid, a))
        q.place = place_of(a)
        q.spans.append((s0, s1, ns))
        q.by_limit[(quota, period)] = q.by_limit.get((quota, period), 0) + ns
    for q in found.values():
        # Most throttled time first; a tie goes to the later limit (dicts keep order).
        q.quota_us, q.period_us = max(reversed(q.by_limit.items()), key=lambda kv: kv[1])[0]
    return list(found.values())


def _limit_of(args: dict[str, object]) -> tuple[str, int, int] | None:
    """A ``cpu_throttle`` sample's (cgroup, quota_us, period_us); None when its args (a
    merged or imported file's, untrusted) do not hold a usable limit."""
    path, quota, period = args.get("cgroup"), args.get("quota_us"), args.get("period_us")
    if not isinstance(path, str) or not isinstance(quota, int) or \
            not isinstance(period, int) or quota <= 0 or period <= 0:
        return None
    return path, quota, period


def throttle_rule(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """A ``cpu_throttled`` chain per feeding thread of a throttled cgroup. Runs after
    the shares are accounted (they are split, never stated twice).

    A busy neighbour *inside* the quota is the cause: alone the thread would fit, and the
    quota runs out because the neighbour spends it. Its ``cpu_contention`` chain then
    stays the chain, with the quota named in its evidence and detail. Otherwise the
    quota is the cause: the thread's run-queue column goes to ``cpu_throttled`` up to the
    throttled time, whoever ran meanwhile is no culprit, and the contention chain keeps
    only the time beyond the throttling (or goes when there is none worth a chain).

    A thread under two limited cgroups (its own and one above it: a container's and its
    pod's, a slice's) gets one chain, from the quota that held it off the CPU the
    longest; the other's figures are added to its evidence."""
    out: list[Chain] = []
    found = [q for q in quotas(ctx) if q.throttled_ns / ctx.span_ns >= MIN_THROTTLED_SHARE]
    for pid in ctx.gpu_pids():
        made = [(_chain(ctx, q, pid, q.throttled_ns / ctx.span_ns), q)
                for q in found if pid in q.members]
        if not made:
            continue
        quota, q = max(made, key=lambda cq: (cq[0].impact, cq[1].throttled_ns))
        quota.extra_evidence += [e for c, _ in made if c is not quota
                                 for e in c.extra_evidence]
        if not _neighbour_spends_it(ctx, chains, quota, q):
            out.append(quota)
    chains[:] = [c for c in chains if not c.detail.get("throttled_away")]
    return out


def _chain(ctx: Context, q: Quota, pid: int, throttled_share: float) -> Chain:
    t = ctx.main_thread(pid)
    tid = int(t["tid"]) if t else pid
    runq = ctx.share(tid, "runq")
    held, queued = held_by_quota(ctx, tid, q)
    if runq > 0:
        # The quota's part of the run-queue column: the thread's queued time while the
        # cgroup was throttled, up to that throttled time; ``explained``, how much of
        # its queued time in the throttled intervals the quota accounts for.
        impact = min(runq, held / ctx.span_ns)
        explained = held / queued if queued else 0.0
    else:  # no run-queue records for the thread: the cgroup's figure alone, unexplained
        impact, explained = throttled_share, 0.0
    periods = q.throttled_periods / q.periods if q.periods else 0.0
    detail: ChainDetail = {
        "cgroup": q.cgroup, "quota_us": q.quota_us, "period_us": q.period_us,
        "cpus": round(q.cpus, 3), "throttled_ns": q.throttled_ns,
        "throttled_share": round(throttled_share, 4),
        "throttled_periods": q.throttled_periods, "periods": q.periods,
        "throttled_period_share": round(periods, 4), "members": sorted(q.members)[:16]}
    with_place(detail, q.place)
    detail["share_of"] = "runq"
    evidence: list[EvidenceItem] = [{"kind": "cgroup_quota", "text":
                 f"cgroup {q.cgroup}{pods.where(q.place)}: quota {q.quota_us} us per "
                 f"{q.period_us} us "
                 f"({q.cpus:g} CPU); throttled in {q.throttled_periods} of {q.periods} "
                 f"periods ({periods:.0%}), {q.throttled_ns / 1e6:.1f} ms in all "
                 f"({throttled_share:.1%} of the window)"}]
    return rule_chain(ctx, "cpu_throttled", pid, None, round(explained, 4), round(impact, 6),
                      evidence, detail, tid=tid)


def held_by_quota(ctx: Context, tid: int, q: Quota) -> tuple[int, int]:
    """(ns the quota held thread ``tid`` off the CPU, ns it was queued in the intervals
    the cgroup was throttled in): :func:`held_spans` summed."""
    spans = held_spans(ctx, tid, q)
    return sum(h for _, _, h, _ in spans), sum(n for _, _, _, n in spans)


def held_spans(ctx: Context, tid: int, q: Quota) -> list[tuple[int, int, int, int]]:
    """(start, end, held, queued) per sample interval the cgroup was throttled in: the
    thread's queued time there, and of it the part the quota held it off the CPU (up to
    the cgroup's throttled time there; a thread waits in one throttled run queue at a
    time, so no more than the interval either). Read once per thread and cgroup."""
    key = (f"quota_spans {q.cgroup}", tid)
    if key not in ctx.memo:
        spans = [sp for sp in q.spans if sp[2] > 0 and sp[1] > sp[0]]
        queued = _queued_per_span(ctx, tid, spans) if spans else []
        ctx.memo[key] = [(a, b, min(n, ns, b - a), n)
                         for (a, b, ns), n in zip(spans, queued, strict=True)]
    return list(ctx.memo[key])


def _queued_per_span(ctx: Context, tid: int, spans: list[tuple[int, int, int]]) -> list[int]:
    """The thread's run-queue time in each span: its run-queue records there (the tail
    after a wakeup, a preemption), or its preempted off-CPU time there when that is more
    (a run-queue record under the tracer's threshold), as the breakdown counts it."""
    starts = [a for a, _, _ in spans]
    runq, off_r = [0] * len(spans), [0] * len(spans)
    v = ctx.view
    for op, ts, dur, a0 in v.conn.execute(
            "SELECT op, ts_ns, dur_ns, a0 FROM event_data WHERE ts_ns >= ? AND ts_ns < ? "
            "AND id BETWEEN ? AND ? AND tid = ? AND op IN (?, ?)",
            (spans[0][0] - MAX_WAIT_NS, spans[-1][1], v.node.lo, v.node.hi, tid, OFF_CPU, RUNQ)):
        if op == OFF_CPU and task_state(int(a0 or 0)) != "R":
            continue
        into = runq if op == RUNQ else off_r
        t0, t1 = int(ts), int(ts) + int(dur or 0)
        i = max(0, bisect.bisect_right(starts, t0) - 1)
        while i < len(spans) and spans[i][0] < t1:
            into[i] += max(0, min(t1, spans[i][1]) - max(t0, spans[i][0]))
            i += 1
    return [max(r, o) for r, o in zip(runq, off_r, strict=True)]


def _neighbour_spends_it(ctx: Context, chains: list[Chain], quota: Chain, q: Quota) -> bool:
    """True when a contention chain of the thread names tasks inside the quota that held
    the CPU for a good part of its wait (they spend it; the chain then carries the
    quota's figures); else those chains lose the throttled time, and their culprits are
    those that took the CPU outside it."""
    pid, tid = int(quota.victim["pid"]), int(quota.victim["tid"])
    mine = [ch for ch in chains
            if ch.root_cause == "cpu_contention" and int(ch.victim.get("tid") or 0) == tid]
    for ch in mine:
        inside = [c for c in ch.culprits if int(c.get("pid") or -1) in q.members
                  and int(c.get("pid") or -1) != pid]
        # They spend the quota when they held the CPU for a good part of the thread's
        # wait (a tenth of the time others held it); a member that barely ran (a
        # data loader's worker process, a sidecar) is no reason the quota binds. Nor is
        # any member when the thread alone ran past the quota before it was lowered.
        if inside and sum(float(c.get("share") or 0.0) for c in inside) >= INSIDE_SHARE \
                and not ran_past_quota(ctx, tid, q):
            ch.culprits = inside
            ch.extra_evidence = [*quota.extra_evidence, *ch.extra_evidence]
            d = quota.detail
            ch.detail["quota"] = QuotaFigures(
                cgroup=d.get("cgroup", q.cgroup), quota_us=d.get("quota_us", q.quota_us),
                period_us=d.get("period_us", q.period_us), cpus=d.get("cpus", q.cpus),
                throttled_share=d.get("throttled_share", 0.0),
                throttled_period_share=d.get("throttled_period_share", 0.0))
            return True
    for ch in mine:
        rest = max(0.0, ch.impact - quota.impact)
        if rest < MIN_THROTTLED_SHARE:
            ch.detail["throttled_away"] = True
            continue
        ch.detail["quota_share"] = round(quota.impact, 6)
        ch.detail["share"] = round(rest, 6)
        ch.impact = round(rest, 6)
        ch.severity = severity(ch.explained, ch.impact)
        _culprits_outside(ctx, ch, tid, held_spans(ctx, tid, q))
    return False


def ran_past_quota(ctx: Context, tid: int, q: Quota) -> bool:
    """True when thread ``tid`` alone ran more than RAN_PAST times the quota's CPUs in at
    least RAN_PAST_SLICES one-second slices of the window or the half minute before it,
    in slices where the cgroup had a higher limit or none: the quota was lowered (or set)
    below what the thread itself runs (a limit cut on a live job), so it would not fit
    alone whatever its neighbours inside spend. Its CPU time in a slice is the slice less
    its off-CPU records there, counted only between its first and last record (before or
    after them the tracer did not see it)."""
    key = (f"ran_past {q.cgroup} {q.quota_us}/{q.period_us}", tid)
    if key not in ctx.memo:
        ctx.memo[key] = _slices_past(ctx, tid, q) >= RAN_PAST_SLICES
    return bool(ctx.memo[key])


def _slices_past(ctx: Context, tid: int, q: Quota) -> int:
    """How many whole one-second slices, between the thread's first and last off-CPU
    record in the window and the lookback before it, it ran more than RAN_PAST times
    the quota's CPUs of under a higher limit (:func:`_limit_then`)."""
    v = ctx.view
    lo, hi = v.win.start_ns - RAN_PAST_LOOKBACK_NS, v.win.end_ns
    off = [(e.ts, e.end) for e in v.host_events(tid, lo - MAX_WAIT_NS, hi) if e.op == OFF_CPU]
    if not off:
        return 0
    first, last = max(lo, off[0][0]), min(hi, max(b for _, b in off))
    slices = max(0, (last - first) // SLICE_NS)
    away = [0] * slices
    for a, b in off:
        i = max(0, (a - first) // SLICE_NS)
        while i < slices and first + i * SLICE_NS < b:
            s0 = first + i * SLICE_NS
            away[i] += overlap(a, b, s0, s0 + SLICE_NS)
            i += 1
    limits = _limits(ctx, q, first, last)
    past = RAN_PAST * q.cpus * SLICE_NS
    return sum(1 for i, ns in enumerate(away) if SLICE_NS - ns > past and _limit_then(
        limits, first + i * SLICE_NS, first + (i + 1) * SLICE_NS, first) > q.cpus)


def _limits(ctx: Context, q: Quota, t0: int, t1: int) -> list[tuple[int, int, float]]:
    """(start, end, CPUs) of each sample of ``q``'s cgroup over [t0, t1), oldest first:
    the limit each sample read at its end."""
    out: list[tuple[int, int, float]] = []
    for (ts, dur), a in samples(ctx.view.over(t0, t1), CPU_THROTTLE, ("ts_ns", "dur_ns"),
                                by_time=True, reach_ns=SAMPLE_REACH_NS):
        limit = _limit_of(a)
        if limit is not None and limit[0] == q.cgroup:
            out.append((int(ts), int(ts) + max(0, int(dur or 0)), limit[1] / limit[2]))
    return out


def _limit_then(limits: list[tuple[int, int, float]], s0: int, s1: int, first: int
                ) -> float:
    """The highest limit (CPUs) the samples overlapping [s0, s1) read; infinite (no
    limit) for a slice wholly before the cgroup's first sample that began
    UNSAMPLED_GRACE_NS after the thread's first record ``first``; 0 when unknown."""
    seen = [cpus for a, b, cpus in limits if a < s1 and b > s0]
    if seen:
        return max(seen)
    if s0 >= first + UNSAMPLED_GRACE_NS and (not limits or s1 <= limits[0][0]):
        return float("inf")
    return 0.0


def _culprits_outside(ctx: Context, ch: Chain, tid: int,
                      spans: list[tuple[int, int, int, int]]) -> None:
    """The contention chain's culprits, measured again outside the intervals the quota
    held the thread for most of its queued time: whoever ran while the cgroup was
    throttled took nothing from it. A culprit that held the CPU only then is dropped;
    when the thread was throttled throughout, the culprits stay (the time beyond the
    throttling cannot be told apart from it)."""
    takers: Counter[int] = Counter()
    v = ctx.view
    for a, b in _unthrottled(v.win.start_ns, v.win.end_ns, spans):
        takers.update(v.over(a, b).cpu_takers(tid))
    if not takers:
        return
    kept: list[RankedCulprit] = []
    for c in ch.culprits:
        tids = c.get("tids") or [t for t in (c.get("tid"),) if t is not None]
        ns = sum(takers.get(int(t), 0) for t in tids)
        if ns > 0:
            k = c.copy()
            k["ns"] = ns
            kept.append(k)
    total = sum(takers.values())
    for c in kept:
        c["share"] = round(c.get("ns", 0) / max(1, total), 3)
    ch.culprits = sorted(kept, key=lambda c: -(c["share"] + c.get("presence", 0.0)))


def _unthrottled(w0: int, w1: int, spans: list[tuple[int, int, int, int]]
                 ) -> list[tuple[int, int]]:
    """[w0, w1) less the intervals where the quota held the thread for at least half of
    its queued time there."""
    out, at = [], w0
    for a, b, held, queued in spans:
        if queued and held * 2 >= queued:
            if a > at:
                out.append((at, a))
            at = max(at, b)
    if w1 > at:
        out.append((at, w1))
    return out
