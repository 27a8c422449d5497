"""Causal chains on the timeline: one global instant per chain, and culprit-to-victim arrows.

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
from fleetd.export.model import ChainMark, NodeTrace
from fleetd.export.tracejson import json_text as _j
from fleetd.export.tracejson import us as _us
from fleetd.store.timeparse import format_ns

SEVERITY_COLOR = {"HIGH": "terrible", "MEDIUM": "bad", "LOW": "yellow"}  # catapult names
ANCHOR_WAKE_NS = 1_000  # a wakeup is an instant; its marker gets 1 us to carry an arrow

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
        self.anchors.sort(key=lambda a: (a.ts, a.flow))

    def _plan(self, c: ChainMark) -> None:
        """Arrows from culprit to victim: from the culprit's own block I/O to the wait it
        caused, else from a marker on the culprit's thread to the victim's wait."""
        victim_tid = int(c.victim.get("tid") or 0)
        with_io = {str(e.get("spike")) for e in c.evidence if e.get("kind") == "block_io"}
        waits: dict[str, int] = {}  # spike id -> seq of its D-state wait
        for e in c.evidence:
            kind, who, seq = e.get("kind"), e.get("culprit"), _seq(e.get("id"))
            spike = str(e.get("spike"))
            if seq is None or not who:
                continue
            if kind == "off_cpu" and spike in with_io:
                if e.get("state") == "D":
                    waits.setdefault(spike, seq)
            elif kind == "block_io" and spike in waits:
                self._link(seq, waits[spike])
            elif kind == "off_cpu":
                self._anchor(c, e, who, seq, victim_tid)

    def _anchor(self, c: ChainMark, e: Mapping[str, Any], who: Mapping[str, Any], seq: int,
                victim_tid: int) -> None:
        tid = int(who.get("tid") or 0)
        if tid in (0, victim_tid):
            return  # the CPU's idle task, or the victim itself: no arrow to draw
        fix = self.node.clock
        ts, dur = fix.apply(int(e["ts_ns"])), int(e.get("dur_ns") or 0)
        victim = f"{c.victim.get('comm')}[{c.victim.get('pid')}] tid {victim_tid}"
        if e.get("state") == "R":
            # The switch-out names who ran next; the marker spans the preemption.
            start, end, name = ts, ts + dur, f"ran while {victim} was preempted"
        else:
            # A waker acts at the wakeup, the end of the wait (less any queueing).
            end = ts + dur
            start, name = end - min(dur, ANCHOR_WAKE_NS), f"woke {victim}"
        flow = self.ids.take()
        args = _j({"chain": c.id, "root_cause": c.root_cause, "victim_wait": e.get("id"),
                   "text": e.get("text")})
        self.anchors.append(Anchor(start, end, int(who.get("pid") or tid), tid, _j(name),
                                    args, flow))
        self.ends.setdefault(seq, []).append((flow, "f"))

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


def _seq(event_id: Any) -> int | None:
    """The seq of an event id ``node:seq`` (chain ids are not event ids: None)."""
    if not isinstance(event_id, str):
        return None
    _, _, tail = event_id.rpartition(":")
    return int(tail) if tail.isdigit() else None
