"""Causal chains on the timeline: one global instant per chain, and culprit-to-victim arrows.

Every chain that names a culprit puts a marker on the culprit's own track (created for
it when the culprit traced nothing itself, a CPU hog for instance) and an arrow from
there to the victim's *delayed call*: the slow call itself when the wait happened inside
it, else the victim's next call after the wait (a thread queued for the CPU between two
calls delays the second).

The tracks (:mod:`fleetd.export.perfetto`) are written as the events stream by, but an
arrow joins two slices that arrive at any point of that stream, or never (a ``--pid``
or ``--limit-per-node`` filter left one out). So the arrows are planned from the chains
before the stream starts, the culprits' marker slices are placed as the stream reaches
their time, and an arrow is written only once both of its ends exist. That bookkeeping
(flow ids, half-written arrows, markers) is this module's own; the per-event loop of the
tracks only calls into it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetd.export.lanes import Group
from fleetd.export.model import ChainMark, NodeTrace, task_name
from fleetd.export.tracejson import json_text as _j
from fleetd.export.tracejson import us as _us
from fleetd.store.catalog import CPU_WAITS
from fleetd.store.timeparse import format_ns

SEVERITY_COLOR = {"HIGH": "terrible", "MEDIUM": "bad", "LOW": "yellow"}  # catapult names
ANCHOR_WAKE_NS = 1_000  # a wakeup is an instant; its marker gets 1 us to carry an arrow
# Evidence of a culprit's act: the victim's wait, with who ran or woke it.
_WAIT_KINDS = CPU_WAITS.name_set

# (pid, tid) -> the track group of that thread, created on first use.
ThreadGroup = Callable[[int, int], Group]


class FlowIds:
    """Arrow ids, unique in the whole trace (nodes share one id space)."""

    def __init__(self) -> None:
        self._next = 1

    def take(self) -> int:
        return self.block(1)

    def block(self, n: int) -> int:
        """The first of ``n`` consecutive ids (the GPU launch arrows take theirs at once)."""
        first = self._next
        self._next += n
        return first


@dataclass(slots=True)
class Anchor:
    """A marker slice on a culprit's thread, where it ran instead of (or woke) the victim."""

    ts: int
    end: int
    pid: int
    tid: int
    name: str
    args: str
    flow: int


class NodeFlows:
    """One node's chains and arrows. ``emit`` writes a line of the trace; ``thread``
    finds a thread's track group, where a culprit's marker goes."""

    def __init__(self, node: NodeTrace, pid: int, origin: int, ids: FlowIds,
                 emit: Callable[[str], None], thread: ThreadGroup) -> None:
        self.node, self.pid, self.origin, self.ids = node, pid, origin, ids
        self.emit, self.thread = emit, thread
        self.ends: dict[int, list[tuple[int, str]]] = {}  # seq -> [(flow, 's'|'f')]
        # victim tid -> [(corrected time, flow)]: the thread's first call starting at or
        # after that time is the delayed call the arrow ends on.
        self.waiting: dict[int, list[tuple[int, int]]] = {}
        self.anchors: list[Anchor] = []  # in time order once the chains are written
        self._half: dict[int, str] = {}  # flow -> the line of its end written first
        self.chains = 0  # chain instants written
        self.arrows = 0  # arrows written with both ends
        self.markers = 0  # culprit marker slices written

    def write_chains(self, chains: Sequence[ChainMark]) -> None:
        """A global instant per chain, colored by severity; plans the chain's arrows."""
        fix = self.node.clock
        for c in chains:
            self.chains += 1
            args = {
                "id": c.id, "node": self.node.name, "severity": c.severity,
                "root_cause": c.root_cause, "summary": c.summary, "op": c.op,
                "victim": dict(c.victim), "culprit": dict(c.culprit) if c.culprit else None,
                "explained": c.explained, "impact": c.impact, "fixes": list(c.fixes),
                "time": format_ns(c.ts_ns) if c.ts_ns else None,
            }
            name = f"{c.severity} {c.root_cause} ({self.node.name})"
            self.emit(f'{{"ph":"i","s":"g","pid":{self.pid},"tid":0,'
                      f'"ts":{_us(fix.apply(c.ts_ns) - self.origin)},"name":{_j(name)},'
                      f'"cat":"chain","cname":"{SEVERITY_COLOR.get(c.severity, "grey")}",'
                      f'"args":{_j(args)}}}')
            self._plan(c)
        for pending in self.waiting.values():
            pending.sort()
        self.anchors.sort(key=lambda a: (a.ts, a.flow))

    def _plan(self, c: ChainMark) -> None:
        """Arrows from culprit to victim: from the culprit's own block I/O to the wait it
        caused, else from a marker on the culprit's thread to the victim's delayed call;
        a chain whose evidence names no act of the culprit gets one marker at its start."""
        victim_tid = int(c.victim.get("tid") or 0)
        with_io = {str(e.get("spike")) for e in c.evidence if e.get("kind") == "block_io"}
        calls = {str(e.get("id")): _seq(e.get("id")) for e in c.evidence
                 if e.get("kind") == "spike"}  # a slow call: the wait happened inside it
        waits: dict[str, int] = {}  # spike id -> seq of its D-state wait
        drawn = False
        for e in c.evidence:
            kind, who, seq = e.get("kind"), e.get("culprit"), _seq(e.get("id"))
            spike = str(e.get("spike"))
            if not who or (kind not in _WAIT_KINDS and kind != "block_io"):
                continue
            if kind == "off_cpu" and spike in with_io:
                if e.get("state") == "D" and seq is not None:
                    waits.setdefault(spike, seq)
            elif kind == "block_io" and spike in waits and seq is not None:
                self._link(seq, waits[spike])
                drawn = True
            elif kind in _WAIT_KINDS and "ts_ns" in e:
                drawn |= self._anchor(c, e, who, victim_tid, calls.get(spike))
        if not drawn and c.culprit and c.ts_ns:
            self._chain_anchor(c, victim_tid)

    def _anchor(self, c: ChainMark, e: Mapping[str, Any], who: Mapping[str, Any],
                victim_tid: int, call_seq: int | None) -> bool:
        """A marker where the culprit ran instead of (or woke) the victim; False when
        there is no culprit thread to mark."""
        tid = int(who.get("tid") or who.get("pid") or 0)
        if tid in (0, victim_tid):
            return False  # the CPU's idle task, or the victim itself: no arrow to draw
        fix = self.node.clock
        ts, dur = fix.apply(int(e["ts_ns"])), int(e.get("dur_ns") or 0)
        victim = _victim_name(c)
        if e.get("state") == "R" or e.get("kind") == "runq_wait":
            # It ran while the victim waited for the CPU: the marker spans the wait.
            start, end = ts, ts + dur
            name = f"ran while {victim} was " + (
                "preempted" if e.get("state") == "R" else "queued for the CPU")
        else:
            # A waker acts at the wakeup, the end of the wait (less any queueing).
            end = ts + dur
            start, name = end - min(dur, ANCHOR_WAKE_NS), f"woke {victim}"
        flow = self.ids.take()
        args = _j({"chain": c.id, "root_cause": c.root_cause, "victim_wait": e.get("id"),
                   "text": e.get("text")})
        self.anchors.append(Anchor(start, end, int(who.get("pid") or tid), tid, _j(name),
                                    args, flow))
        self._to_delayed_call(flow, int(e.get("tid") or victim_tid), ts, call_seq)
        return True

    def _chain_anchor(self, c: ChainMark, victim_tid: int) -> None:
        """The culprit's track for a chain whose evidence names no single act of it (a
        lock holder, a data producer): a marker at the chain's start, arrowed to the
        victim's next call."""
        cu = c.culprit or {}
        tid = int(cu.get("tid") or cu.get("pid") or 0)
        if tid in (0, victim_tid):
            return
        ts = self.node.clock.apply(c.ts_ns)
        flow = self.ids.take()
        name = f"culprit of {c.root_cause}: {_victim_name(c)} delayed"
        args = _j({"chain": c.id, "root_cause": c.root_cause, "text": c.summary})
        self.anchors.append(Anchor(ts, ts + ANCHOR_WAKE_NS, int(cu.get("pid") or tid), tid,
                                   _j(name), args, flow))
        self._to_delayed_call(flow, victim_tid, ts, None)

    def _to_delayed_call(self, flow: int, victim_tid: int, wait_ts: int,
                         call_seq: int | None) -> None:
        if call_seq is not None:
            self.ends.setdefault(call_seq, []).append((flow, "f"))
        elif victim_tid:
            self.waiting.setdefault(victim_tid, []).append((wait_ts, flow))

    def call_at(self, tid: int, lane: int, ts: int, dur: int) -> None:
        """A call of ``tid`` was written: arrows waiting for its next call end on it."""
        pending = self.waiting[tid]
        i = 0
        while i < len(pending) and pending[i][0] <= ts:
            self._endpoint(pending[i][1], "f", lane, ts, dur)
            i += 1
        if i:
            del pending[:i]
            if not pending:
                del self.waiting[tid]

    def _link(self, from_seq: int, to_seq: int) -> None:
        flow = self.ids.take()
        self.ends.setdefault(from_seq, []).append((flow, "s"))
        self.ends.setdefault(to_seq, []).append((flow, "f"))

    def anchors_until(self, ts: float, i: int) -> int:
        """Write the markers from ``anchors[i]`` that start by ``ts``; the next index."""
        anchors = self.anchors
        while i < len(anchors) and anchors[i].ts <= ts:
            a = anchors[i]
            lane = self.thread(a.pid, a.tid).place(a.ts, a.end)
            self.emit(f'{{"ph":"X","pid":{self.pid},"tid":{lane},"ts":{_us(a.ts - self.origin)},'
                      f'"dur":{_us(a.end - a.ts)},"name":{a.name},"cat":"chain",'
                      f'"args":{a.args}}}')
            self.markers += 1
            self._endpoint(a.flow, "s", lane, a.ts, a.end - a.ts)
            i += 1
        return i

    def end_at(self, seq: int, lane: int, ts: int, dur: int) -> None:
        """The slice of event ``seq`` was written on ``lane``: its arrow ends go there."""
        for flow, role in self.ends.pop(seq):
            self._endpoint(flow, role, lane, ts, dur)

    def _endpoint(self, flow: int, role: str, lane: int, ts: int, dur: int) -> None:
        """Both ends of an arrow are written once both slices exist: an arrow whose other
        end was filtered out (--pid, --limit-per-node) is dropped, never left dangling."""
        mid = ts + dur // 2 - self.origin  # inside the slice, so the arrow binds to it
        bp = ',"bp":"e"' if role == "f" else ""
        line = (f'{{"ph":"{role}","id":{flow},"pid":{self.pid},"tid":{lane},"ts":{_us(mid)},'
                f'"name":"culprit","cat":"chain"{bp}}}')
        other = self._half.pop(flow, None)
        if other is None:
            self._half[flow] = line
            return
        self.emit(other)
        self.emit(line)
        self.arrows += 1


def _victim_name(c: ChainMark) -> str:
    v = c.victim
    return task_name(v.get("comm"), v.get("pid"), v.get("thread"), int(v.get("tid") or 0))


def _seq(event_id: Any) -> int | None:
    """The seq of an event id ``node:seq`` (chain ids are not event ids: None)."""
    if not isinstance(event_id, str):
        return None
    _, _, tail = event_id.rpartition(":")
    return int(tail) if tail.isdigit() else None
