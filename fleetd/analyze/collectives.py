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

import logging
import math
import sqlite3
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from fleetd.analyze.chains import Chain, culprit_json
from fleetd.analyze.data import in_list, name_of
from fleetd.analyze.model import NodeSlice
from fleetd.analyze.rules import Context, rule_chain
from fleetd.analyze.stragglers import chain_brief
from fleetd.store.catalog import BY_NAME, OPS
from fleetd.store.clockinfo import SESSION_CLOCK_COLUMNS, NodeClock, session_clock
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.analyze.collectives")

COLLECTIVES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
               "ncclReduceScatter")
COLLECTIVE_CODES: tuple[int, ...] = tuple(BY_NAME[n].code for n in COLLECTIVES)
NCCL_CODES: tuple[int, ...] = tuple(o.code for o in OPS if o.source == "nccl")

# The straggler rule (docs/explain.md, "Collective arrival").
MIN_INSTANCES = 5  # judged instances of a communicator before anyone is named
MIN_LAST_SHARE = 0.5  # unambiguously last in at least this share of them
MIN_LATENESS_NS = 1_000_000  # and a median lateness of at least 1 ms: not scheduling noise

# What one node hands over (GET /api/v1/collectives, and a local read).
MAX_ROWS = 200_000
DEFAULT_ROWS = 100_000
EXPLAIN_ROWS = 20_000  # per node for explain --nodes: a few MB each, thousands of instances
LOCAL_ROWS = 1_000_000  # a local or merged file: bounded only by memory
MAX_BYTES = 16 * 1024 * 1024
ARRIVAL_COLUMNS = ("ts_ns", "dur_ns", "pid", "tid", "op", "ret", "bytes", "seq", "comm_ptr",
                   "comm_hash", "rank", "nranks")
PROCESS_COLUMNS = ("pid", "comm", "rank", "world_size", "job")

# ncclResult_t. ncclInProgress is what a non-blocking communicator answers while an
# operation runs: not a failure.
NCCL_RESULTS = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
    3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
    6: "ncclRemoteError", 7: "ncclInProgress",
}
NOT_FAILED = (0, 7)
# A failed NCCL call that held its rank this long before returning is a stall.
FAILED_STALL_NS = 100_000_000
CREATES = ("ncclCommInit", "ncclCommSplit")  # ops that create a communicator (name prefixes)

COMMUNICATOR, TORCHRUN = "communicator", "torchrun"

class Clock(NamedTuple):
    """A node's clock against the reference clock."""

    offset_ns: int  # node clock minus reference
    error_ns: int | None  # bound on that offset, None when unknown
    # Nodes in one domain read one clock (one machine, one boot: a local fleet, or
    # nodes recorded side by side), so their times compare with no error at all.
    domain: str | None = None


def nccl_error(ret: int) -> str:
    """``ncclInvalidArgument`` for 4; an unknown code as ``ncclResult 42``."""
    return NCCL_RESULTS.get(ret, f"ncclResult {ret}")


def failed(ret: int) -> bool:
    return ret not in NOT_FAILED


# ---- one node's arrivals ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    """One collective call as recorded (the node's own clock)."""

    ts_ns: int
    dur_ns: int
    pid: int
    tid: int
    op: str
    ret: int
    bytes: int
    seq: int | None
    comm_ptr: str | None
    comm_hash: str | None
    rank: int | None  # in the communicator (args), with comm_hash
    nranks: int | None

    def row(self) -> list[Any]:
        return [self.ts_ns, self.dur_ns, self.pid, self.tid, self.op, self.ret, self.bytes,
                self.seq, self.comm_ptr, self.comm_hash, self.rank, self.nranks]


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    comm: str | None
    rank: int | None
    world_size: int | None
    job: str | None

    def row(self) -> list[Any]:
        return [self.pid, self.comm, self.rank, self.world_size, self.job]


@dataclass(slots=True)
class NodeArrivals:
    """What one node contributes: its collective calls in the window (oldest first), the
    processes that made them, and its own clock error bound."""

    node: str
    arrivals: list[Arrival]
    procs: dict[int, Proc]
    clock_error_ns: int | None = None
    truncated: bool = False
    truncated_reason: str | None = None  # rows | bytes
    boot_id: str | None = None  # the one boot all its sessions ran in
    # wall minus CLOCK_MONOTONIC of the node's timestamps (its last session's mapping):
    # nodes of one boot share the monotonic clock, so this aligns them exactly.
    mono_offset_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The body of ``GET /api/v1/collectives`` (docs/api.md), less node, window and
        warnings."""
        return {"columns": list(ARRIVAL_COLUMNS), "rows": [a.row() for a in self.arrivals],
                "processes": {"columns": list(PROCESS_COLUMNS),
                              "rows": [p.row() for p in self.procs.values()]},
                "clock_error_ns": self.clock_error_ns, "boot_id": self.boot_id,
                "mono_offset_ns": self.mono_offset_ns,
                "truncated": self.truncated, "truncated_reason": self.truncated_reason}


def read_arrivals(sl: NodeSlice, max_rows: int | None = None, max_bytes: int | None = None
                  ) -> NodeArrivals:
    """The node's collective calls in the window, oldest first: the newest ``max_rows``
    (and at most about ``max_bytes`` of JSON) when given (the node API), all of them
    otherwise (a local file is the user's own)."""
    conn, node, win = sl.conn, sl.node, sl.window
    rows = conn.execute(
        "SELECT e.ts_ns, e.dur_ns, e.pid, e.tid, e.op, e.ret, e.bytes, x.args "
        "FROM event_data e LEFT JOIN event_args x ON x.id = e.id "
        "WHERE e.ts_ns >= ? AND e.ts_ns < ? AND e.id BETWEEN ? AND ? "
        f"AND e.op IN {in_list(COLLECTIVE_CODES)} ORDER BY e.ts_ns DESC, e.id DESC LIMIT ?",
        (win.start_ns, win.end_ns, node.lo, node.hi,
         -1 if max_rows is None else max_rows + 1))
    out: list[Arrival] = []
    size, reason = 0, None
    for ts, dur, pid, tid, op, ret, nbytes, args in rows:
        if max_rows is not None and len(out) >= max_rows:
            reason = "rows"
            break
        a = _arrival(int(ts), int(dur), int(pid), int(tid), name_of(int(op)), int(ret),
                     int(nbytes), args)
        if max_bytes is not None:
            size += len(orjson.dumps(a.row())) + 1
            if size > max_bytes:
                reason = "bytes"
                break
        out.append(a)
    out.reverse()
    pids = {a.pid for a in out}
    procs = {p.pid: p for p in _processes(conn, node.key) if p.pid in pids}
    error, boot, mono = _clock_error(conn, node.key)
    return NodeArrivals(node.name, out, procs, error, reason is not None, reason, boot, mono)


def _arrival(ts: int, dur: int, pid: int, tid: int, op: str, ret: int, nbytes: int,
             args: Any) -> Arrival:
    d: dict[str, Any] = {}
    if args:
        try:
            loaded = orjson.loads(args)
        except orjson.JSONDecodeError:
            loaded = None
        d = loaded if isinstance(loaded, dict) else {}
    comm_hash = _hex(d.get("comm_hash"), 16, exact=True)
    rank, nranks = _nat(d.get("rank")), _nat(d.get("nranks"))
    if comm_hash is None or rank is None or not nranks or rank >= nranks:
        comm_hash, rank, nranks = None, None, None
    seq = _nat(d.get("seq"))
    return Arrival(ts, max(0, dur), pid, tid, op, ret, max(0, nbytes),
                   seq if seq else None, _hex(d.get("comm"), 16), comm_hash, rank, nranks)


def _hex(v: Any, digits: int, *, exact: bool = False) -> str | None:
    """``0x7f..`` (a pointer, up to ``digits`` hex digits) or ``digits`` hex chars."""
    if not isinstance(v, str):
        return None
    body = v if exact else v.removeprefix("0x")
    ok = (len(body) == digits if exact else 0 < len(body) <= digits) and all(
        c in "0123456789abcdefABCDEF" for c in body)
    return v.lower() if ok else None


def _nat(v: Any) -> int | None:
    """A non-negative integer that fits an int32 (ranks, sizes) or int64 (seq)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63:
        return v
    return None


def _processes(conn: sqlite3.Connection, node_key: int) -> list[Proc]:
    """The node's processes with their torchrun identity (``job`` where the file has it)."""
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(process_data)")}
    job = "job" if "job" in cols else "NULL"
    out = []
    for pid, comm, rank, size, jb in conn.execute(
            f"SELECT pid, comm, rank, world_size, {job} FROM process_data WHERE node = ?",
            (node_key,)):
        out.append(Proc(int(pid), None if comm is None else str(comm),
                        _nat(rank), _nat(size) or None, None if jb is None else str(jb)))
    return out


def _clock_error(conn: sqlite3.Connection, node_key: int
                 ) -> tuple[int | None, str | None, int | None]:
    """The largest clock error bound the node's sessions recorded (None when unknown),
    the boot they all share (None when they do not, or do not say) and, with it, the
    wall-minus-monotonic offset of the last session."""
    sessions = []
    for row in conn.execute(f"SELECT {SESSION_CLOCK_COLUMNS} FROM session_data WHERE node = ?",
                            (node_key,)):
        try:
            sessions.append(session_clock(row))
        except (TypeError, ValueError):
            continue
    if not sessions:
        return None, None, None
    boots = {s.boot_id for s in sessions}
    boot = boots.pop() if len(boots) == 1 else None
    mono = max(sessions, key=lambda s: s.seq).mono_offset_ns if boot else None
    return NodeClock("", "", sessions, None, None).error_ns, boot, mono


def one_machine(clocks: Mapping[str, Clock], parts: Sequence[NodeArrivals]
                ) -> dict[str, Clock]:
    """Nodes that ran in one boot of one machine share its monotonic clock: each is
    placed against the one of them measured best (smallest error) by the difference of
    their wall-minus-monotonic offsets, which is exact (a node whose wall clock was set
    apart, or faked, is still placed right), and they compare with each other without
    error (one ``domain``)."""
    out = dict(clocks)
    best: dict[str, NodeArrivals] = {}
    for p in parts:
        c = clocks.get(p.node)
        if p.boot_id is None or p.mono_offset_ns is None or c is None or c.error_ns is None:
            continue
        b = best.get(p.boot_id)
        if b is None or c.error_ns < (clocks[b.node].error_ns or 0):
            best[p.boot_id] = p
    for p in parts:
        ref = best.get(p.boot_id or "")
        if ref is None or p.mono_offset_ns is None or p.node not in out:
            continue
        rc = clocks[ref.node]
        assert ref.mono_offset_ns is not None
        out[p.node] = Clock(rc.offset_ns + p.mono_offset_ns - ref.mono_offset_ns,
                            rc.error_ns, p.boot_id)
    return out


def local_clocks(parts: Sequence[NodeArrivals]) -> tuple[dict[str, Clock], list[str]]:
    """Clocks of a local or merged file: each node as recorded (offset 0), with the error
    its sessions recorded; unknown errors count as 0, with a warning when several nodes
    are compared."""
    clocks: dict[str, Clock] = {}
    unknown = []
    for p in parts:
        clocks[p.node] = Clock(0, p.clock_error_ns if p.clock_error_ns is not None else 0)
        if p.clock_error_ns is None and p.arrivals:
            unknown.append(p.node)
    clocks = one_machine(clocks, parts)
    warnings = []
    if unknown and sum(1 for p in parts if p.arrivals) > 1:
        warnings.append(f"clock error of {', '.join(unknown)} unknown (no trace session "
                        "recorded): arrivals across nodes are compared as recorded")
    return clocks, warnings


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


def analyze(parts: Sequence[NodeArrivals], clocks: Mapping[str, Clock] | None = None
            ) -> dict[str, Any]:
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
    unmatched = 0
    missing_seq = 0
    events = 0
    for part in parts:
        offset = clocks.get(part.node, (0, None))[0]
        ordinal = _ordinals(part.arrivals)
        counters: Counter[tuple[int, str | None]] = Counter()
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
            inst = c.instances[seq]
            if rank in inst:
                c.duplicates += 1
                if hit.t >= inst[rank].t:
                    continue
            inst[rank] = hit
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
    stragglers = []
    for s in found:  # one entry per process, its clearest communicator
        if (s["node"], s["pid"]) not in seen:
            seen.add((s["node"], s["pid"]))
            stragglers.append(s)
    kinds = sorted({c["matching"] for c in out})
    return {
        "matching": kinds[0] if len(kinds) == 1 else "mixed" if kinds else None,
        "verdict": _verdict(out, stragglers, events),
        "communicators": out,
        "stragglers": stragglers,
        "events": events,
        "unmatched": unmatched,
        "truncated": any(p.truncated for p in parts),
        "clocks": {n: {"offset_ns": c.offset_ns, "error_ns": c.error_ns,
                       **({"domain": c.domain} if c.domain else {})}
                   for n, c in sorted((n, Clock(*c)) for n, c in clocks.items())},
        "notes": warnings,
    }


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


def torchrun_key(job: str | None, world_size: int, ordinal: int = 1) -> str:
    """The group key of ranks matched by their torchrun identity: ``job/world_size``
    (``-`` for an unknown job), ``#n`` for a process's n-th communicator (the hang
    watcher groups the same way)."""
    return f"{job or '-'}/{world_size}" + (f"#{ordinal}" if ordinal > 1 else "")


def _median(xs: Sequence[int]) -> int:
    return round(statistics.median(xs))


def percentile(xs: Sequence[int], q: float) -> int | None:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def combined_error(a: str, b: str, clocks: Mapping[str, Clock]) -> int | None:
    """The bound on the error of comparing a time of node ``a`` with one of node ``b``:
    0 on one node (one clock), else the sum of both bounds (None when one is unknown)."""
    if a == b:
        return 0
    ca, cb = Clock(*clocks.get(a, (0, None))), Clock(*clocks.get(b, (0, None)))
    if ca.domain is not None and ca.domain == cb.domain:
        return 0
    ea, eb = ca.error_ns, cb.error_ns
    return None if ea is None or eb is None else ea + eb


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
            warnings: list[str]) -> dict[str, Any]:
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
              ) -> dict[str, Any]:
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


def _decide(c: _Comm, judged: int, ambiguous: int, ranks: list[dict[str, Any]]
            ) -> tuple[dict[str, Any] | None, str]:
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
                      f"collectives but only {_dur(late)} late (median), under the "
                      f"{_dur(MIN_LATENESS_NS)} bar")
    reason = (f"rank {top['rank']} ({top['comm'] or 'pid'} pid {top['pid']} on "
              f"{top['node']}) arrived last in {share:.0%} of {judged} collectives of "
              f"{where}, a median {_dur(late)} after the others (p99 "
              f"{_dur(top['lateness_p99_ns'] or 0)})")
    straggler = {"communicator": c.key, "matching": c.matching, "rank": top["rank"],
                 "node": top["node"], "pid": top["pid"], "comm": top["comm"],
                 "share_last": round(share, 4), "last": top["last"], "judged": judged,
                 "lateness_p50_ns": top["lateness_p50_ns"],
                 "lateness_p99_ns": top["lateness_p99_ns"], "reason": reason}
    return straggler, f"{where}: straggler {reason}"


def _verdict(comms: list[dict[str, Any]], stragglers: list[dict[str, Any]], events: int
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


def _dur(ns: int) -> str:
    if abs(ns) >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if abs(ns) >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


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


def straggler_entries(report: Mapping[str, Any], chains: Sequence[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """The collective stragglers as ``stragglers`` entries (docs/json.md): ``metric``
    ``collective_arrival``, ``rank``, and ``score`` 1 - the share of collectives it was last
    in; the reason ends with its node's top host chain."""
    out = []
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


def host_chains(node: str, pid: int | None, chains: Sequence[dict[str, Any]],
                peers: Iterable[int] = ()) -> list[dict[str, Any]]:
    """The node's host chains (most severe first as given), the process's own first.
    Another rank of the job (``peers``: their pids) is never the culprit: a rank
    waiting for its peers' data is the collective itself, not a cause. A chain whose
    top culprit is a peer names its first other culprit instead (ranks sharing a
    machine's CPUs outrank a hog in the rank's own CPU quota by time alone), and is
    left out when it has none."""
    others = set(peers)
    mine = []
    for c in chains:
        if c.get("node") != node or c.get("root_cause") in HOST_CHAIN_EXCLUDED:
            continue
        if (c.get("culprit") or {}).get("pid") in others:
            rest = [x for x in c.get("culprits") or () if isinstance(x, dict)
                    and "pid" in x and "comm" in x and x["pid"] not in others]
            if not rest:
                continue
            c = {**c, "culprit": culprit_json(rest[0])}
        mine.append(c)
    own = [c for c in mine if (c.get("victim") or {}).get("pid") == pid]
    return own + [c for c in mine if c not in own]


def _top_host_chain(node: str, pid: int, chains: Sequence[dict[str, Any]],
                    peers: Iterable[int]) -> str:
    mine = host_chains(node, pid, chains, peers)
    if not mine:
        return "; no host chain on its node"
    return f"; top host chain on {node}: {chain_brief(mine[0])}"


# ---- failed NCCL calls: a chain and a warning ------------------------------------------


def failures(ctx: Context) -> tuple[list[Chain], list[str]]:
    """One ``nccl_failures`` chain per process whose NCCL calls returned an error, and a
    warning line for each: count per op and return code, with the NCCL error name."""
    v = ctx.view
    win = v.win
    where = ("WHERE ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? "
             f"AND op IN {in_list(NCCL_CODES)}")
    params = (win.start_ns, win.end_ns, v.node.lo, v.node.hi)
    calls: Counter[int] = Counter()
    errors: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for pid, op, ret, n, first in v.conn.execute(
            f"SELECT pid, op, ret, count(*), min(ts_ns) FROM event_data {where} "
            "GROUP BY pid, op, ret", params):
        calls[int(pid)] += int(n)
        if failed(int(ret)):
            errors[int(pid)].append((int(op), int(ret), int(n), int(first)))
    chains, warnings = [], []
    for pid, errs in sorted(errors.items()):
        # A failed communicator creation explains the failures after it: it leads.
        errs.sort(key=lambda e: (not name_of(e[0]).startswith(CREATES), -e[2], e[0], e[1]))
        n_failed = sum(e[2] for e in errs)
        by_error = [{"op": name_of(op), "ret": ret, "error": nccl_error(ret), "count": n}
                    for op, ret, n, _ in errs]
        items = [{"kind": "nccl_error", "op": name_of(op), "ret": ret,
                  "error": nccl_error(ret), "count": n, "ts_ns": first,
                  "time": format_ns(first),
                  "text": f"{name_of(op)} returned {ret} {nccl_error(ret)} {n} time(s), "
                          f"first at {format_ns(first)[11:]}"}
                 for op, ret, n, first in errs[:8]]
        items += _failed_calls(ctx, pid, where, params)
        share = n_failed / max(1, calls[pid])
        blocked = _longest_failed(ctx, pid, where, params)
        detail = {"failed": n_failed, "calls": calls[pid], "by_error": by_error,
                  "longest_failed_ns": blocked}
        # Failing at once costs the job nothing by itself (the warning says it); failing
        # after holding the rank (a timed-out init, a collective that hung then broke)
        # is a stall the failure explains: then it weighs as the share that failed.
        impact = share if blocked >= FAILED_STALL_NS else 0.0
        ch = rule_chain(ctx, "nccl_failures", pid, name_of(errs[0][0]), 1.0, impact, items,
                        detail)
        chains.append(ch)
        listed = ", ".join(f"{e['op']} ret {e['ret']} {e['error']} x{e['count']}"
                           for e in by_error[:5])
        warnings.append(f"{v.node.name}: {n_failed} of {calls[pid]} NCCL call(s) of "
                        f"{v.names.get(pid) or 'pid'} (pid {pid}) failed: {listed}")
    return chains, warnings


def _longest_failed(ctx: Context, pid: int, where: str, params: tuple[int, ...]) -> int:
    row = ctx.view.conn.execute(
        f"SELECT max(dur_ns) FROM event_data {where} AND pid = ? "
        f"AND ret NOT IN {in_list(NOT_FAILED)}", (*params, pid)).fetchone()
    return int(row[0] or 0)


def _failed_calls(ctx: Context, pid: int, where: str, params: tuple[int, ...]
                  ) -> list[dict[str, Any]]:
    v = ctx.view
    rows = v.conn.execute(
        f"SELECT id, ts_ns, dur_ns, tid, op, ret FROM event_data {where} AND pid = ? "
        f"AND ret NOT IN {in_list(NOT_FAILED)} ORDER BY ts_ns LIMIT 3", (*params, pid))
    return [{"kind": "call", "id": v.node.event_id(k), "ts_ns": ts, "time": format_ns(ts),
             "dur_ns": dur, "tid": tid, "op": name_of(op),
             "text": f"{name_of(op)} returned {ret} {nccl_error(ret)} after {_dur(dur)}"}
            for k, ts, dur, tid, op, ret in rows]
