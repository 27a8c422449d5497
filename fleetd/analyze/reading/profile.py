"""On-CPU profiles: where the traced threads spent the time they ran.

The tracer samples every traced thread that is on a CPU ``hz`` times a second
(fleetd/trace/enrich/oncpu.py) and stores counts per (thread, stack) per interval as
``cpu_sample`` rows: ``a0`` samples, ``a1`` of them in the garbage collector, ``bytes``
the sampling period. Here they are summed over a window into stacks with counts, then
read three ways: the frames with the most samples (``self``: the innermost frame;
``total``: anywhere on the stack), the folded lines flame-graph tools take, and a
speedscope document. A sample stands for one period of CPU time, so ``samples x
period`` estimates the time on CPU, the figure the breakdown's ``running`` column
measures from the scheduler's side.
"""

from __future__ import annotations

import bisect
import re
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

from fleetd.analyze.reading.answers import CpuProfile, CpuStack, FlameStack, FlameStacks, FrameShare
from fleetd.analyze.reading.data import Node, code, in_list, json_or_text
from fleetd.analyze.reading.frames import folded, short_frame
from fleetd.analyze.reading.window import Window
from fleetd.store.sparse import sparse_only

CPU_SAMPLE = code("cpu_sample")
GC_FRAME = "[garbage collection]"  # fleetd.trace.enrich.oncpu.GC_FRAME
CUDA_LIBS = ("(libcudart", "(libcuda.", "(libnccl")  # native frames inside CUDA/NCCL
KERNEL_FRAME = " (kernel)"  # fleetd.trace.enrich.oncpu: a sample taken in the kernel
# Kernel functions a thread burns CPU in while another task holds a lock it wants: a
# mutex or rw-semaphore's optimistic spinning on its owner (a file's inode lock), and
# the queued spinlocks' slow paths. That time is a wait, not work of the thread's own.
LOCK_SPIN = re.compile(r"spin_on_owner|optimistic_spin|osq_lock|"
                       r"queued_(?:spin|read|write)_lock_slowpath")
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"


@dataclass(frozen=True, slots=True)
class StackCount:
    """One stack of one thread over the window: frames innermost first."""

    node: str
    pid: int
    tid: int
    frames: tuple[str, ...]
    samples: int
    gc: int  # of them in the garbage collector

    @property
    def kernel(self) -> str | None:
        """The kernel function the samples were taken in (their innermost frame, below
        the collector's mark); None for samples in user space."""
        inner = [f for f in self.frames[:2] if f != GC_FRAME][:1]
        return inner[0].removesuffix(KERNEL_FRAME) if inner and \
            inner[0].endswith(KERNEL_FRAME) else None

    @property
    def lock_spin(self) -> bool:
        """Taken while the thread spun in the kernel for a lock another task held."""
        k = self.kernel
        return k is not None and LOCK_SPIN.search(k) is not None

    @property
    def in_cuda(self) -> bool:
        """The sample hit inside a CUDA or NCCL library (a launch, a copy, a sync)."""
        return any(f.endswith(")") and any(lib in f for lib in CUDA_LIBS) for f in self.frames)


StackRow = tuple[int, int, int, int, int, int]  # pid, tid, stack, samples, gc, period


def stack_counts(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
                 tid: int | None = None) -> tuple[list[StackCount], int]:
    """One node's samples in the window per (thread, stack), and the sampling period
    (ns; 0 when nothing was sampled)."""
    return counts_of(conn, node, stack_rows(conn, node, win, pid, tid))


def stack_rows(conn: sqlite3.Connection, node: Node, win: Window, pid: int | None = None,
               tid: int | None = None) -> list[StackRow]:
    """The samples summed per (pid, tid, stack), in that order, each with its largest
    period: a part of them (one thread's) is that thread's :func:`counts_of`."""
    where = ("op = ? AND ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ?"
             f"{sparse_only((CPU_SAMPLE,))}")
    params: list[int] = [CPU_SAMPLE, win.start_ns, win.end_ns, node.lo, node.hi]
    if pid is not None:
        where += " AND pid = ?"
        params.append(pid)
    if tid is not None:
        where += " AND tid = ?"
        params.append(tid)
    return [(int(p), int(t), int(h or 0), int(n or 0), int(g or 0), int(b or 0))
            for p, t, h, n, g, b in conn.execute(
                f"SELECT pid, tid, stack, sum(a0), sum(a1), max(bytes) FROM event_data "
                f"WHERE {where} GROUP BY pid, tid, stack", params)]


def counts_of(conn: sqlite3.Connection, node: Node, rows: list[StackRow]
              ) -> tuple[list[StackCount], int]:
    """:func:`stack_rows`' rows as stacks with their frames, and their sampling period."""
    frames = _frames(conn, sorted({r[2] for r in rows if r[2]}))
    period = max((r[5] for r in rows), default=0)
    out = [StackCount(node.name, p, t, frames.get(h, ("[unknown]",)), n, g)
           for p, t, h, n, g, _ in rows]
    return [s for s in out if s.samples > 0], period


def samples_in_spans(conn: sqlite3.Connection, node: Node, win: Window, pid: int,
                     tid: int | None, spans: Sequence[tuple[int, int]]
                     ) -> list[tuple[StackCount, float]]:
    """The thread's stacks (``tid`` None: each thread's of the process) with the part
    of their samples that fell inside ``spans`` (sorted, disjoint [start, end) ranges;
    the GPU's idle gaps). The sampler stores a
    count per interval (1 s), not each sample's time, so each row's count is apportioned
    by the share of its interval the spans cover: a row whose interval meets no span
    gives none. Stacks with nothing inside are left out."""
    starts = [a for a, _ in spans]
    before = [0]  # span time before the i-th span starts
    for a, b in spans:
        before.append(before[-1] + (b - a))

    def upto(x: int) -> int:  # span time before x
        i = bisect.bisect_right(starts, x) - 1
        if i < 0:
            return 0
        a, b = spans[i]
        return before[i] + min(x, b) - a

    acc: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    only = "" if tid is None else f" AND tid = {int(tid)}"
    for t, ts, dur, h, n, g in conn.execute(
            "SELECT tid, ts_ns, dur_ns, stack, a0, a1 FROM event_data WHERE op = ? AND "
            f"ts_ns >= ? AND ts_ns < ? AND id BETWEEN ? AND ? AND pid = ?{only}"
            f"{sparse_only((CPU_SAMPLE,))}",
            (CPU_SAMPLE, win.start_ns, win.end_ns, node.lo, node.hi, pid)):
        lo, dur = int(ts), int(dur or 0)
        part = (upto(lo + dur) - upto(lo)) / dur if dur > 0 else 0.0
        c = acc[(int(t), int(h or 0))]
        c[0] += int(n or 0)
        c[1] += int(g or 0)
        c[2] += int(n or 0) * part
    frames = _frames(conn, sorted({h for _, h in acc if h}))
    return [(StackCount(node.name, pid, t, frames.get(h, ("[unknown]",)), int(n), int(g)), w)
            for (t, h), (n, g, w) in acc.items() if w > 0]


def _frames(conn: sqlite3.Connection, hashes: list[int]) -> dict[int, tuple[str, ...]]:
    out: dict[int, tuple[str, ...]] = {}
    for i in range(0, len(hashes), 500):  # bounded statements on a large profile
        for h, text in conn.execute("SELECT hash, frames FROM stacks WHERE hash IN "
                                    f"{in_list(hashes[i:i + 500])}"):
            value = json_or_text(text)
            out[int(h)] = tuple(str(f) for f in value) if isinstance(value, list) \
                else (str(value),)
    return out


def top_frames(stacks: list[StackCount], n: int = 10) -> list[FrameShare]:
    """The ``n`` frames with the most samples, by self then total. A frame that occurs
    twice on one stack (recursion) counts once there."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for s in stacks:
        if s.frames:
            own[s.frames[0]] += s.samples
        for f in set(s.frames):
            anywhere[f] += s.samples
    total = sum(s.samples for s in stacks) or 1
    ranked = sorted(anywhere, key=lambda f: (-own[f], -anywhere[f], f))[:n]
    return [FrameShare(frame=f, self_samples=own[f], total_samples=anywhere[f],
                       self_share=round(own[f] / total, 4),
                       total_share=round(anywhere[f] / total, 4)) for f in ranked]


def merged(stacks: list[StackCount]) -> dict[tuple[str, ...], int]:
    """Samples per stack, threads and nodes together, heaviest first."""
    acc: dict[tuple[str, ...], int] = defaultdict(int)
    for s in stacks:
        acc[s.frames] += s.samples
    return dict(sorted(acc.items(), key=lambda kv: (-kv[1], kv[0])))


def folded_lines(stacks: list[StackCount]) -> list[str]:
    """flamegraph.pl's input: one line per stack, outermost frame first, then the
    number of samples."""
    return [folded(list(frames), n) for frames, n in merged(stacks).items()]


FLAME_STACKS = 300  # distinct stacks a report carries for its flame graph
FLAME_DEPTH = 64  # frames per stack, outermost first
FLAME_CHARS = 256  # of a frame's text: a report's size stays bounded


def flame_stacks(stacks: list[StackCount]) -> FlameStacks:
    """The thread's stacks for a flame graph: the ``FLAME_STACKS`` heaviest, outermost
    frame first (base names cut at ``FLAME_CHARS``, at most ``FLAME_DEPTH``), with their
    samples; the rest are one ``[N other stacks]`` stack so the widths still add up to
    every sample."""
    ranked = list(merged(stacks).items())
    kept = [FlameStack(frames=[short_frame(f)[:FLAME_CHARS] for f in reversed(frames)]
                       [:FLAME_DEPTH] or ["[no frames]"], samples=n)
            for frames, n in ranked[:FLAME_STACKS]]
    rest = ranked[FLAME_STACKS:]
    if rest:
        kept.append(FlameStack(frames=[f"[{len(rest)} other stacks]"],
                               samples=sum(n for _, n in rest)))
    return FlameStacks(samples=sum(n for _, n in ranked), stacks=kept)


class SpeedscopeFrame(TypedDict):
    name: str


class SpeedscopeShared(TypedDict):
    frames: list[SpeedscopeFrame]


class SampledProfile(TypedDict):
    """speedscope's "sampled" profile: each sample a stack of frame indices."""

    type: Literal["sampled"]
    name: str
    unit: str
    startValue: int
    endValue: int
    samples: list[list[int]]
    weights: list[int]


# The speedscope file (https://www.speedscope.app/file-format-schema.json): its
# "$schema" key is no Python name, hence the functional form.
Speedscope = TypedDict("Speedscope", {
    "$schema": str, "exporter": str, "name": str, "activeProfileIndex": int,
    "shared": SpeedscopeShared, "profiles": list[SampledProfile]})


def speedscope(stacks: list[StackCount], name: str) -> Speedscope:
    """A speedscope file (its "sampled" profile type): frames listed once, each stack
    as indices outermost first, weighted by its samples."""
    index: dict[str, int] = {}
    samples: list[list[int]] = []
    weights: list[int] = []
    for frames, n in merged(stacks).items():
        samples.append([index.setdefault(short_frame(f), len(index))
                        for f in reversed(frames)])
        weights.append(n)
    return {
        "$schema": SPEEDSCOPE_SCHEMA, "exporter": "fleetd profile", "name": name,
        "activeProfileIndex": 0,
        "shared": {"frames": [{"name": f} for f in index]},
        "profiles": [{"type": "sampled", "name": name, "unit": "none", "startValue": 0,
                      "endValue": sum(weights), "samples": samples, "weights": weights}],
    }


def profile(stacks: list[StackCount], period_ns: int, top_n: int = 10) -> CpuProfile:
    """The summary a table or JSON answer shows."""
    n = sum(s.samples for s in stacks)
    note = None if n else ("no on-CPU samples in the window: the tracer samples with "
                           "--cpu-sample-hz (default 49; 0 turns it off), and only "
                           "threads of traced processes while they run")
    return CpuProfile(samples=n, gc_samples=sum(s.gc for s in stacks), period_ns=period_ns,
                   on_cpu_ns=n * period_ns, threads=len({(s.node, s.tid) for s in stacks}),
                   stacks=len(merged(stacks)), top=top_frames(stacks, top_n), note=note)


def stacks_json(stacks: list[StackCount], top_n: int, frames_n: int
                ) -> tuple[list[CpuStack], int]:
    """The ``top_n`` heaviest (thread, stack) counts as the node API answers them, at
    most ``frames_n`` frames each (innermost first), and how many were left out."""
    ranked = sorted(stacks, key=lambda s: (-s.samples, s.tid, s.frames))
    return [CpuStack(pid=s.pid, tid=s.tid, frames=list(s.frames[:frames_n]),
                      samples=s.samples, gc=s.gc) for s in ranked[:top_n]], \
        max(0, len(ranked) - top_n)
