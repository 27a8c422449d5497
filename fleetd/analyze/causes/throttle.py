"""``cpu_throttled``: the feeding thread kept off the CPU by its cgroup's CPU quota.

A Kubernetes CPU limit is a CFS quota: once the cgroup has used ``quota`` of a
``period`` the kernel takes all its threads off the CPU, runnable, until the next
period, whether or not the CPU has other work. Whatever runs in that time (the idle
task, a kernel thread, any other process) took nothing from the victim, so it is never
named a culprit: the chain names the cgroup, its quota and period, and how much of the
window it was throttled, from the cgroup's own accounting (the tracer's
``cpu_throttle`` samples of ``cpu.stat``). A busy neighbour *inside* the same quota does
take from it: it stays a ``cpu_contention`` culprit beside this chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetd.analyze.causes.chains import Chain, severity
from fleetd.analyze.causes.rules import Context, rule_chain
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.cgroup_samples import place_of, sampled_pids, samples
from fleetd.store.catalog import op_code

CPU_THROTTLE = op_code("cpu_throttle")
MIN_THROTTLED_SHARE = 0.01  # of the window: below this a quota is not what slows it


@dataclass(slots=True)
class Quota:
    """One limited cgroup over the window, summed from its samples."""

    cgroup: str
    quota_us: int
    period_us: int
    throttled_ns: int = 0
    throttled_periods: int = 0
    periods: int = 0
    members: set[int] = field(default_factory=set)
    place: dict[str, Any] = field(default_factory=dict)  # container, pod, namespace

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


def quotas(ctx: Context) -> list[Quota]:
    """The limited cgroups the traced processes ran in, over the window."""
    found: dict[str, Quota] = {}
    for (pid, throttled, t_periods, periods), a in samples(
            ctx.view, CPU_THROTTLE, ("pid", "bytes", "a0", "a1")):
        path, quota, period = a.get("cgroup"), a.get("quota_us"), a.get("period_us")
        if not isinstance(path, str) or not isinstance(quota, int) or \
                not isinstance(period, int) or quota <= 0 or period <= 0:
            continue
        q = found.setdefault(path, Quota(path, quota, period))
        q.throttled_ns += max(0, int(throttled or 0))
        q.throttled_periods += max(0, int(t_periods or 0))
        q.periods += max(0, int(periods or 0))
        q.members.update(sampled_pids(pid, a))
        q.place = place_of(a)
    return list(found.values())


def throttle_rule(ctx: Context, chains: list[Chain]) -> list[Chain]:
    """A ``cpu_throttled`` chain per feeding thread of a throttled cgroup. Runs after
    the shares are accounted (they are split, never stated twice).

    A busy neighbour *inside* the quota is the cause: alone the thread would fit, and the
    quota runs out because the neighbour spends it. Its ``cpu_contention`` chain then
    stays the chain, with the quota named in its evidence and detail. Otherwise the
    quota is the cause: the thread's run-queue column goes to ``cpu_throttled`` up to the
    throttled time, whoever ran meanwhile is no culprit, and the contention chain keeps
    only the time beyond the throttling (or goes when there is none worth a chain)."""
    out: list[Chain] = []
    for q in quotas(ctx):
        share = q.throttled_ns / ctx.span_ns
        if share < MIN_THROTTLED_SHARE:
            continue
        for pid in ctx.gpu_pids():
            if pid not in q.members:
                continue
            quota = _chain(ctx, q, pid, share)
            if not _neighbour_spends_it(chains, quota, q):
                out.append(quota)
    chains[:] = [c for c in chains if not c.detail.get("throttled_away")]
    return out


def _chain(ctx: Context, q: Quota, pid: int, throttled_share: float) -> Chain:
    t = ctx.main_thread(pid)
    tid = int(t["tid"]) if t else pid
    runq = ctx.share(tid, "runq")
    # The quota explains the thread's run-queue time up to the time it was throttled.
    explained = min(1.0, throttled_share / runq) if runq > 0 else 0.0
    impact = min(runq, throttled_share) if runq > 0 else throttled_share
    periods = q.throttled_periods / q.periods if q.periods else 0.0
    detail = {"cgroup": q.cgroup, "quota_us": q.quota_us, "period_us": q.period_us,
              "cpus": round(q.cpus, 3), "throttled_ns": q.throttled_ns,
              "throttled_share": round(throttled_share, 4),
              "throttled_periods": q.throttled_periods, "periods": q.periods,
              "throttled_period_share": round(periods, 4),
              "members": sorted(q.members)[:16], **q.place, "share_of": "runq"}
    evidence = [{"kind": "cgroup_quota", "text":
                 f"cgroup {q.cgroup}{pods.where(q.place)}: quota {q.quota_us} us per "
                 f"{q.period_us} us "
                 f"({q.cpus:g} CPU); throttled in {q.throttled_periods} of {q.periods} "
                 f"periods ({periods:.0%}), {q.throttled_ns / 1e6:.1f} ms in all "
                 f"({throttled_share:.1%} of the window)"}]
    return rule_chain(ctx, "cpu_throttled", pid, None, explained, impact, evidence, detail,
                      tid=tid)


def _neighbour_spends_it(chains: list[Chain], quota: Chain, q: Quota) -> bool:
    """True when a contention chain of the thread names a task inside the quota (it
    then carries the quota's figures); else those chains lose the throttled time."""
    pid, tid = int(quota.victim["pid"]), int(quota.victim["tid"])
    mine = [ch for ch in chains
            if ch.root_cause == "cpu_contention" and int(ch.victim.get("tid") or 0) == tid]
    for ch in mine:
        inside = [c for c in ch.culprits if int(c.get("pid") or -1) in q.members
                  and int(c.get("pid") or -1) != pid]
        if inside:
            ch.culprits = inside
            ch.extra_evidence = [*quota.extra_evidence, *ch.extra_evidence]
            ch.detail["quota"] = {k: quota.detail[k] for k in (
                "cgroup", "quota_us", "period_us", "cpus", "throttled_share",
                "throttled_period_share")}
            return True
    for ch in mine:
        rest = max(0.0, ch.impact - quota.impact)
        if rest < MIN_THROTTLED_SHARE:
            ch.detail["throttled_away"] = True
            continue
        ch.detail.update(quota_share=round(quota.impact, 6), share=round(rest, 6))
        ch.impact = round(rest, 6)
        ch.severity = severity(ch.explained, ch.impact)
    return False
