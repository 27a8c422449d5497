"""A structural validator for the Chrome Trace Event JSON that fleetd export writes.

It checks what ui.perfetto.dev and chrome://tracing rely on, with exact decimals (a
float would hide a nanosecond overlap):

- the top-level object, known phases, the fields each phase requires;
- metadata: every process and thread is named exactly once, before its first event;
  process sort indexes increase in file order;
- per track (pid, tid): slices start in non-decreasing order and strictly nest;
- counters: per (pid, name), strictly increasing times and numeric values;
- flow arrows: one start and one end per id, each inside a slice of its track.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

PHASES = {"M", "X", "i", "C", "s", "f"}
META = {"process_name", "process_sort_index", "process_labels", "thread_name",
        "thread_sort_index"}


class TraceError(AssertionError):
    pass


@dataclass
class TraceSummary:
    phases: Counter[str] = field(default_factory=Counter)
    processes: dict[int, str] = field(default_factory=dict)
    threads: dict[tuple[int, int], str] = field(default_factory=dict)
    slices: dict[tuple[int, int], list[tuple[Decimal, Decimal, str]]] = field(
        default_factory=lambda: defaultdict(list))
    flows: int = 0
    markers: list[dict[str, Any]] = field(default_factory=list)
    other: dict[str, Any] = field(default_factory=dict)


def load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    obj = json.loads(raw, parse_float=Decimal)
    if not isinstance(obj, dict):
        raise TraceError("top level is not an object")
    return obj


def validate(trace: dict[str, Any]) -> TraceSummary:
    if not isinstance(trace.get("traceEvents"), list):
        raise TraceError("no traceEvents list")
    if trace.get("displayTimeUnit") not in ("ns", "ms"):
        raise TraceError(f"bad displayTimeUnit {trace.get('displayTimeUnit')!r}")
    s = TraceSummary(other=trace.get("otherData") or {})
    state = _State()
    for i, ev in enumerate(trace["traceEvents"]):
        try:
            _event(ev, s, state)
        except TraceError as exc:
            raise TraceError(f"event #{i} {ev}: {exc}") from None
    _check_flows(s, state)
    return s


@dataclass
class _State:
    sort_indexes: list[int] = field(default_factory=list)
    open: dict[tuple[int, int], list[Decimal]] = field(default_factory=lambda: defaultdict(list))
    last_start: dict[tuple[int, int], Decimal] = field(default_factory=dict)
    counters: dict[tuple[int, str], Decimal] = field(default_factory=dict)
    flow_ends: dict[int, dict[str, tuple[int, int, Decimal]]] = field(
        default_factory=lambda: defaultdict(dict))


def _need(ev: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in ev:
        raise TraceError(f"missing {key!r}")
    if not isinstance(ev[key], kind) or isinstance(ev[key], bool):
        raise TraceError(f"{key!r} has type {type(ev[key]).__name__}")
    return ev[key]


def _num(ev: dict[str, Any], key: str) -> Decimal:
    return Decimal(_need(ev, key, (int, Decimal)))


def _event(ev: dict[str, Any], s: TraceSummary, st: _State) -> None:
    ph = _need(ev, "ph", str)
    if ph not in PHASES:
        raise TraceError(f"unknown phase {ph!r}")
    s.phases[ph] += 1
    pid = _need(ev, "pid", int)
    if ph == "M":
        _meta(ev, pid, s, st)
        return
    name = _need(ev, "name", str)
    ts = _num(ev, "ts")
    if ph == "C":
        _counter(ev, pid, name, ts, st)
        return
    if ph == "i":
        scope = _need(ev, "s", str)
        if scope not in ("g", "p", "t"):
            raise TraceError(f"bad instant scope {scope!r}")
        if scope == "g":
            s.markers.append(ev)
            return
    tid = _need(ev, "tid", int)
    if pid not in s.processes:
        raise TraceError(f"pid {pid} used before its process_name")
    if (pid, tid) not in s.threads:
        raise TraceError(f"track {(pid, tid)} used before its thread_name")
    if ph == "X":
        _slice(ev, pid, tid, name, ts, s, st)
    elif ph in ("s", "f"):
        _need(ev, "cat", str)
        if ph == "f" and ev.get("bp") != "e":
            raise TraceError("flow end without bp=e")
        fid = _need(ev, "id", int)
        if ph in st.flow_ends[fid]:
            raise TraceError(f"flow {fid} has two {ph!r} events")
        st.flow_ends[fid][ph] = (pid, tid, ts)


def _meta(ev: dict[str, Any], pid: int, s: TraceSummary, st: _State) -> None:
    name = _need(ev, "name", str)
    if name not in META:
        raise TraceError(f"unknown metadata {name!r}")
    args = _need(ev, "args", dict)
    if name == "process_name":
        if pid in s.processes:
            raise TraceError(f"process {pid} named twice")
        s.processes[pid] = _need(args, "name", str)
    elif name == "process_sort_index":
        idx = _need(args, "sort_index", int)
        if st.sort_indexes and idx <= st.sort_indexes[-1]:
            raise TraceError("process sort indexes are not increasing")
        st.sort_indexes.append(idx)
    elif name == "thread_name":
        tid = _need(ev, "tid", int)
        tname = _need(args, "name", str)
        if (pid, tid) in s.threads:
            raise TraceError(f"thread {(pid, tid)} named twice")
        s.threads[(pid, tid)] = tname
    elif name == "thread_sort_index":
        _need(ev, "tid", int)
        if not 0 <= _need(args, "sort_index", int) < 2**31:
            raise TraceError("thread sort index does not fit 32 bits")


def _slice(ev: dict[str, Any], pid: int, tid: int, name: str, ts: Decimal, s: TraceSummary,
           st: _State) -> None:
    dur = _num(ev, "dur")
    _need(ev, "cat", str)
    _need(ev, "args", dict)
    if dur < 0:
        raise TraceError("negative duration")
    key = (pid, tid)
    if key in st.last_start and ts < st.last_start[key]:
        raise TraceError(f"slices of {key} out of order")
    st.last_start[key] = ts
    stack = st.open[key]
    end = ts + dur
    while stack and stack[-1] <= ts:
        stack.pop()
    if stack and stack[-1] < end:
        raise TraceError(f"slice {name} [{ts}, {end}) overlaps an open slice ending {stack[-1]}")
    stack.append(end)
    s.slices[key].append((ts, end, name))


def _counter(ev: dict[str, Any], pid: int, name: str, ts: Decimal, st: _State) -> None:
    args = _need(ev, "args", dict)
    if not args or not all(isinstance(v, int | Decimal) for v in args.values()):
        raise TraceError("counter args must be numbers")
    key = (pid, name)
    if key in st.counters and ts <= st.counters[key]:
        raise TraceError(f"counter {name} goes back in time")
    st.counters[key] = ts


def _check_flows(s: TraceSummary, st: _State) -> None:
    for fid, ends in st.flow_ends.items():
        if set(ends) != {"s", "f"}:
            raise TraceError(f"flow {fid} has only {sorted(ends)}")
        for ph, (pid, tid, ts) in ends.items():
            if not any(a <= ts <= b for a, b, _ in s.slices[(pid, tid)]):
                raise TraceError(f"flow {fid} {ph!r} at {ts} is not inside a slice of "
                                 f"{(pid, tid)}")
        s.flows += 1
