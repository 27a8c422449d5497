"""``memory_reclaim``: the feeding thread stalled reclaiming memory for its own pages.

At a cgroup's memory limit (a Kubernetes memory limit) every page the process charges
is paid for first: the kernel reclaims from the cgroup in the allocating thread, on its
time, before the allocation returns (memcg reclaim); a machine short of free memory
does the same for everyone (direct reclaim), and a high-order allocation may compact
memory first (direct compaction). The tracer measures each stall from the kernel's
vmscan/compaction tracepoints (``memcg_reclaim``, ``direct_reclaim`` and
``direct_compaction`` runs, the breakdown's ``reclaim`` column) and samples the
cgroup's limit, usage and pressure stall time (``mem_cgroup``).

The chain's share is the thread's ``reclaim`` column: time it spent reclaiming. No
process is named a culprit: whoever else fills the cgroup or the machine, the thread
stalled in its own allocations, and the limit (or the machine's memory) is the cause.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fleetd.analyze.causes import causes
from fleetd.analyze.causes.chains import Chain, severity
from fleetd.analyze.causes.oncpu import MIN_HOST_SHARE
from fleetd.analyze.causes.rules import Context, rule_chain, with_place
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers_chain import ChainDetail, EvidenceItem
from fleetd.analyze.reading.cgroup_samples import place_of, sampled_pids, samples
from fleetd.analyze.reading.data import args_object, in_list
from fleetd.analyze.reading.rows import CgroupPlace
from fleetd.store.catalog import op_code

# The stall runs by op, and what each is called in a chain's words.
KINDS = {op_code("direct_reclaim"): "direct reclaim", op_code("memcg_reclaim"): "memcg reclaim",
         op_code("direct_compaction"): "direct compaction"}
MEM_CGROUP = op_code("mem_cgroup")
KWORK = op_code("kwork_queued")
KWORKER = "kworker/"  # the kernel's workqueue threads, by name
MIN_SHARE = 0.01  # of the thread's wall time: below this reclaim is not what slows it


@dataclass(slots=True)
class Stalls:
    """One thread's reclaim and compaction stalls over the window."""

    stall_ns: int = 0
    stalls: int = 0
    pages: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # ns


@dataclass(slots=True)
class Limit:
    """A memory-limited cgroup over the window, from its samples."""

    cgroup: str
    limit: int
    usage: int = 0  # the highest sampled
    peak: int = 0
    limit_hits: int = 0
    file: int | None = None  # at the last sample: on the file LRU (reclaimable)
    anon: int | None = None
    psi_some_us: int | None = None  # summed over the samples (None: no PSI)
    psi_system_us: int | None = None
    sampled_ns: int = 0
    members: set[int] = field(default_factory=set)
    place: CgroupPlace = field(default_factory=lambda: CgroupPlace())  # place_of


def thread_stalls(ctx: Context, tid: int) -> Stalls:
    v = ctx.view
    out = Stalls()
    for op, stalled, n, pages in v.conn.execute(
            "SELECT op, sum(bytes), sum(a0), sum(a1) FROM event_data WHERE op IN "
            f"{in_list(KINDS)} AND tid = ? AND ts_ns >= ? AND ts_ns < ? "
            "AND id BETWEEN ? AND ? GROUP BY op",
            (tid, v.win.start_ns, v.win.end_ns, v.node.lo, v.node.hi)):
        name = KINDS[int(op)]
        out.stall_ns += int(stalled or 0)
        out.stalls += int(n or 0)
        out.pages += int(pages or 0)
        out.by_kind[name] += int(stalled or 0)
    return out


def limits(ctx: Context) -> list[Limit]:
    """The memory-limited cgroups the traced processes ran in, over the window."""
    found: dict[str, Limit] = {}
    # Oldest first: the latest sample sets the limit, its file and anon sizes and place.
    for (pid, dur, usage, limit), a in samples(
            ctx.view, MEM_CGROUP, ("pid", "dur_ns", "bytes", "a0"), by_time=True):
        path = a.get("cgroup")
        if not isinstance(path, str) or not isinstance(limit, int) or limit <= 0:
            continue
        q = found.setdefault(path, Limit(path, limit))
        q.limit = limit
        q.usage = max(q.usage, int(usage or 0))
        q.sampled_ns += int(dur or 0)
        q.members.update(sampled_pids(pid, a))
        peak, hits = a.get("peak_bytes"), a.get("limit_hits")
        if isinstance(peak, int):
            q.peak = max(q.peak, peak)
        q.limit_hits += int(hits) if isinstance(hits, int) else 0
        file_bytes, anon_bytes = a.get("file_bytes"), a.get("anon_bytes")
        q.file = file_bytes if isinstance(file_bytes, int) else q.file
        q.anon = anon_bytes if isinstance(anon_bytes, int) else q.anon
        q.psi_some_us = _add(q.psi_some_us, a.get("psi_some_us"))
        q.psi_system_us = _add(q.psi_system_us, a.get("psi_system_some_us"))
        q.place = place_of(a)
    return list(found.values())


def _add(total: int | None, value: object) -> int | None:
    if not isinstance(value, int):
        return total
    return (total or 0) + value


def memory_rule(ctx: Context) -> list[Chain]:
    """A ``memory_reclaim`` chain per GPU process whose feeding thread spent at least
    MIN_SHARE of its wall time in reclaim or compaction (the breakdown's ``reclaim``
    column, which is what the chain states)."""
    found = limits(ctx)
    out: list[Chain] = []
    for pid in ctx.gpu_pids():
        t = ctx.main_thread(pid)
        if t is None:
            continue
        tid = int(t["tid"])
        share = ctx.share(tid, "reclaim")
        if share < MIN_SHARE:
            continue
        stalls = thread_stalls(ctx, tid)
        limit = next((q for q in found if pid in q.members), None)
        out.append(_chain(ctx, pid, tid, share, stalls, limit))
    return out


def _chain(ctx: Context, pid: int, tid: int, share: float, s: Stalls,
           q: Limit | None) -> Chain:
    kinds = ", ".join(f"{k} {ns / 1e6:.1f} ms" for k, ns in
                      sorted(s.by_kind.items(), key=lambda kv: -kv[1]))
    avg = s.stall_ns / s.stalls if s.stalls else 0
    evidence: list[EvidenceItem] = [{
        "kind": "reclaim_stalls", "tid": tid, "stalls": s.stalls, "stall_ns": s.stall_ns,
        "pages": s.pages, "text":
            f"{s.stalls} reclaim/compaction stall(s) in thread {tid}, {s.stall_ns / 1e6:.1f} "
            f"ms in all ({share:.1%} of its wall time; {kinds}), {avg / 1e3:.0f} us each on "
            f"average, {s.pages} pages reclaimed"}]
    detail: ChainDetail = {
        "stall_ns": s.stall_ns, "stalls": s.stalls, "pages": s.pages,
        "by_kind": dict(s.by_kind), "share_of": "reclaim"}
    if q is not None:
        evidence.append({"kind": "cgroup_memory", "text": _limit_text(q)})
        detail["cgroup"], detail["limit_bytes"], detail["usage_bytes"] = (
            q.cgroup, q.limit, q.usage)
        detail["peak_bytes"], detail["limit_hits"] = q.peak, q.limit_hits
        detail["file_bytes"], detail["anon_bytes"] = q.file, q.anon
        with_place(detail, q.place)
        if q.psi_some_us is not None and q.sampled_ns:
            detail["psi_some_share"] = round(q.psi_some_us * 1000 / q.sampled_ns, 4)
            evidence.append({"kind": "memory_pressure", "text":
                             f"memory pressure (PSI) of its cgroup: some task stalled on "
                             f"memory {detail['psi_some_share']:.1%} of the time sampled"})
        if q.psi_system_us is not None and q.sampled_ns:
            detail["psi_system_share"] = round(q.psi_system_us * 1000 / q.sampled_ns, 4)
    # Every stall is the thread's own, measured where it happened: fully explained.
    return rule_chain(ctx, "memory_reclaim", pid, None, 1.0, share, evidence, detail,
                      tid=tid)


def take_reclaim_from_cpu_bound(ctx: Context, chains: list[Chain]) -> None:
    """A thread in reclaim is on the CPU, in the kernel, under the Python line that
    allocated: the on-CPU samples of ``host_cpu_bound`` count that time too. It is this
    cause's (the breakdown's reclaim column), so the CPU-bound chain of the same thread
    keeps only the rest, or goes when the rest is under its bar; the line it named moves
    into the memory chain's evidence (it is where the thread allocates)."""
    reclaim = {int(c.victim["tid"]): c for c in chains if c.root_cause == "memory_reclaim"}
    keep: list[Chain] = []
    for c in chains:
        m = reclaim.get(int(c.victim["tid"])) if c.root_cause == "host_cpu_bound" else None
        if m is None:
            keep.append(c)
            continue
        host = c.detail.get("host_ns", 0)  # host_cpu_bound's: its time outside CUDA calls
        host_ns = host if isinstance(host, int) else 0
        of_runnable = c.detail["host_share_of_runnable"]
        # Reclaim inside a CUDA call (pinned allocations) is not in the host samples.
        taken = min(host_ns, m.detail["stall_ns"])
        rest = host_ns - taken
        runnable = host_ns / of_runnable if of_runnable > 0 else float(ctx.span_ns)
        frames = c.detail.get("top_frames") or []
        if frames and frames[0]["frame"]:
            m.extra_evidence.append({"kind": "cpu_profile", "text":
                                     f"on-CPU samples put that time under {frames[0]['frame']} "
                                     f"({frames[0]['share']:.0%} of the thread's samples): "
                                     "where it allocates"})
        if rest / runnable < MIN_HOST_SHARE:
            m.detail["cpu_bound_without_reclaim"] = round(rest / ctx.span_ns, 4)
            continue
        c.detail["reclaim_ns"] = taken
        c.detail["host_share"] = round(rest / ctx.span_ns, 4)
        c.impact = round(rest / ctx.span_ns, 4)
        c.severity = severity(c.explained, c.impact)
        keep.append(c)
    chains[:] = keep


def queued_work(ctx: Context, tid: int) -> dict[str, int]:
    """Kernel work thread ``tid`` queued in the window, by work function."""
    v = ctx.view
    out: dict[str, int] = defaultdict(int)
    for args, n in v.conn.execute(
            "SELECT x.args, e.a0 FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
            "WHERE e.op = ? AND e.tid = ? AND e.ts_ns >= ? AND e.ts_ns < ? "
            "AND e.id BETWEEN ? AND ?",
            (KWORK, tid, v.win.start_ns, v.win.end_ns, v.node.lo, v.node.hi)):
        name = args_object(args).get("function")
        out[name if isinstance(name, str) else "?"] += int(n or 0)
    return dict(out)


def own_kernel_work(ctx: Context, chains: list[Chain]) -> None:
    """A kernel worker that preempts a thread may be running work the thread queued
    itself: a thread at its memory limit queues the cgroup's pressure notification
    (vmpressure_work_fn) from its reclaim hundreds of times a second, and the kworker
    that runs it takes the thread's CPU. A contention chain whose top culprit is a
    kworker says so (``kernel_work`` evidence, ``detail.own_kernel_work``), and its
    fixes go after the thread's own side (the memory limit) instead of renicing a
    kernel thread. Its share stays: the kworkers did take that CPU time."""
    reclaiming = {int(c.victim["tid"]) for c in chains if c.root_cause == "memory_reclaim"}
    for ch in chains:
        if ch.root_cause != "cpu_contention" or not ch.culprits or \
                not str(ch.culprits[0].get("comm") or "").startswith(KWORKER):
            continue
        tid = int(ch.victim["tid"])
        queued = queued_work(ctx, tid)
        if not queued:
            continue
        top = sorted(queued.items(), key=lambda kv: -kv[1])[:3]
        total = sum(queued.values())
        ch.detail["own_kernel_work"] = {"queued": total, "functions": dict(top),
                                        "reclaim": tid in reclaiming}
        why = ("; vmpressure_work_fn is its memory cgroup's pressure notification, which "
               "its reclaim queues" if "vmpressure_work_fn" in queued else "")
        # The one line a verdict quotes says it too, not only the evidence.
        origin = " from its reclaim at its memory limit" if tid in reclaiming else ""
        ch.summary = (f"{causes.summary(ch)}; the kworkers ran work the thread queued "
                      f"itself ({top[0][0]} x{top[0][1]}{origin})")
        ch.extra_evidence.insert(0, {"kind": "kernel_work", "tid": tid, "queued": total,
                                     "text": f"thread {tid} itself queued {total} work "
                                     "item(s) for the kernel's workers in the window ("
                                     + ", ".join(f"{f} {n}" for f, n in top) + "): the "
                                     "kworkers that preempted it run such work, so part of "
                                     f"that time was its own{why}"})


def _limit_text(q: Limit) -> str:
    parts = [f"cgroup {q.cgroup}{pods.where(q.place)}: memory limit {_mib(q.limit)}, "
             f"usage up to {_mib(q.usage)} ({q.usage / q.limit:.0%} of it)"]
    if q.file is not None and q.anon is not None:
        parts.append(f"reclaimable without swap (page cache, lazily freed) {_mib(q.file)}, "
                     f"anonymous {_mib(q.anon)}")
    parts.append(f"the limit was hit {q.limit_hits} time(s)")
    return "; ".join(parts)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
