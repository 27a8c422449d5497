"""Collective arrival: which rank the others wait for, from the NCCL calls each rank made.

A collective (``ncclAllReduce`` and the other four) cannot finish before its last rank
calls it, so every other rank waits for that one. The tracer records each call's entry
(``ts_ns``, wall clock) as the rank's **arrival**. Calls of one collective instance are
matched across processes and nodes by a key and a sequence number
(the contract of docs/schema.md, "NCCL"):

* ``communicator``: the call carries ``comm_hash`` (the hash of the ncclUniqueId, known
  when the tracer saw the communicator created): key ``comm_hash``, instance ``seq``, rank
  and size from the call's args;
* ``torchrun``: otherwise (no GPU: no communicator is ever created), the process's
  torchrun identity: key ``job/world_size`` (``job``: TORCHELASTIC_RUN_ID or
  MASTER_ADDR:MASTER_PORT, "-" when not recorded), instance ``seq``, rank and size from
  the process's RANK and WORLD_SIZE. A process with no rank is not matched. A process that
  uses several communicators numbers each one's collectives separately; they are told
  apart by the order of their first call (``key#2`` for the second).

The instance is the call's number in one numbering for the whole communicator: with
``communicator`` matching every rank counts from the communicator's creation (exact);
with ``torchrun`` matching each agent counts from when it began tracing, so each
process's numbers are first aligned with the other ranks' from the calls themselves
(:mod:`fleetd.analyze.distributed.align`: op/bytes sequence, then arrival times), and the report
says how (``alignment``) and how sure; a rank that cannot be aligned for sure is
compared at its most likely offset, with a note.

Reading one node's calls is :mod:`fleetd.analyze.distributed.arrivals`; failed NCCL calls as a
chain, :mod:`fleetd.analyze.distributed.nccl_failures` (both re-exported here).

Arrivals are moved into one clock before they are compared: ``ts - offset`` per node
(the fleet client's measured skew, or 0 in a local or merged file), and each node has an
error bound (the skew's, or the largest error its trace sessions recorded). Ranks on one
node share a clock (no error between them).

Per instance: the **last** rank and its **lateness** (its arrival minus the median arrival
of the other ranks). The instance is **ambiguous** when some other rank arrived within
the combined clock error of its node and the last rank's node (the sum of both bounds;
0 on one node; an unknown bound is always ambiguous): an ambiguous instance names
nobody. Per rank, its lateness in every judged instance (negative when early) gives
p50/p99.

Straggler rule, per communicator: over at least :data:`MIN_INSTANCES` judged instances,
the rank that is unambiguously last in at least :data:`MIN_LAST_SHARE` of them (and in
more than any other rank), with a median lateness of at least :data:`MIN_LATENESS_NS`.
Judged instances are the complete ones (every rank of the communicator seen); when none
is complete (ranks not traced, a node that did not answer) the most common set of seen
ranks is judged, and the communicator is marked ``partial``.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fleetd.analyze.causes.chains import culprit_json
from fleetd.analyze.distributed import align
from fleetd.analyze.distributed.align import Alignment, torchrun_key
from fleetd.analyze.distributed.arrivals import (
    ARRIVAL_COLUMNS,
    COLLECTIVE_CODES,
    COLLECTIVES,
    DEFAULT_ROWS,
    EXPLAIN_ROWS,
    LOCAL_ROWS,
    MAX_BYTES,
    MAX_ROWS,
    PROCESS_COLUMNS,
    Arrival,
    NodeArrivals,
    Proc,
    dur_text,
    local_clocks,
    one_machine,
    read_arrivals,
)
from fleetd.analyze.distributed.nccl_failures import NCCL_CODES, failed, failures, nccl_error
from fleetd.analyze.distributed.stragglers import chain_brief
from fleetd.analyze.reading.answers import ChainJson, StragglerEntry
from fleetd.analyze.reading.answers_collectives import (
    AlignmentSummary,
    ClockJson,
    CollectiveRank,
    CollectivesAnswer,
    CollectiveStraggler,
    Communicator,
    CommunicatorAlignment,
    Stretch,
)
from fleetd.store.clockinfo import Clock, combined_error

__all__ = [  # the arrival side and the failures, used from here by older callers
    "ARRIVAL_COLUMNS", "COLLECTIVES", "COLLECTIVE_CODES", "DEFAULT_ROWS", "EXPLAIN_ROWS",
    "LOCAL_ROWS", "MAX_BYTES", "MAX_ROWS", "NCCL_CODES", "PROCESS_COLUMNS", "Arrival",
    "Clock", "NodeArrivals", "Proc", "analyze", "combined_error", "failures", "host_chains",
    "local_clocks", "nccl_error", "one_machine", "read_arrivals", "rows",
    "straggler_entries", "torchrun_key",
]

log = logging.getLogger("fleetd.analyze.distributed.collectives")

# The straggler rule (docs/explain.md, "Collective arrival").
MIN_INSTANCES = 5  # judged instances of a communicator before anyone is named
MIN_LAST_SHARE = 0.5  # unambiguously last in at least this share of them
MIN_LATENESS_NS = 1_000_000  # and a median lateness of at least 1 ms: not scheduling noise
ALIGN_CALLS = 4096  # calls per stretch of a process's numbers that its offset is found from

COMMUNICATOR, TORCHRUN = "communicator", "torchrun"

# ---- matching and judging ------------------------------------------------------------


@dataclass(slots=True)
class _Hit:
    node: str
    pid: int
    t: int  # arrival in the reference clock
    op: str
    ret: int
    bytes: int


@dataclass(slots=True)
class _RankStats:
    count: int = 0
    bytes: int = 0
    failures: int = 0
    judged: int = 0
    last: int = 0
    last_ambiguous: int = 0
    lateness: list[int] = field(default_factory=list)
    who: Counter[tuple[str, int]] = field(default_factory=Counter)


@dataclass(slots=True)
class _Comm:
    matching: str
    key: str
    job: str | None = None
    sizes: Counter[int] = field(default_factory=Counter)
    instances: dict[int, dict[int, _Hit]] = field(default_factory=lambda: defaultdict(dict))
    ranks: dict[int, _RankStats] = field(default_factory=lambda: defaultdict(_RankStats))
    duplicates: int = 0
    # The calls as numbered, per stretch of one process's numbers (see _Stretch), until
    # they are aligned into instances.
    calls: dict[_Stretch, list[tuple[int, _Hit]]] = field(default_factory=dict)
    alignment: Alignment[_Stretch] | None = None


class _Stretch(NamedTuple):
    """One process's calls of one communicator whose numbers run on (they start again
    when its agent restarts): the unit that gets one offset."""

    rank: int
    node: str
    pid: int
    comm_ptr: str | None
    part: int  # 0, then 1 after the numbers started again, ...


def analyze(parts: Sequence[NodeArrivals], clocks: Mapping[str, Clock] | None = None
            ) -> CollectivesAnswer:
    """The arrival report over every node's calls (docs/json.md, ``fleetd collectives``).

    ``clocks``: node -> (offset, error) to move arrivals into one clock; without it, the
    file's own (:func:`local_clocks`).
    """
    warnings = [f"{p.node}: more collective calls in the window than one answer holds "
                f"({p.truncated_reason or 'rows'} limit): only the newest {len(p.arrivals)} "
                "are compared; narrow the window (--since/--from/--to)"
                for p in parts if p.truncated]
    if clocks is None:
        clocks, more = local_clocks(parts)
        warnings += more
    procs = {(p.node, pid): pr for p in parts for pid, pr in p.procs.items()}
    comms: dict[tuple[str, str], _Comm] = {}
    unmatched = missing_seq = events = 0
    for part in parts:
        offset = clocks.get(part.node, (0, None))[0]
        ordinal = _ordinals(part.arrivals)
        counters: Counter[tuple[int, str | None]] = Counter()
        last: dict[tuple[str, int, str | None], tuple[int, int]] = {}  # -> (stretch, seq)
        for a in part.arrivals:
            events += 1
            seq = a.seq
            if seq is None:  # an older record: count the process's calls in time order
                counters[(a.pid, a.comm_ptr)] += 1
                seq = counters[(a.pid, a.comm_ptr)]
                missing_seq += 1
            where = _match(a, procs.get((part.node, a.pid)), ordinal)
            if where is None:
                unmatched += 1
                continue
            matching, key, rank, size, job = where
            c = comms.get((matching, key))
            if c is None:
                c = comms[(matching, key)] = _Comm(matching, key, job)
            c.sizes[size] += 1
            hit = _Hit(part.node, a.pid, a.ts_ns - offset, a.op, a.ret, a.bytes)
            st = c.ranks[rank]
            st.count += 1
            st.bytes += a.bytes
            st.failures += failed(a.ret)
            st.who[(part.node, a.pid)] += 1
            proc_key = (key, a.pid, a.comm_ptr)
            index, before = last.get(proc_key, (0, 0))
            if seq <= before:
                index += 1  # the numbers started again
            last[proc_key] = (index, seq)
            c.calls.setdefault(_Stretch(rank, part.node, a.pid, a.comm_ptr, index),
                               []).append((seq, hit))
    for c in comms.values():
        _instances(c, clocks)
    if missing_seq:
        warnings.append(f"{missing_seq} collective call(s) carry no sequence number (recorded "
                        "before the tracer numbered them): numbered per process in time "
                        "order, so a lost record shifts the later ones")
    if unmatched:
        warnings.append(f"{unmatched} collective call(s) from processes with no rank (no "
                        "communicator seen, no RANK/WORLD_SIZE in their environment) were "
                        "not matched")
    out = [_report(c, clocks, procs, warnings)
           for c in sorted(comms.values(), key=lambda c: (c.matching, c.key))]
    found = sorted((c["straggler"] for c in out if c["straggler"]),
                   key=lambda s: (-s["share_last"], -s["judged"], s["node"], s["pid"]))
    seen: set[tuple[str, int]] = set()
    stragglers: list[CollectiveStraggler] = []
    for s in found:  # one entry per process, its clearest communicator
        if (s["node"], s["pid"]) not in seen:
            seen.add((s["node"], s["pid"]))
            stragglers.append(s)
    kinds = sorted({c["matching"] for c in out})
    return {
        "matching": kinds[0] if len(kinds) == 1 else "mixed" if kinds else None,
        "alignment": _overall(out),
        "verdict": _verdict(out, stragglers, events),
        "communicators": out,
        "stragglers": stragglers,
        "events": events,
        "unmatched": unmatched,
        "truncated": any(p.truncated for p in parts),
        "clocks": {n: _clock_json(c)
                   for n, c in sorted((n, Clock(*c)) for n, c in clocks.items())},
        "notes": warnings,
    }


def _clock_json(c: Clock) -> ClockJson:
    out: ClockJson = {"offset_ns": c.offset_ns, "error_ns": c.error_ns}
    if c.domain:
        out["domain"] = c.domain
    return out


def _instances(c: _Comm, clocks: Mapping[str, Clock]) -> None:
    """The communicator's calls matched into instances by their aligned numbers: as
    numbered where every rank counts from the communicator's creation, else aligned
    from the calls (:mod:`fleetd.analyze.distributed.align`)."""
    if c.matching == COMMUNICATOR:
        c.alignment = align.communicator(list(c.calls))
    else:
        c.alignment = align.align(_for_alignment(c.calls),
                                  lambda a, b: combined_error(a.node, b.node, clocks))
    for k, calls in c.calls.items():
        shift = c.alignment.offsets.get(k, 0)
        for seq, hit in calls:
            inst = c.instances[seq + shift]
            old = inst.get(k.rank)
            if old is not None:
                c.duplicates += 1
                if hit.t >= old.t:
                    continue
            inst[k.rank] = hit
    c.calls = {}


def _for_alignment(calls: Mapping[_Stretch, Sequence[tuple[int, _Hit]]]
                   ) -> dict[_Stretch, list[align.Call]]:
    """Per stretch, at most :data:`ALIGN_CALLS` of its calls, one run of numbers each:
    those up to the end of the time every stretch was traced (an offset holds for a
    whole stretch, so a few thousand calls side by side decide it as well as a million),
    else (stretches that do not all overlap) its newest ones."""
    start = max(v[0][1].t for v in calls.values())
    end = min(v[-1][1].t for v in calls.values())
    out = {}
    for k, v in calls.items():
        stop = len(v)
        if start <= end:
            stop = bisect.bisect_right(v, end + align.MAX_APART_NS, key=lambda x: x[1].t)
        out[k] = [align.Call(seq, h.t, h.op, h.bytes)
                  for seq, h in v[max(0, stop - ALIGN_CALLS):stop]]
    return out


def _alignment_json(c: _Comm, nranks: int | None, warnings: list[str]
                    ) -> CommunicatorAlignment:
    """How the ranks' numbers were matched: method, confidence, and per stretch of a
    process's calls its offset (added to its numbers) and how it was found."""
    al = c.alignment
    assert al is not None
    stretches: list[Stretch] = []
    for k in sorted(al.offsets, key=lambda k: (k.rank, k.node, k.pid, k.part)):
        p = al.pairs.get(k)
        stretch: Stretch = {"rank": k.rank, "node": k.node, "pid": k.pid,
                            "offset": al.offsets[k], "confidence": al.confidence_of(k)}
        if p is not None:
            stretch.update({"by": p.by, "pairs": p.pairs, "residual_ns": p.residual_ns,
                            "runner_up_ns": p.runner_up_ns, "reason": p.reason or None})
        stretches.append(stretch)
    unsure = sorted({k.rank for k in al.offsets if not al.sure(k)})
    if unsure:
        why = "; ".join(sorted({p.reason for k, p in al.pairs.items()
                                if k.rank in unsure and p.reason}))
        warnings.append(f"{c.matching} {c.key}: the collective numbers of rank(s) "
                        f"{_ranges(unsure)} could not be aligned with the others for sure "
                        f"({why or 'ambiguous'}): compared at the most likely offset")
    return {"method": al.method, "confidence": al.confidence, "by": al.by(),
            "text": al.describe(), "renumbered": sum(1 for o in al.offsets.values() if o),
            "stretches": stretches[:4 * (nranks or 64)]}


def _overall(comms: Sequence[Communicator]) -> AlignmentSummary | None:
    """The weakest alignment over the communicators (None without any)."""
    found = [c["alignment"] for c in comms]
    if not found:
        return None
    worst = max(found, key=lambda a: align.CONFIDENCES.index(a["confidence"]))
    return {"method": worst["method"], "confidence": worst["confidence"], "by": worst["by"],
            "text": worst["text"]}


def _ordinals(arrivals: Iterable[Arrival]) -> dict[tuple[int, str | None], int]:
    """(pid, communicator pointer) -> 1, 2, ... in the order of the process's first call on
    it (calls without a communicator hash only): tells apart the communicators of a
    torchrun-matched process."""
    out: dict[tuple[int, str | None], int] = {}
    per_pid: Counter[int] = Counter()
    for a in arrivals:
        if a.comm_hash is None and (a.pid, a.comm_ptr) not in out:
            per_pid[a.pid] += 1
            out[(a.pid, a.comm_ptr)] = per_pid[a.pid]
    return out


def _match(a: Arrival, proc: Proc | None, ordinal: Mapping[tuple[int, str | None], int]
           ) -> tuple[str, str, int, int, str | None] | None:
    """(matching, key, rank, size, job) of a call; None when it cannot be matched."""
    if a.comm_hash is not None and a.rank is not None and a.nranks:
        return COMMUNICATOR, a.comm_hash, a.rank, a.nranks, None
    if proc is None or proc.rank is None or not proc.world_size or proc.rank >= proc.world_size:
        return None
    key = torchrun_key(proc.job, proc.world_size, ordinal.get((a.pid, a.comm_ptr), 1))
    return TORCHRUN, key, proc.rank, proc.world_size, proc.job


def _median(xs: Sequence[int]) -> int:
    return round(statistics.median(xs))


def percentile(xs: Sequence[int], q: float) -> int | None:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _ambiguous(inst: Mapping[int, _Hit], hits: Sequence[tuple[int, int]],
               clocks: Mapping[str, Clock]) -> bool:
    """Whether the last arrival might not be last: some other rank arrived within the
    combined clock error of the two nodes (or that error is unknown)."""
    t1, r1 = hits[-1]
    node = inst[r1].node
    for t, r in hits[:-1]:
        err = combined_error(node, inst[r].node, clocks)
        if err is None or t1 - t <= err:
            return True
    return False


def _report(c: _Comm, clocks: Mapping[str, Clock], procs: Mapping[tuple[str, int], Proc],
            warnings: list[str]) -> Communicator:
    nranks = c.sizes.most_common(1)[0][0] if c.sizes else None
    expected = frozenset(range(nranks)) if nranks else frozenset(c.ranks)
    complete = [s for s, inst in c.instances.items() if expected <= inst.keys()]
    partial = False
    judged_set = expected
    if not complete:
        sets = Counter(frozenset(inst) for inst in c.instances.values() if len(inst) >= 2)
        if sets:
            judged_set = max(sets, key=lambda s: (sets[s], len(s), sorted(s)))
            complete = [s for s, inst in c.instances.items() if judged_set <= inst.keys()]
            partial = True
    ambiguous = mismatched = 0
    for seq in sorted(complete):
        inst = c.instances[seq]
        hits = sorted((inst[r].t, r) for r in judged_set)
        if len({inst[r].op for r in judged_set}) > 1:
            mismatched += 1
        times = [t for t, _ in hits]
        for i, (t, r) in enumerate(hits):
            c.ranks[r].judged += 1
            c.ranks[r].lateness.append(t - _median(times[:i] + times[i + 1:]))
        last = hits[-1][1]
        if _ambiguous(inst, hits, clocks):
            ambiguous += 1
            c.ranks[last].last_ambiguous += 1
        else:
            c.ranks[last].last += 1
    ranks = [_rank_row(r, st, procs) for r, st in sorted(c.ranks.items())]
    seen = sorted(c.ranks)
    missing = sorted(expected - judged_set) if partial else sorted(expected - set(seen))
    if missing:
        warnings.append(f"{c.matching} {c.key}: rank(s) {_ranges(missing)} of {nranks} never "
                        "seen in the window (not traced, or its node did not answer): "
                        + ("judged among the ranks seen" if complete else "nothing judged"))
    if c.duplicates:
        warnings.append(f"{c.matching} {c.key}: {c.duplicates} call(s) claim a rank and "
                        "sequence number already seen (two jobs with one identity?): the "
                        "earliest is kept")
    if mismatched:
        warnings.append(f"{c.matching} {c.key}: {mismatched} instance(s) saw different ops "
                        "on different ranks: the ranks are out of step (or matched wrongly)")
    times = [h.t for inst in c.instances.values() for h in inst.values()]
    straggler, verdict = _decide(c, len(complete), ambiguous, ranks)
    return {
        "key": c.key, "matching": c.matching, "job": c.job, "nranks": nranks,
        "alignment": _alignment_json(c, nranks, warnings),
        "ranks_seen": len(seen), "instances": len(c.instances), "judged": len(complete),
        "ambiguous": ambiguous, "incomplete": len(c.instances) - len(complete),
        "partial": partial, "op_mismatch": mismatched,
        "first_ts_ns": min(times) if times else None,
        "last_ts_ns": max(times) if times else None,
        "ops": dict(Counter(h.op for inst in c.instances.values() for h in inst.values())
                    .most_common()),
        "straggler": straggler, "verdict": verdict, "ranks": ranks,
    }


def _rank_row(rank: int, st: _RankStats, procs: Mapping[tuple[str, int], Proc]
              ) -> CollectiveRank:
    node, pid = st.who.most_common(1)[0][0]
    proc = procs.get((node, pid))
    return {
        "rank": rank, "node": node, "pid": pid, "comm": proc.comm if proc else None,
        "count": st.count, "bytes": st.bytes, "failures": st.failures, "judged": st.judged,
        "last": st.last, "last_ambiguous": st.last_ambiguous,
        "last_share": round(st.last / st.judged, 4) if st.judged else None,
        "lateness_p50_ns": percentile(st.lateness, 0.5),
        "lateness_p99_ns": percentile(st.lateness, 0.99),
    }


def _decide(c: _Comm, judged: int, ambiguous: int, ranks: list[CollectiveRank]
            ) -> tuple[CollectiveStraggler | None, str]:
    """The communicator's straggler (or None) and one line saying why."""
    where = f"{c.matching} {c.key}"
    if judged < MIN_INSTANCES:
        return None, (f"{where}: {judged} collective(s) seen on every rank, fewer than the "
                      f"{MIN_INSTANCES} a verdict needs")
    top = max(ranks, key=lambda r: (r["last"], r["lateness_p50_ns"] or 0))
    share = top["last"] / judged
    others = [r["last"] for r in ranks if r is not top]
    if ambiguous > judged - ambiguous and share < MIN_LAST_SHARE:
        return None, (f"{where}: the arrival order of {ambiguous} of {judged} collectives is "
                      "inside the clock error: no rank named")
    if share < MIN_LAST_SHARE or (others and max(others) >= top["last"]):
        return None, (f"{where}: no rank last in {MIN_LAST_SHARE:.0%} of {judged} collectives "
                      f"(most: rank {top['rank']}, {share:.0%})")
    late = top["lateness_p50_ns"] or 0
    if late < MIN_LATENESS_NS:
        return None, (f"{where}: rank {top['rank']} is last in {share:.0%} of {judged} "
                      f"collectives but only {dur_text(late)} late (median), under the "
                      f"{dur_text(MIN_LATENESS_NS)} bar")
    reason = (f"rank {top['rank']} ({top['comm'] or 'pid'} pid {top['pid']} on "
              f"{top['node']}) arrived last in {share:.0%} of {judged} collectives of "
              f"{where}, a median {dur_text(late)} after the others (p99 "
              f"{dur_text(top['lateness_p99_ns'] or 0)})")
    straggler: CollectiveStraggler = {
        "communicator": c.key, "matching": c.matching, "rank": top["rank"],
        "node": top["node"], "pid": top["pid"], "comm": top["comm"],
        "share_last": round(share, 4), "last": top["last"], "judged": judged,
        "lateness_p50_ns": top["lateness_p50_ns"],
        "lateness_p99_ns": top["lateness_p99_ns"], "reason": reason}
    return straggler, f"{where}: straggler {reason}"


def _verdict(comms: list[Communicator], stragglers: list[CollectiveStraggler], events: int
             ) -> str:
    if not events:
        return "no NCCL collective in the window"
    if not comms:
        return f"{events} collective call(s), none matched across ranks"
    if stragglers:
        s = stragglers[0]
        return f"straggler: {s['reason']}"
    return "no straggler: " + "; ".join(c["verdict"] for c in comms[:3])


def _ranges(xs: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7] (at most a few groups)."""
    groups: list[list[int]] = []
    for x in xs:
        if groups and x == groups[-1][1] + 1:
            groups[-1][1] = x
        else:
            groups.append([x, x])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in groups[:8])
    return text + (", ..." if len(groups) > 8 else "")


# ---- the CLI's rows and the explain entries ------------------------------------------

ROW_COLUMNS = ("communicator", "matching", "rank", "node", "pid", "comm", "count", "bytes",
               "failures", "judged", "last", "last_share", "lateness_p50_ns",
               "lateness_p99_ns", "straggler")


def rows(report: Mapping[str, Any]) -> list[list[Any]]:
    """One row per (communicator, rank), as :data:`ROW_COLUMNS`."""
    out = []
    for c in report.get("communicators") or []:
        s = c.get("straggler") or {}
        for r in c["ranks"]:
            out.append([c["key"], c["matching"], r["rank"], r["node"], r["pid"], r["comm"],
                        r["count"], r["bytes"], r["failures"], r["judged"], r["last"],
                        r["last_share"], r["lateness_p50_ns"], r["lateness_p99_ns"],
                        bool(s) and s.get("rank") == r["rank"]])
    return out


HOST_CHAIN_EXCLUDED = ("nccl_failures",)  # findings about the calls, not host causes


def straggler_entries(report: Mapping[str, Any], chains: Sequence[ChainJson]
                      ) -> list[StragglerEntry]:
    """The collective stragglers as ``stragglers`` entries (docs/json.md): ``metric``
    ``collective_arrival``, ``rank``, and ``score`` 1 - the share of collectives it was last
    in; the reason ends with its node's top host chain."""
    out: list[StragglerEntry] = []
    for s in report.get("stragglers") or []:
        peers = sorted({int(r["pid"]) for c in report.get("communicators") or []
                        if c.get("key") == s["communicator"] for r in c["ranks"]
                        if r["pid"] != s["pid"]})
        out.append({"node": s["node"], "score": round(1 - s["share_last"], 4),
                    "flagged": True, "metric": "collective_arrival",
                    "reason": s["reason"] + _top_host_chain(s["node"], s["pid"], chains,
                                                            peers),
                    "rank": s["rank"], "pid": s["pid"], "comm": s["comm"], "peers": peers,
                    "communicator": s["communicator"], "matching": s["matching"],
                    "share_last": s["share_last"], "judged": s["judged"],
                    "lateness_p50_ns": s["lateness_p50_ns"],
                    "lateness_p99_ns": s["lateness_p99_ns"]})
    return out


def host_chains(node: str, pid: int | None, chains: Sequence[ChainJson],
                peers: Iterable[int] = ()) -> list[ChainJson]:
    """The node's host chains (most severe first as given), the process's own first.
    Another rank of the job (``peers``: their pids) is never the culprit: a rank
    waiting for its peers' data is the collective itself, not a cause. A chain whose
    top culprit is a peer names its first other culprit instead (ranks sharing a
    machine's CPUs outrank a hog in the rank's own CPU quota by time alone), and is
    left out when it has none."""
    others = set(peers)
    mine: list[ChainJson] = []
    for c in chains:
        if c.get("node") != node or c.get("root_cause") in HOST_CHAIN_EXCLUDED:
            continue
        top = c.get("culprit")
        if top is not None and top.get("pid") in others:
            # A peer's culprits were checked by fleetd.wire.chains.
            rest = [x for x in c.get("culprits") or () if "comm" in x
                    and x["pid"] not in others]
            if not rest:
                continue
            c = c.copy()  # the caller's chain stays as it was
            c["culprit"] = culprit_json(rest[0])
        mine.append(c)
    own = [c for c in mine if c["victim"].get("pid") == pid]
    return own + [c for c in mine if c not in own]


def _top_host_chain(node: str, pid: int, chains: Sequence[ChainJson],
                    peers: Iterable[int]) -> str:
    mine = host_chains(node, pid, chains, peers)
    if not mine:
        return "; no host chain on its node"
    return f"; top host chain on {node}: {chain_brief(mine[0])}"
