"""The tracer's accounting: the session row, the loss counters, the aggregate rows.

:mod:`fleetd.trace.tracer` attaches probes and moves records from the ring buffers into
the store. Around that loop it keeps the books, and the rules for those books live
here: what the session row says (host, clock, rank, targets and libraries), what counts
as a lost event, and how the in-kernel histograms' running totals become one set of
aggregate rows per window. Nothing here attaches or polls; it reads BPF maps and the
tracer's own lists and returns rows, so the rules can be read (and changed) in one place.
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict

from fleetd import __version__
from fleetd.store.catalog import BY_NAME
from fleetd.store.schema import SCHEMA_VERSION
from fleetd.store.torchrun import TorchrunRanks
from fleetd.store.writer import WriterStats
from fleetd.trace.bpf.bpfsrc import COUNTERS, NBUCKETS
from fleetd.trace.bpf.mapwatch import MappingJSON
from fleetd.trace.bpf.probes import SPECS, AttachReport
from fleetd.trace.host import procinfo
from fleetd.trace.host.clock import ClockMap
from fleetd.trace.host.headers import HeaderRoute
from fleetd.trace.host.libs import Library

MAX_TARGETS_JSON = 1000
# The drops that count as lost events: records the kernel or the writer could not keep.
LOST_KEYS = ("cuda", "driver", "nccl", "sched", "sys", "calls_full", "writer_queue",
             "writer_failed", "cpu")

# Ops whose calls may be counted without a duration (entry-only launches).
ENTRY_ONLY_CODES = frozenset(BY_NAME[s.op].code for s in SPECS if s.entry_only)
# (session, ts_ns, dur_ns, pid, op, bucket, count, sum): one row of aggregate_data.
AggregateRow = tuple[int | None, int, int, int | None, int, int, int, int]
# Per bucket counts and sums, then count, sum and errors over all buckets.
_Totals = tuple[list[int], list[int], int, int, int]


# ---- losses --------------------------------------------------------------------------


def read_counters(bpf: Any) -> dict[str, int]:
    """The BPF side's counters (``fl_counters``), summed over CPUs."""
    table = bpf[b"fl_counters"]
    return {name: int(sum(table[ctypes.c_int(i)])) for i, name in enumerate(COUNTERS)}


def drops(counters: Mapping[str, int], writer: WriterStats | None) -> dict[str, int]:
    """Every kind of drop by name: ring and map losses in the kernel, then the writer's."""
    d = {k.removeprefix("lost_"): counters[k] for k in COUNTERS if k.startswith("lost_")}
    d["calls_full"] = counters["calls_full"]
    d["hist_full"] = counters["hist_full"]
    d["state_full"] = counters["state_full"]
    if writer is not None:
        d["writer_queue"] = writer.queue_dropped
        d["writer_failed"] = writer.failed_rows
    return d


def lost_total(drops: Mapping[str, int]) -> int:
    return sum(drops.get(k, 0) for k in LOST_KEYS)


# ---- in-kernel histograms -------------------------------------------------------------


class Histograms:
    """``fl_hist``'s running totals per (pid, op), as deltas per window: aggregate rows.

    bucket = floor(log2(ns)) (page_alloc: the order); -1 = totals (count, sum);
    -2 = calls that returned an error (count); -3 = calls counted without a duration
    (entry-only launches whose return was not sampled, fleetd.trace.bpf.modes): then -1's
    count is every call but its sum is an estimate, the timed calls' sum scaled to all
    of them, and the buckets hold only the timed calls (a uniform sample); -4 = the
    always-on mode's mark on a launch op: count = ns its probes were on in the window,
    sum = the window's ns, every other row of it already scaled by their ratio.
    """

    def __init__(self) -> None:
        self.window_start = 0  # CLOCK_MONOTONIC ns
        self._prev: dict[tuple[int, int], _Totals] = {}
        # The always-on mode: (window end, window ns) -> the launch probes' on-time in
        # it, None when on all along (fleetd.trace.dutycycle.DutyCycle.take_on_ns)
        self.launch_on: Callable[[int, int], int | None] | None = None

    def close_window(self, bpf: Any, session: int, to_wall: Callable[[int], int],
                     now_mono: int) -> list[AggregateRow]:
        """The rows of the window ending at ``now_mono``; the next window starts there."""
        start, dur = self.window_start, max(0, now_mono - self.window_start)
        ts = to_wall(start)
        rows: list[AggregateRow] = []
        on_ns = self.launch_on(now_mono, dur) if self.launch_on is not None else None
        for k, v in bpf[b"fl_hist"].items():
            key = int(k.value)
            pid, op = key >> 32, key & 0xFFFFFFFF
            counts, sums, total, total_sum, errors = self._delta((pid, op), v)
            if total <= 0:
                continue
            mine: list[AggregateRow] = []
            for b in range(NBUCKETS):
                if counts[b]:
                    mine.append((session, ts, dur, pid, op, b, counts[b], sums[b]))
            untimed = total - sum(counts) if op in ENTRY_ONLY_CODES else 0
            if untimed > 0:
                mine.append((session, ts, dur, pid, op, -3, untimed, 0))
                total_sum = _scaled_sum(total_sum, total - untimed, total)
            mine.append((session, ts, dur, pid, op, -1, total, total_sum))
            if errors:
                mine.append((session, ts, dur, pid, op, -2, errors, 0))
            if on_ns is not None and op in ENTRY_ONLY_CODES:
                mine = _duty_scaled(mine, on_ns)
            rows += mine
        self.window_start = now_mono
        return rows

    def _delta(self, key: tuple[int, int], v: Any) -> _Totals:
        """What one histogram gained since the last window (all of it the first time)."""
        now: _Totals = ([int(v.b[i].count) for i in range(NBUCKETS)],
                        [int(v.b[i].sum) for i in range(NBUCKETS)],
                        int(v.count), int(v.sum), int(v.errors))
        prev = self._prev.get(key)
        self._prev[key] = now
        if prev is None:
            return now
        return ([a - b for a, b in zip(now[0], prev[0], strict=True)],
                [a - b for a, b in zip(now[1], prev[1], strict=True)],
                now[2] - prev[2], now[3] - prev[3], now[4] - prev[4])


def _duty_scaled(rows: list[AggregateRow], on_ns: int) -> list[AggregateRow]:
    """One op's rows of a window in which its probes were on ``on_ns`` of it (the
    always-on mode): counts and sums scaled to the whole window (estimates), and a -4
    row (count = on_ns, sum = the window's ns) saying so."""
    if not rows:
        return rows
    dur = rows[0][2]
    f = dur / max(1, on_ns)
    out: list[AggregateRow] = [(se, ts, d, pid, op, b, round(c * f), round(s * f))
                               for se, ts, d, pid, op, b, c, s in rows]
    se, ts, d, pid, op = rows[0][:5]
    out.append((se, ts, d, pid, op, -4, on_ns, dur))
    return out


def _scaled_sum(timed_sum: int, timed: int, total: int) -> int:
    """The total time of ``total`` calls estimated from the ``timed`` ones among them
    (a uniform sample); 0 when none was timed, which the -3 row then says is unknown."""
    return timed_sum * total // timed if timed > 0 else 0


# ---- the session row -----------------------------------------------------------------


class TracedSet(Protocol):
    """What the session row reads of the tracer's configuration
    (:class:`fleetd.trace.tracer.TraceConfig`): named here, so that this module, which
    the tracer imports, does not import the tracer back."""

    @property
    def cgroups(self) -> list[str]: ...

    @property
    def system_wide(self) -> bool: ...

    @property
    def layers(self) -> frozenset[str]: ...

    @property
    def sample(self) -> int: ...


class LibraryJson(TypedDict):
    """One library in the session's ``targets``: where its probes went."""

    path: str
    kind: str
    found_by: str
    probes: int
    via: str | None  # multi | perf


class TargetsJson(TypedDict):
    """The session row's ``targets``: what is traced (docs/schema.md)."""

    pids: dict[str, str]  # pid -> how it became a target (named first)
    pids_total: int
    cgroups: list[str]
    system_wide: bool
    libraries: list[LibraryJson]
    layers: list[str]
    sample: int
    tracer_pid: int
    mapping: NotRequired[MappingJSON]  # probes before the first call (bpf.mapwatch)
    hidden_runtimes: NotRequired[dict[str, list[int]]]  # runtime path -> pids
    python: NotRequired[dict[str, str]]  # pid -> the interpreter followed, or why not


class SessionOpening(TorchrunRanks):
    """The session row as a session starts (session_data's columns)."""

    host: str
    kernel: str
    boot_id: str | None
    started_ns: int
    mono_offset_ns: int
    clock_error_ns: int
    clock_samples: list[list[int]]
    tool_version: str
    schema_version: int
    targets: TargetsJson
    headers_route: str | None
    command: str | None
    drops: dict[str, int]


class SessionProgress(TypedDict):
    """What a session row gains as it runs, and as it ends."""

    lost_events: int
    dropped_stacks: int
    sampled_out: int
    drops: dict[str, int]
    clock_samples: list[list[int]]
    clock_error_ns: int
    targets: TargetsJson
    ended_ns: NotRequired[int]
    end_reason: NotRequired[str]


def targets_json(cfg: TracedSet, targets: Mapping[int, str], libs: Iterable[Library],
                 report: AttachReport) -> TargetsJson:
    """What is traced: target pids by origin, cgroups, libraries and their probes."""
    # Named targets first; a fork-heavy workload must not make the row huge.
    pids = sorted(targets.items(), key=lambda kv: (kv[1] != "named", kv[0]))
    return {
        "pids": {str(p): o for p, o in pids[:MAX_TARGETS_JSON]},
        "pids_total": len(pids),
        "cgroups": cfg.cgroups,
        "system_wide": cfg.system_wide,
        "libraries": [
            {"path": lib.path, "kind": lib.kind, "found_by": lib.found_by,
             "probes": len(report.attached.get(lib.path, [])),
             "via": report.mechanism.get(lib.path)}
            for lib in libs
        ],
        "layers": sorted(cfg.layers),
        "sample": cfg.sample,
        # Explain names this process "the tracer" when it is the one that took the
        # CPU from a workload: the observer's own cost, shown rather than hidden.
        "tracer_pid": os.getpid(),
    }


def rank_of(pids: Iterable[int]) -> TorchrunRanks:
    """The distributed rank of the first target that has one (all None otherwise)."""
    for pid in pids:
        info = procinfo.rank_info(pid)
        if info["rank"] is not None:
            return info
    return {"rank": None, "local_rank": None, "world_size": None}


def opening_fields(clock: ClockMap, rank: TorchrunRanks, targets: TargetsJson,
                   route: HeaderRoute | None, command: str | None) -> SessionOpening:
    """The session row as a session starts."""
    first = clock.first
    return {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "boot_id": _boot_id(),
        "started_ns": time.time_ns(),
        "mono_offset_ns": first.offset_ns,
        "clock_error_ns": first.error_ns,
        "clock_samples": clock.as_json(),
        **rank,
        "tool_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "targets": targets,
        "headers_route": route.describe() if route else None,
        "command": command,
        "drops": {},
    }


def progress_fields(drops: dict[str, int], counters: Mapping[str, int], clock: ClockMap,
                    targets: TargetsJson, *, final: bool) -> SessionProgress:
    """What a session row gains as it runs; ``final``: and when it ended."""
    fields: SessionProgress = {
        "lost_events": lost_total(drops),
        "dropped_stacks": counters["stack_lost"],
        "sampled_out": counters["sampled_out"],
        "drops": drops,
        "clock_samples": clock.as_json(),
        "clock_error_ns": clock.error_ns,
        "targets": targets,
    }
    if clock.steps:  # the wall clock was stepped during the session (fleetd.trace.host.clock)
        fields["drops"] = {**drops, "clock_steps": len(clock.steps),
                           "clock_step_ns": clock.stepped_ns}
    if final:
        # On the session's own mapping, like its events (a stepped clock would not be).
        fields["ended_ns"] = clock.to_wall(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        fields["end_reason"] = "stopped"
    return fields


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
