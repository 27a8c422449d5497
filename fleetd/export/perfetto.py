"""Chrome Trace Event JSON for ui.perfetto.dev and chrome://tracing, streamed.

Layout (docs/merge-export.md has the full description):

- one process per node, named ``node (rank N)``, ordered by rank then name;
- per traced thread a track named ``comm[pid]`` (``comm[pid] thread tid N`` for another
  thread of the process; args and markers name tasks the same way) with its CUDA calls
  (``X``; args op, ret, bytes, grid, block...), its off-CPU / run-queue / D-state
  intervals and syscalls (named ``read``, ``futex``...) nested under the calls they
  delay; wakeups and process lifecycle as thread instants;
- per node a *block I/O* and an *IRQ* track;
- slices of a track always nest (see :mod:`fleetd.export.lanes`): what cannot nest goes
  to an *overlap* lane just below;
- causal chains as global instants colored by severity, with root cause and fixes in
  args, and flow arrows from the culprit (its block I/O, or a marker on its thread where
  it ran or woke the victim) to the victim's delayed call (:mod:`fleetd.export.flows`);
- counters: CUDA calls per second from stored events, and from the in-kernel
  histograms when there are any (those count the calls that were sampled out too).

Timestamps are microseconds since ``origin_ns`` with exact nanosecond decimals (absolute
epoch microseconds would lose nanoseconds in a double and break nesting). Everything is
written as it is read: memory holds open slices and names, never the events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import orjson

from fleetd.export.clockfix import corrected
from fleetd.export.flows import FlowIds, NodeFlows
from fleetd.export.gpu import GpuTracks
from fleetd.export.lanes import Group
from fleetd.export.model import (
    ByteSink,
    ChainMark,
    ClockFix,
    ClockFixJson,
    EventRow,
    NodeTrace,
    task_name,
)
from fleetd.export.tracejson import json_text as _j
from fleetd.export.tracejson import us as _us
from fleetd.store.catalog import BY_NAME, CALLS, OPS
from fleetd.store.schema import SEQ_MASK
from fleetd.store.syscalls import syscall_name
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.export.perfetto")

LAYOUT_VERSION = 1
SYNTHETIC_TID = 1 << 22  # above Linux's largest pid_max: never a real tid
# Track order, kept within 32 bits for every viewer: a thread by its tid, its overlap
# lanes right below it, node-wide tracks (block I/O, IRQ) after every thread.
LANES_SORT = 64
NODE_TRACKS_SORT = SYNTHETIC_TID * LANES_SORT
GPU_TRACKS_SORT = NODE_TRACKS_SORT + (1 << 20)  # imported GPU streams, after node tracks
COUNTER_NS = 1_000_000_000
CHUNK = 2048  # lines per write
SOFTIRQS = ("HI", "TIMER", "NET_TX", "NET_RX", "BLOCK", "IRQ_POLL", "TASKLET", "SCHED",
            "HRTIMER", "RCU")

# What each op becomes: (kind, name as JSON, category, a0 key, a1 key). The keys are
# pre-formatted (',"grid_threads":') because they are written for most rows.
K_CALL, K_SCHED, K_RUNQ, K_INSTANT, K_BLOCK, K_IRQ, K_SYSCALL = range(7)
_KINDS: dict[int, tuple[int, str, str, str, str]] = {}
for _op in OPS:
    _kind = {"cuda": K_CALL, "graph": K_CALL, "driver": K_CALL, "nccl": K_CALL,
             "syscall": K_SYSCALL, "block": K_BLOCK, "irq": K_IRQ}.get(_op.source)
    if _op.name == "off_cpu":
        _kind = K_SCHED
    elif _op.name == "runq_wait":
        _kind = K_RUNQ
    elif _op.kind == "instant":
        _kind = K_INSTANT
    if _kind is not None:
        _KINDS[_op.code] = (_kind, orjson.dumps(_op.name).decode(), _op.source,
                            f',"{_op.a0}":' if _op.a0 else "", f',"{_op.a1}":' if _op.a1 else "")
SOFTIRQ = BY_NAME["softirq"].code
_CALL_CODES = CALLS.code_set


@dataclass(slots=True)
class NodeStats:
    name: str
    pid: int
    label: str
    events: int = 0
    slices: int = 0
    instants: int = 0
    skipped: int = 0  # rows of ops without a timeline shape (histogram-only ops, unknown)
    overlap_lanes: int = 0
    chains: int = 0
    flows: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    clock: ClockFixJson = field(default_factory=lambda: ClockFix().to_json())
    # Imported GPU timelines only (left out of the metadata when None): GPU slices,
    # annotated ranges and launch arrows written.
    gpu: dict[str, int] | None = None


class NodeStatsJson(TypedDict):
    """A node's :class:`NodeStats` as ``otherData.nodes[]`` writes them, in its order."""

    name: str
    pid: int
    label: str
    events: int
    slices: int
    instants: int
    skipped: int
    overlap_lanes: int
    chains: int
    flows: int
    first_ns: int | None
    last_ns: int | None
    clock: ClockFixJson
    gpu: NotRequired[dict[str, int]]


def _stats_json(s: NodeStats) -> NodeStatsJson:
    d: NodeStatsJson = {
        "name": s.name, "pid": s.pid, "label": s.label, "events": s.events,
        "slices": s.slices, "instants": s.instants, "skipped": s.skipped,
        "overlap_lanes": s.overlap_lanes, "chains": s.chains, "flows": s.flows,
        "first_ns": s.first_ns, "last_ns": s.last_ns, "clock": s.clock}
    if s.gpu is not None:  # recorded nodes keep the metadata they always had
        d["gpu"] = s.gpu
    return d


class Written:
    """How many trace events are written so far: a progress line reads it while the
    exporter runs (ints are replaced whole, so another thread reads a valid count)."""

    def __init__(self) -> None:
        self.events = 0


class _Sink:
    """Comma-separated JSON lines, written in chunks."""

    def __init__(self, out: ByteSink, written: Written | None = None) -> None:
        self.out = out
        self.buf: list[str] = []
        self.first = True
        self.written = written or Written()

    def flush(self) -> None:
        if self.buf:
            text = ",\n".join(self.buf)
            self.out.write(text.encode() if self.first else (",\n" + text).encode())
            self.first = False
            self.written.events += len(self.buf)
            self.buf.clear()


def _approx(ns: int) -> str:
    """A clock error for the eye, three digits in its own unit: ``16 s``, ``3.5 ms``."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns} ns"


def _culprit_pids(chains: Iterable[ChainMark]) -> dict[int, int]:
    """tid -> pid of every culprit the chains name, from the chain and its evidence."""
    out: dict[int, int] = {}
    for c in chains:
        for who in (c.culprit, *(e.get("culprit") for e in c.evidence)):
            if isinstance(who, Mapping) and who.get("tid") and who.get("pid"):
                out.setdefault(int(who["tid"]), int(who["pid"]))
    return out


def node_label(name: str, ranks: Sequence[int]) -> str:
    r = sorted(set(ranks))
    if not r:
        return name
    if len(r) == 1:
        return f"{name} (rank {r[0]})"
    if r == list(range(r[0], r[-1] + 1)):
        return f"{name} (ranks {r[0]}-{r[-1]})"
    return f"{name} (ranks {','.join(map(str, r))})"


def sort_nodes(nodes: Iterable[NodeTrace]) -> list[NodeTrace]:
    """By lowest rank (nodes without one last), then name: the same order every time."""
    return sorted(nodes, key=lambda n: (min(n.ranks) if n.ranks else math.inf, n.name))


def write_trace(nodes: Sequence[NodeTrace], out: ByteSink, *, origin_ns: int,
                meta: Mapping[str, Any] | None = None, written: Written | None = None
                ) -> list[NodeStats]:
    """Write one timeline of ``nodes`` to ``out``; per-node statistics come back.
    ``written`` counts the trace events as they go out (for a progress line)."""
    sink = _Sink(out, written)
    out.write(b'{"displayTimeUnit":"ns","traceEvents":[\n')
    ids = FlowIds()
    stats = [_NodeExporter(sink, node, pid, origin_ns, ids).run()
             for pid, node in enumerate(sort_nodes(nodes), 1)]
    sink.flush()
    other = {
        "exporter": "fleetd", "layout_version": LAYOUT_VERSION, "origin_ns": origin_ns,
        "origin": format_ns(origin_ns), "ts_unit": "microseconds since origin",
        **(meta or {}), "nodes": [_stats_json(s) for s in stats],
    }
    out.write(b'\n],"otherData":' + orjson.dumps(other) + b"}\n")
    return stats


class _NodeExporter:
    def __init__(self, sink: _Sink, node: NodeTrace, pid: int, origin: int,
                 ids: FlowIds) -> None:
        self.sink, self.node, self.pid, self.origin = sink, node, pid, origin
        self.emit = sink.buf.append
        self.stats = NodeStats(node.name, pid, node_label(node.name, node.ranks),
                               clock=node.clock.to_json())
        self.groups: dict[int, Group] = {}  # tid -> its thread group
        self.node_groups: dict[str, Group] = {}
        self.next_tid = SYNTHETIC_TID
        self.labels: dict[int, str] = {}
        # A culprit that traced nothing itself (a CPU hog) is in no task table; its
        # chains still say which process it is, so args name it like its track.
        self.chain_pids = _culprit_pids(node.chains)
        self.event_prefix = _j(node.name)[:-1] + ":"
        self.args_cache: dict[str, str] = {}
        self.flows = NodeFlows(node, pid, origin, ids, self.emit, self.thread)
        self.ids = ids
        self.gpu = GpuTracks(node, pid, origin, self.emit, self.thread, self.named_group,
                             GPU_TRACKS_SORT, self._flush_full)

    def _flush_full(self) -> None:
        """Write the buffer out once it holds a chunk: memory stays flat over long passes."""
        if len(self.sink.buf) >= CHUNK:
            self.sink.flush()

    # ---- tracks --------------------------------------------------------------------

    def _meta(self, name: str, tid: int | None, args: Mapping[str, Any]) -> None:
        tid_part = "" if tid is None else f',"tid":{tid}'
        self.emit(f'{{"ph":"M","name":"{name}","pid":{self.pid}{tid_part},"args":{_j(args)}}}')

    def _track(self, tid: int, name: str, sort_index: int) -> None:
        self._meta("thread_name", tid, {"name": name})
        self._meta("thread_sort_index", tid, {"sort_index": sort_index})

    def _new_lane(self, g: Group) -> int:
        tid = self.next_tid
        self.next_tid += 1
        self.stats.overlap_lanes += 1
        self._track(tid, f"{g.name} (overlap {len(g.tids)})",
                    g.sort_base + min(len(g.tids), LANES_SORT - 1))
        return tid

    def thread(self, pid: int, tid: int) -> Group:
        g = self.groups.get(tid)
        if g is None:
            tpid, tname = self.node.threads.get(tid, (None, None))
            tpid = tpid if tpid is not None else pid
            name = task_name(self.node.processes.get(tpid), tpid, tname, tid)
            g = Group(name, tid * LANES_SORT, tid, self._new_lane)
            self._track(tid, name, g.sort_base)
            self.groups[tid] = g
        return g

    def node_group(self, name: str) -> Group:
        g = self.node_groups.get(name)
        if g is None:
            tid = self.next_tid
            self.next_tid += 1
            g = Group(name, NODE_TRACKS_SORT + len(self.node_groups) * LANES_SORT, tid,
                      self._new_lane)
            self._track(tid, name, g.sort_base)
            self.node_groups[name] = g
        return g

    def named_group(self, name: str, sort_index: int) -> Group:
        """A track of its own (a GPU stream, a thread's annotations), with overlap lanes."""
        tid = self.next_tid
        self.next_tid += 1
        g = Group(name, sort_index, tid, self._new_lane)
        self._track(tid, name, sort_index)
        return g

    def label(self, tid: int) -> str:
        """A task as args show it, as JSON, named like its track: ``"stress[2000]"``."""
        text = self.labels.get(tid)
        if text is None:
            if tid == 0:
                text = _j("idle[0]")  # the CPU's idle task (swapper)
            else:
                tpid, tname = self.node.threads.get(tid, (None, None))
                tpid = self.chain_pids.get(tid) if tpid is None else tpid
                comm = self.node.processes.get(tpid) if tpid is not None else None
                text = _j(task_name(comm, tpid, tname, tid))
            self.labels[tid] = text
        return text

    # ---- the stream ----------------------------------------------------------------

    def run(self) -> NodeStats:
        node = self.node
        label = self.stats.label
        self._meta("process_name", None, {"name": label})
        self._meta("process_sort_index", None, {"sort_index": self.pid})
        clock = node.clock
        self._meta("process_labels", None, {"labels": f"clock: {clock.source}" + (
            f" ±{_approx(clock.error_ns)}" if clock.error_ns is not None else "")})
        self.flows.write_chains(node.chains)
        self.gpu.reserve(self.ids.block)  # after the chains: their arrow ids stay put
        self._stream(corrected(node.events, clock))
        self._rates(node.rates)
        gpu = self.gpu
        gpu.write()
        self.sink.flush()
        flows = self.flows
        self.stats.chains, self.stats.flows = flows.chains, flows.arrows + gpu.arrows
        self.stats.slices += flows.markers + gpu.slices + gpu.annotations
        if gpu.slices or gpu.annotations:
            self.stats.gpu = {"gpu_slices": gpu.slices, "annotations": gpu.annotations,
                              "launch_arrows": gpu.arrows, "streams": len(gpu.streams)}
        return self.stats

    def _stream(self, events: Iterable[EventRow]) -> None:
        # One long loop on purpose: it runs once per event, and the common case (a CUDA
        # call nesting on its thread's own lane) stays inline, without calls.
        st = self.stats
        origin, pid_, emit = self.origin, self.pid, self.emit
        kinds, groups, thread = _KINDS, self.groups, self.thread
        buf, sink = self.sink.buf, self.sink
        evp = self.event_prefix
        flows = self.flows
        anchors, anchors_until, flow_ends = flows.anchors, flows.anchors_until, flows.ends
        waiting = flows.waiting  # victims' threads whose next call ends an arrow
        ai, next_anchor = 0, anchors[0].ts if anchors else math.inf
        call_codes = _CALL_CODES
        # Launch arrows of imported GPU work: only nodes with GPU rows pay for the check.
        gpu_launch = self.gpu.launch if self.gpu.launches else None
        bucket, count = None, 0
        n = skipped = slices = 0
        first = last = None
        for ev in events:
            rowkey, ts, dur, pid, tid, op, ret, nbytes, peer, a0, a1, stack, args = ev
            n += 1
            if ts >= next_anchor:
                ai = anchors_until(ts, ai)
                next_anchor = anchors[ai].ts if ai < len(anchors) else math.inf
            k = kinds.get(op)
            if k is None:
                skipped += 1
                continue
            if dur < 0:
                dur = 0  # a corrupt row must not break the nesting of its track
            if first is None:
                first = ts
            last = ts + dur
            kind, nm, cat, n0, n1 = k
            rel = ts - origin
            seq = rowkey & SEQ_MASK
            # Exact decimals, inline: this loop runs once per event.
            tsx = f"{rel // 1000}.{rel % 1000:03d}" if rel >= 0 else _us(rel)
            extra = f"{n0}{a0}" if a0 and n0 else ""
            if a1 and n1:
                extra += f"{n1}{a1}"
            if stack or args:
                extra += self._more(stack, args)
            if kind == K_CALL:
                g = groups.get(tid) or thread(pid, tid)
                end = ts + dur
                # The common case inline: the slice nests on the thread's own lane.
                open_ = g.stacks[0]
                while open_ and open_[-1] <= ts:
                    open_.pop()
                if not open_ or open_[-1] >= end:
                    open_.append(end)
                    lane = tid
                else:
                    lane = g.place(ts, end)
                # A launch recorded with its kernel is named after the kernel.
                sn = self._kernel(args) or nm if args and '"kernel"' in args else nm
                emit(f'{{"ph":"X","pid":{pid_},"tid":{lane},"ts":{tsx},'
                     f'"dur":{dur // 1000}.{dur % 1000:03d},"name":{sn},"cat":"{cat}",'
                     f'"args":{{"op":{nm},"ret":{ret},"bytes":{nbytes}{extra},'
                     f'"event":{evp}{seq}"}}}}')
                if waiting and tid in waiting:
                    flows.call_at(tid, lane, ts, dur)
                if gpu_launch is not None:
                    gpu_launch(seq, lane, ts, dur)
                if op in call_codes:
                    b = rel // COUNTER_NS
                    if b != bucket:
                        self._count(bucket, count, b)
                        bucket, count = b, 0
                    count += 1
            elif kind == K_INSTANT:
                lane = (groups.get(tid) or thread(pid, tid)).tids[0]
                who = f'"peer":{self.label(peer)},' if peer else ""
                emit(f'{{"ph":"i","s":"t","pid":{pid_},"tid":{lane},"ts":{tsx},'
                     f'"name":{nm},"cat":"{cat}","args":{{{who}"event":{evp}{seq}"{extra}}}}}')
                st.instants += 1
                continue
            else:
                lane = self._host(kind, op, ts, dur, pid, tid, a0, peer, tsx, extra, evp, seq,
                                  ret, nbytes)
            slices += 1
            if flow_ends and seq in flow_ends:
                flows.end_at(seq, lane, ts, dur)
            if len(buf) >= CHUNK:
                sink.flush()
        if anchors:
            anchors_until(math.inf, ai)
        self._count(bucket, count, None)
        st.events, st.skipped, st.slices = n, skipped, st.slices + slices
        if first is not None and last is not None:
            st.first_ns, st.last_ns = first, last

    def _host(self, kind: int, op: int, ts: int, dur: int, pid: int, tid: int, a0: int,
              peer: int, tsx: str, extra: str, evp: str, seq: int, ret: int,
              nbytes: int) -> int:
        """Scheduler, syscall, block I/O and IRQ intervals: less frequent than calls.
        ``extra`` is the row's named args, already as JSON members after a comma."""
        if kind == K_SYSCALL:
            # Named for the call it is (a0 holds its number); slow syscalls only.
            name, cat = syscall_name(a0), "syscall"
            args = f'"op":"syscall","ret":{ret},"bytes":{nbytes}{extra}'
            group = self.thread(pid, tid)
        elif kind == K_SCHED:
            state = a0 & 0xFF
            name = "preempted" if state == 0 else "D-state" if state & 2 else "sleeping"
            args = f'"state":"{"R" if state == 0 else "D" if state & 2 else "S"}",' \
                   f'"next":{self.label(peer)}'
            group, cat = self.thread(pid, tid), "sched"
        elif kind == K_RUNQ:
            name, cat = "run queue", "sched"
            args = f'"woken_by":{self.label(peer)}'
            group = self.thread(pid, tid)
        elif kind == K_BLOCK:
            name, cat = "block I/O", "block"
            args = f'"by":{self.label(tid)}{extra}'
            group = self.node_group("block I/O")
        else:
            name = (f"softirq {SOFTIRQS[a0] if 0 <= a0 < len(SOFTIRQS) else a0}"
                    if op == SOFTIRQ else f"hardirq {a0}")
            cat = "irq"
            args = f'"preempted":{self.label(tid)}{extra}'
            group = self.node_group("IRQ")
        lane = group.place(ts, ts + dur)
        self.emit(f'{{"ph":"X","pid":{self.pid},"tid":{lane},"ts":{tsx},"dur":{_us(dur)},'
                  f'"name":"{name}","cat":"{cat}","args":{{{args},"event":{evp}{seq}"}}}}')
        return lane

    def _more(self, stack: int, args: str | None) -> str:
        """The stack (hash, and frames where known) and stored args of a row, as extra
        args."""
        text = self._stack(stack) if stack else ""
        return text + self._args(args) if args else text

    def _stack(self, stack: int) -> str:
        """``"stack":hash`` and the frames, written once per distinct stack."""
        key = f"stack\0{stack}"
        got = self.args_cache.get(key)
        if got is None:
            got = f',"stack":"{stack & 0xFFFFFFFFFFFFFFFF:016x}"'
            frames = self.node.stacks.get(stack)
            if frames:
                got += ',"frames":' + orjson.dumps(list(frames)).decode()
            if len(self.args_cache) < 4096:
                self.args_cache[key] = got
        return got

    def _kernel(self, text: str) -> str | None:
        """The kernel name in a launch's args, as a JSON string (None: none)."""
        key = "kernel\0" + text
        got = self.args_cache.get(key)
        if got is None:
            try:
                obj = orjson.loads(text)
            except orjson.JSONDecodeError:
                obj = None
            name = obj.get("kernel") if isinstance(obj, dict) else None
            got = orjson.dumps(name).decode() if isinstance(name, str) and name else ""
            if len(self.args_cache) < 4096:
                self.args_cache[key] = got
        return got or None

    def _args(self, text: str) -> str:
        """A stored args object spliced in: parsed once per distinct text (launches of
        one kernel share theirs), so a corrupt row cannot break the JSON."""
        frag = self.args_cache.get(text)
        if frag is None:
            try:
                obj = orjson.loads(text)
            except orjson.JSONDecodeError:
                obj = {"args": text}
            if not isinstance(obj, dict):
                obj = {"args": obj}
            obj = {k: v for k, v in obj.items() if k not in ("op", "ret", "bytes", "event")}
            frag = "," + orjson.dumps(obj).decode()[1:-1] if obj else ""
            if len(self.args_cache) < 4096:
                self.args_cache[text] = frag
        return frag

    def _count(self, bucket: int | None, count: int, nxt: int | None) -> None:
        """Close a one-second bucket of CUDA calls; a gap drops the counter to zero."""
        if bucket is None:
            return
        name = '"CUDA calls/s (stored events)"'
        self.emit(f'{{"ph":"C","pid":{self.pid},"ts":{_us(bucket * COUNTER_NS)},'
                  f'"name":{name},"args":{{"calls":{count}}}}}')
        if nxt is None or nxt > bucket + 1:
            self.emit(f'{{"ph":"C","pid":{self.pid},"ts":{_us((bucket + 1) * COUNTER_NS)},'
                      f'"name":{name},"args":{{"calls":0}}}}')

    def _rates(self, rates: Iterable[tuple[int, int, int]]) -> None:
        name = '"CUDA calls/s (all, from histograms)"'
        prev_end: int | None = None
        last_ts: int | None = None
        fix = self.node.clock
        for ts, dur, calls in rates:
            t = fix.apply(ts) - self.origin
            if prev_end is not None and prev_end < t:
                self._rate_point(name, prev_end, 0)
            if last_ts is not None and t <= last_ts:
                continue  # overlapping windows: keep the counter's times increasing
            self._rate_point(name, t, round(calls * 1e9 / max(1, dur), 3))
            last_ts, prev_end = t, t + dur
        if prev_end is not None:
            self._rate_point(name, prev_end, 0)

    def _rate_point(self, name: str, rel: int, value: float) -> None:
        self.emit(f'{{"ph":"C","pid":{self.pid},"ts":{_us(rel)},"name":{name},'
                  f'"args":{{"calls":{value}}}}}')
