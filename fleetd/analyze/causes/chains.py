"""Causal chains: classified spikes grouped per thread and cause, ranked and measured.

Spikes and stalls (fleetd.analyze.causes.spikes: slow calls and long between-call waits, each
tied only to the host events of its own thread that overlap it) of one thread with the
same cause form one chain; its culprit is the task that took the CPU (sched_switch next
task) or that woke the victim from a D-state wait (sched_waking waker), ranked by the
time it accounts for. How much time the cause cost is not read from the spikes (the
stored calls are a sample, and short waits make no spike): :func:`account` gives each
chain its thread's share of wall time in the breakdown column of its cause
(:data:`REASON_COLUMN`), the same figure ``fleetd explain``'s breakdown prints.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetd.analyze.causes.io_owner import io_worker
from fleetd.analyze.causes.spikes import (
    MIN_CALLS,
    Baseline,
    Spike,
    attribute,
    find_spikes,
    find_stalls,
)
from fleetd.analyze.reading import pods
from fleetd.analyze.reading.answers_chain import (
    ChainDetail,
    Culprit,
    EvidenceItem,
    RankedCulprit,
    ShadowedChain,
    Victim,
)
from fleetd.analyze.reading.data import SYNC_OPS, code
from fleetd.analyze.reading.nodeview import OFF_CPU, NodeView, task_state
from fleetd.analyze.reading.rows import (
    PLACEMENT_KEYS,
    CgroupPlace,
    Placement,
    PlacementKey,
    ThreadRow,
    TimeColumn,
)

# Older callers import the view, the spikes and their steps from here: chains.py was
# all of them once. New code imports them from nodeview and spikes.
__all__ = [
    "COLUMN_WORDS", "MIN_CALLS", "OFF_CPU", "REASON_COLUMN", "SEVERITY_RANK", "Baseline",
    "Chain", "NodeView", "Spike", "account", "attribute", "build_chains", "column_of",
    "culprit_json", "evidence_timeline", "find_spikes", "find_stalls", "place_chain", "severity",
    "task_state", "thread_share",
]

log = logging.getLogger("fleetd.analyze.causes.chains")

EVIDENCE_SPIKES = 3  # spikes shown per chain, slowest first
EVIDENCE_PER_SPIKE = 6


@dataclass(slots=True)
class Chain:
    """A causal chain as the rules build it. Its victim, culprits, ``detail`` and
    evidence are already the answer's types (fleetd.analyze.reading.answers_chain), so
    every rule is held to one shape and :func:`fleetd.analyze.explain.chain_json` only
    adds what is derived (id, key, summary, fixes, the evidence timeline)."""

    node: str
    root_cause: str
    victim: Victim
    op: str | None
    spikes: list[Spike]
    span_ns: int
    scale: float = 1.0
    culprits: list[RankedCulprit] = field(default_factory=list)
    extra_evidence: list[EvidenceItem] = field(default_factory=list)
    summary: str = ""
    fixes: list[str] = field(default_factory=list)
    severity: str = "LOW"
    explained: float = 0.0
    impact: float = 0.0
    detail: ChainDetail = field(default_factory=ChainDetail)
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
        victim: Victim = {
            "pid": pid, "tid": tid, "comm": view.names.get(pid) or view.who(tid)["comm"],
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


@dataclass(slots=True)
class _Taker:
    """A process that took a victim's time, while its culprits are being ranked."""

    pid: int
    comm: str | None
    tids: set[int] = field(default_factory=set)
    ns: int = 0
    by_tid: dict[int, int] = field(default_factory=lambda: defaultdict(int))


def _rank_culprits(view: NodeView, group: list[Spike], root: str, victim_pid: int
                   ) -> list[RankedCulprit]:
    roles = _ROLES.get(root, ())
    by_pid: dict[int, _Taker] = {}
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
        if role in ("wake", "io") and io_worker(who["comm"]):
            continue  # it completed or dispatched someone's I/O: never the cause
        entry = by_pid.setdefault(pid, _Taker(pid, who["comm"]))
        entry.tids.add(tid)
        entry.by_tid[tid] += ns
        entry.ns += ns
        total += ns
    share = {pid: round(t.ns / max(1, total), 3) for pid, t in by_pid.items()}
    presence: dict[int, float] | None = None
    if root == "cpu_contention" and group:
        # Who ran first after each preemption is only part of the story: under a CPU
        # quota the victim is throttled and whatever is runnable elsewhere goes first.
        # Rank by that time share plus how often each one took over from the victim.
        presence = _presence(view, group[0].call.tid, by_pid)
    ranked = sorted(by_pid.values(),
                    key=lambda t: -(share[t.pid] + (presence or {}).get(t.pid, 0.0)))
    return [_ranked(view, t, share[t.pid], victim_pid, presence) for t in ranked]


def _ranked(view: NodeView, t: _Taker, share: float, victim_pid: int,
            presence: dict[int, float] | None) -> RankedCulprit:
    out: RankedCulprit = {"pid": t.pid, "comm": t.comm, "tids": sorted(t.tids), "ns": t.ns,
                          "share": share, "self": t.pid == victim_pid}
    if presence is not None:
        out["presence"] = presence[t.pid]
    # The thread that accounts for most of the time: the culprit when it is a thread.
    out["tid"] = max(t.by_tid.items(), key=lambda kv: kv[1])[0]
    out["thread"] = view.tasks.get(out["tid"], (None, None))[1]
    return out


def _presence(view: NodeView, victim_tid: int, by_pid: dict[int, _Taker]) -> dict[int, float]:
    """How often each of ``by_pid`` took the CPU over from the victim (a share)."""
    peers = view.switch_peers(victim_tid)
    counts: dict[int, int] = defaultdict(int)
    for tid, n in peers.items():
        counts[int(view.who(tid)["pid"])] += n
    total = sum(counts.values())
    return {pid: round(counts.get(pid, 0) / max(1, total), 3) for pid in by_pid}


def _detail(group: list[Spike], kind: str, op: str | None) -> ChainDetail:
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

# The breakdown column (fleetd.analyze.pernode.breakdown, per thread) that holds each root
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
        host = ch.detail.get("host_ns")
        by_cause = host if isinstance(host, dict) else {}  # a spike chain's, by cause
        if by_cause.get("sleep", 0) > by_cause.get("d_state", 0):
            # Sleeps woken by another process: a futex (lock), a pipe or socket (data).
            why: dict[str, int] = defaultdict(int)
            for s in ch.spikes:
                for k, v in s.sleep_why.items():
                    why[k] += v
            col = max(why.items(), key=lambda kv: kv[1])[0] if why else "other"
    return col


# A breakdown column by name (as REASON_COLUMN and the rules name it) -> a thread row's key.
COLUMN_KEYS: Mapping[str, TimeColumn] = {
    "running": "running_ns", "runq": "runq_ns", "irq": "irq_ns", "d_state": "d_state_ns",
    "sleeping": "sleeping_ns", "lock": "lock_ns", "data": "data_ns", "timer": "timer_ns",
    "gpu_sync": "gpu_sync_ns", "other": "other_ns", "off_cpu": "off_cpu_ns",
    "in_cuda": "in_cuda_ns", "reclaim": "reclaim_ns", "lock_spin": "lock_spin_ns",
}


def thread_share(threads: list[ThreadRow], tid: int, col: str) -> float | None:
    """The share of its wall time thread ``tid`` spent in breakdown column ``col``."""
    row = next((t for t in threads if t["tid"] == tid), None)
    if row is None or not row["wall_ns"]:
        return None
    return min(1.0, row[COLUMN_KEYS[col]] / row["wall_ns"])


def account(chains: list[Chain], threads: list[ThreadRow]) -> list[Chain]:
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
        top.detail["share"] = round(share, 6)
        top.detail["share_of"] = col
        if len(group) > 1:
            top.detail["also"] = [_shadowed(c) for c in group[1:]]
        top.impact = round(share, 6)
        top.severity = severity(top.explained, top.impact)
        out.append(top)
    return out


# A culprit's placement keys, in the order its JSON has them (not pods.fields' order).
CULPRIT_PLACE: tuple[PlacementKey, ...] = ("pod", "namespace", "container", "pod_uid")


def _shadowed(c: Chain) -> ShadowedChain:
    """A chain whose share another chain of its thread and column states."""
    return {"root_cause": c.root_cause, "op": c.op,
            "estimate": c.detail.get("estimate", c.impact),
            "culprit": culprit_json(c.culprits[0]) if c.culprits else None}


def culprit_json(top: Culprit) -> Culprit:
    """A ranked culprit as a chain's JSON shows it; a thread culprit also names its
    thread. (Also applied to culprits a node sent, so ``self`` may be missing.)"""
    out: Culprit = {"pid": top["pid"], "comm": top["comm"], "self": top.get("self", False)}
    if top.get("tid") is not None:
        out["tid"], out["thread"] = top["tid"], top.get("thread")
    if top.get("where"):  # a lock holder traced with stacks: its line and frames
        out["where"], out["stack"] = top["where"], top.get("stack") or []
    # Where it runs (analyze.pods), in this order whatever order the placement had.
    for k in CULPRIT_PLACE:
        if top.get(k):
            out[k] = top[k]
    return out


def place_chain(chain: Chain, node_key: int, found: dict[tuple[int, int], CgroupPlace]
                ) -> None:
    """Name the pod and container (pods.fields) of the chain's victim and culprits, in
    place, after their own keys (what pods.annotate does for a process row)."""
    _place(chain.victim, chain.victim["pid"], node_key, found)
    for c in chain.culprits:
        _place(c, c["pid"], node_key, found)


def _place(row: Placement, pid: int, node_key: int,
           found: dict[tuple[int, int], CgroupPlace]) -> None:
    where = pods.fields(found.get((node_key, pid)))
    for k in PLACEMENT_KEYS:
        if k in where:
            row[k] = where[k]


def evidence_timeline(chain: Chain) -> list[EvidenceItem]:
    """The slowest spikes, each followed by the host events that overlapped it."""
    out: list[EvidenceItem] = []
    worst = sorted(chain.spikes, key=lambda s: -s.call.dur)[:EVIDENCE_SPIKES]
    for s in sorted(worst, key=lambda s: s.call.ts):
        head, rest = s.evidence[0], s.evidence[1:]
        rest = sorted(rest, key=lambda e: -int(e.get("overlap_ns", 0)))[:EVIDENCE_PER_SPIKE]
        out.append(head)
        for e in sorted(rest, key=lambda e: int(e["ts_ns"])):
            out.append({**e, "spike": head["id"]})
    return out + chain.extra_evidence
