"""The GPU side of a timeline: imported kernels, copies and sets on one track per device
and stream, the host's annotated ranges (profiler steps, NVTX, operators) beside their
thread, and an arrow from each launch call to the work it put on the GPU.

The launch calls are ordinary CUDA call slices, written by the per-event loop of
:mod:`fleetd.export.perfetto`; the GPU slices are written after that loop, from their own
time-ordered stream. An arrow joins the two, so its ids are handed out before the loop
starts: one per GPU row that names a launch (``NodeTrace.launches``, the launch seqs in
ascending order, duplicates kept: a graph launch starts many kernels). The loop writes an
arrow's start where the launch slice lands and marks it written; the GPU pass writes the
end only for a marked start, so an arrow whose launch was filtered out (window,
``--pid``, ``--limit-per-node``) is dropped, never left dangling. Memory: eight bytes and
one flag per GPU row that has a launch, never the rows themselves.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import NotRequired, TypedDict

from fleetd.export.lanes import Group
from fleetd.export.model import AnnotationRow, GpuRow, NodeTrace
from fleetd.export.tracejson import json_text as _j
from fleetd.export.tracejson import us as _us
from fleetd.store.schema import SEQ_MASK


class GpuSliceArgs(TypedDict):
    """A GPU slice's ``args`` in the trace (docs/export.md), in the order written."""

    kind: str
    device: int
    stream: int
    correlation: int
    bytes: NotRequired[int]
    collective: NotRequired[str]
    grid: NotRequired[list[int]]
    block: NotRequired[list[int]]
    launch: NotRequired[str]  # NODE:SEQ of the host call that launched it
    gpu: NotRequired[str]  # NODE:ID of the row: always written, after the others

GPU_KIND_NAMES = {1: "kernel", 2: "memcpy", 3: "memset", 4: "sync"}
ANNOTATION_KIND_NAMES = {1: "step", 2: "nvtx", 3: "user_annotation", 4: "cpu_op"}

# (track name, sort index) -> the group of a new synthetic track
NewGroup = Callable[[str, int], Group]
# (pid, tid) -> the group of that thread's track
ThreadGroup = Callable[[int, int], Group]


class GpuTracks:
    """One node's GPU tracks and launch arrows (see the module's docstring)."""

    def __init__(self, node: NodeTrace, pid: int, origin: int, emit: Callable[[str], None],
                 thread: ThreadGroup, new_group: NewGroup, gpu_sort: int,
                 flush: Callable[[], None] = lambda: None) -> None:
        self.node, self.pid, self.origin = node, pid, origin
        self.emit, self.thread, self.new_group = emit, thread, new_group
        self.flush = flush  # called after each slice: writes out a full buffer
        self.gpu_sort = gpu_sort  # sort index of the first GPU track; 64 apart
        self.launches = node.launches
        self.first_flow = 0
        self.started = bytearray(len(self.launches))  # 1: the arrow's start is written
        self.streams: dict[tuple[int, int, int], Group] = {}
        self.ranges: dict[int, Group] = {}  # tid -> the thread's annotation track
        self.slices = 0
        self.arrows = 0
        self.annotations = 0

    def reserve(self, take_block: Callable[[int], int]) -> None:
        """Take the arrow ids (one per launched GPU row) from the trace-wide id space."""
        if self.launches:
            self.first_flow = take_block(len(self.launches))

    # ---- during the event loop ------------------------------------------------------

    def launch(self, seq: int, lane: int, ts: int, dur: int) -> None:
        """A CUDA call slice was written: the start of each arrow from it, if any."""
        arr = self.launches
        i = bisect.bisect_left(arr, seq)
        mid = None
        while i < len(arr) and arr[i] == seq:
            if mid is None:
                mid = _us(ts + dur // 2 - self.origin)
            self.emit(f'{{"ph":"s","id":{self.first_flow + i},"pid":{self.pid},"tid":{lane},'
                      f'"ts":{mid},"name":"launch","cat":"gpu"}}')
            self.started[i] = 1
            i += 1

    # ---- after it ---------------------------------------------------------------------

    def write(self) -> None:
        self._annotations(self.node.annotations)
        self._gpu(self.node.gpu)

    def _annotations(self, rows: Iterable[AnnotationRow]) -> None:
        fix = self.node.clock
        for rowkey, ts, dur, pid, tid, kind, name in rows:
            ts = fix.apply(ts)
            dur = max(0, dur)
            g = self.ranges.get(tid)
            if g is None:
                base = self.thread(pid, tid)
                g = self.ranges[tid] = self.new_group(f"{base.name} annotations",
                                                      base.sort_base + 63)
            lane = g.place(ts, ts + dur)
            args = {"kind": ANNOTATION_KIND_NAMES.get(kind, str(kind)),
                    "annotation": f"{self.node.name}:{rowkey & SEQ_MASK}"}
            self.emit(f'{{"ph":"X","pid":{self.pid},"tid":{lane},"ts":{_us(ts - self.origin)},'
                      f'"dur":{_us(dur)},"name":{_j(name)},"cat":"annotation",'
                      f'"args":{_j(args)}}}')
            self.annotations += 1
            self.flush()

    def _gpu(self, rows: Iterable[GpuRow]) -> None:
        fix = self.node.clock
        arr, started = self.launches, self.started
        pending: dict[int, int] = {}  # launch seq -> its next arrow slot (graph launches)
        for row in rows:
            (rowkey, ts, dur, pid, device, stream, kind, name, corr, launch, nbytes,
             collective, *dims) = row
            ts = fix.apply(ts)
            dur = max(0, dur)
            lane = self._stream_group(pid, device, stream).place(ts, ts + dur)
            args: GpuSliceArgs = {"kind": GPU_KIND_NAMES.get(kind, str(kind)),
                                    "device": device, "stream": stream, "correlation": corr}
            if nbytes:
                args["bytes"] = nbytes
            if collective:
                args["collective"] = collective
            if any(dims):
                args["grid"], args["block"] = dims[:3], dims[3:]
            if launch:
                args["launch"] = f"{self.node.name}:{launch}"
            args["gpu"] = f"{self.node.name}:{rowkey & SEQ_MASK}"
            self.emit(f'{{"ph":"X","pid":{self.pid},"tid":{lane},"ts":{_us(ts - self.origin)},'
                      f'"dur":{_us(dur)},"name":{_j(name)},"cat":"gpu","args":{_j(args)}}}')
            self.slices += 1
            self.flush()
            if launch and arr:
                slot = pending.pop(launch, None)
                if slot is None:
                    slot = bisect.bisect_left(arr, launch)
                if slot + 1 < len(arr) and arr[slot + 1] == launch:
                    pending[launch] = slot + 1
                if slot < len(arr) and arr[slot] == launch and started[slot]:
                    self.emit(f'{{"ph":"f","id":{self.first_flow + slot},"pid":{self.pid},'
                              f'"tid":{lane},"ts":{_us(ts + dur // 2 - self.origin)},'
                              f'"name":"launch","cat":"gpu","bp":"e"}}')
                    self.arrows += 1

    def _stream_group(self, pid: int, device: int, stream: int) -> Group:
        key = (pid, device, stream)
        g = self.streams.get(key)
        if g is None:
            comm = self.node.processes.get(pid)
            owner = f"{comm or 'pid'}[{pid}]" if pid else "unknown process"
            g = self.new_group(f"GPU {device} stream {stream} · {owner}",
                               self.gpu_sort + 64 * len(self.streams))
            self.streams[key] = g
        return g

