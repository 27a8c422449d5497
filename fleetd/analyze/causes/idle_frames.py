"""What a thread ran while the GPU sat idle: on-CPU samples against an imported GPU
timeline.

The tracer's samples (:mod:`fleetd.analyze.reading.profile`) say what a thread ran; an imported
Kineto or nsys timeline (``gpu_data``) says when the process's GPUs were idle. Here the
two meet: the idle gaps (holes of at least ``MIN_GAP_NS`` between the union of the
process's kernels, copies and sets, on any of its devices, inside the time the thread
was sampled), the samples that fell in them, and their top frames by share of those
samples. The sampler stores a count per interval (1 s), not each sample's time, so each
interval's count is apportioned by the share of it the gaps cover: an interval that
meets no gap gives none. The time stated is ``samples x period`` (the sampler's own
accounting) over the idle time. ``host_cpu_bound`` and ``fleetd gpu``'s host-bound
verdict both read it.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence

from fleetd.analyze.causes.gpu_chains import MIN_GAP_NS, idle_gaps
from fleetd.analyze.reading.answers_chain import IdleFrames, TopFrame
from fleetd.analyze.reading.data import Node, code
from fleetd.analyze.reading.frames import is_python_frame, short_frame
from fleetd.analyze.reading.profile import StackCount, samples_in_spans
from fleetd.analyze.reading.window import Window
from fleetd.store.db import present_tables

TOP_FRAMES = 5
CPU_SAMPLE = code("cpu_sample")
_LINE = re.compile(r":\d+\)$")  # a Python frame's line: "f (file.py:12)" -> "f (file.py)"

Span = tuple[int, int]


def rank_frames(host: Sequence[tuple[StackCount, float]], total: float, n: int = TOP_FRAMES
                ) -> list[TopFrame]:
    """Where the (weighted) samples were, by function: the innermost Python frame of
    each sample (the user's code; a native frame above it is a call that code made), else
    the innermost frame. Each function is shown at its hottest line; ``share`` is of
    ``total``."""
    by: dict[str, float] = {}
    lines: dict[str, dict[str, float]] = {}
    for s, w in host:
        frames = list(s.frames)
        frame = next((f for f in frames if is_python_frame(f)), None) \
            or (frames[0] if frames else "[unknown]")
        func = _LINE.sub(")", frame)
        by[func] = by.get(func, 0) + w
        at = lines.setdefault(func, {})
        at[frame] = at.get(frame, 0) + w
    out: list[TopFrame] = []
    for func, w in sorted(by.items(), key=lambda kv: -kv[1])[:n]:
        hottest = max(lines[func].items(), key=lambda kv: kv[1])[0]
        samples: float = w if isinstance(w, int) else round(w, 2)
        out.append({"frame": short_frame(hottest), "where": hottest, "samples": samples,
                    "share": round(w / total, 4) if total > 0 else 0.0})
    return out


def sampled_span(conn: sqlite3.Connection, node: Node, win: Window, pid: int,
                 tid: int | None) -> tuple[Span, int] | None:
    """[first, last) of the thread's (or process's) sampler intervals in the window, and
    the sampling period; None without samples."""
    who, params = ("tid", tid) if tid is not None else ("pid", pid)
    first, last, period = conn.execute(
        f"SELECT min(ts_ns), max(ts_ns + dur_ns), max(bytes) FROM event_data WHERE op = ? "
        f"AND {who} = ? AND ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?",
        (CPU_SAMPLE, params, win.start_ns, win.end_ns, node.lo, node.hi)).fetchone()
    if first is None or not period:
        return None
    return (max(win.start_ns, int(first)), min(win.end_ns, int(last))), int(period)


def during_idle(conn: sqlite3.Connection, node: Node, win: Window, pid: int,
                tid: int | None = None) -> IdleFrames | None:
    """The idle gaps of process ``pid``'s GPUs and what thread ``tid`` (None: the thread
    of the process with the most samples outside CUDA calls in them) ran in them; None
    without a GPU timeline, gaps in the sampled time, or samples in them."""
    if not present_tables(conn, ("gpu_data",)):
        return None
    got = sampled_span(conn, node, win, pid, tid)
    if got is None:
        return None
    (lo, hi), period = got
    busy = [(int(t), int(t) + int(d)) for t, d in conn.execute(
        "SELECT ts_ns, dur_ns FROM gpu_data WHERE id BETWEEN ? AND ? AND pid = ? AND kind IN "
        "(1, 2, 3) AND ts_ns < ? AND ts_ns + dur_ns > ?", (node.lo, node.hi, pid, hi, lo))]
    gaps = idle_gaps(busy, lo, hi)
    if not gaps:
        return None
    weighted = samples_in_spans(conn, node, win, pid, tid, gaps)
    if tid is None:
        per: dict[int, float] = {}
        for s, w in weighted:
            if _host(s):
                per[s.tid] = per.get(s.tid, 0) + w
        if not per:
            return None
        tid = max(per.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        weighted = [(s, w) for s, w in weighted if s.tid == tid]
    inside = sum(w for _, w in weighted)
    if inside <= 0:
        return None
    idle_ns = sum(b - a for a, b in gaps)
    host = [(s, w) for s, w in weighted if _host(s)]
    host_w = sum(w for _, w in host)
    host_ns = round(host_w * period)
    share = min(1.0, host_ns / idle_ns)
    top = rank_frames(host, inside)
    hz = round(1e9 / period)
    lines = "; ".join(f"{f['frame']} {f['share']:.0%}" for f in top[:3])
    text = (f"the process's GPUs (imported timeline) sat idle {idle_ns / 1e6:.0f} ms in "
            f"{len(gaps)} gap(s) of at least {MIN_GAP_NS / 1e6:.1f} ms while thread {tid} "
            f"was sampled; it was on the CPU outside CUDA calls for about "
            f"{host_ns / 1e6:.0f} ms of that ({share:.0%}; {host_w:.1f} of the {inside:.1f} "
            f"samples at {hz} Hz that fell in the gaps, each sampling interval's count "
            "apportioned by the share of it the gaps cover); top frames while the GPU "
            f"idled: {lines or 'none outside CUDA calls'}")
    return {"tid": tid, "gaps": len(gaps), "idle_ns": idle_ns, "samples": round(inside, 2),
            "host_samples": round(host_w, 2), "host_ns": host_ns,
            "host_share_of_idle": round(share, 4), "period_ns": period, "top_frames": top,
            "share_from": "on_cpu_samples_apportioned", "text": text}


def _host(s: StackCount) -> bool:
    """A sample of the thread's own work: outside CUDA calls, the collector and kernel
    lock spinning (as host_cpu_bound counts it)."""
    return not s.in_cuda and not s.gc and not s.lock_spin
