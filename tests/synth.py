"""Synthetic but realistic timelines, written through BatchWriter, diagnosed by explain.

Each scenario is a training loop (launches, a copy, a sync per step) with one injected
problem, laid out in time the way the tracer records it: an off-CPU interval inside the
call it delays, its run-queue tail, the wakeup with its waker, block requests under a
D-state wait, exact in-kernel histograms beside sampled call events. The quiet baseline
has the ordinary noise (short preemptions, IRQs, jitter, a rare slow call) and must not
yield a HIGH chain.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter

T0 = 1_750_000_000 * 10**9  # a recording from the past: --since must say so
MS, US = 1_000_000, 1_000
MAIN, STRESS, HALO, KWORKER = 1000, 2000, 3000, 55
MAIN_TID = MAIN
HALO_TID = 3001


@dataclass
class Timeline:
    """Events, histograms and names of one node, written in one go."""

    sample: int = 1  # store 1 in N ordinary launches, as the tracer samples them
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    events: list[tuple[int, ...]] = field(default_factory=list)
    hist: dict[tuple[int, int, int, int], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0]))
    procs: list[dict[str, Any]] = field(default_factory=list)
    task_rows: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    _tick: int = 0

    def process(self, pid: int, comm: str, ppid: int | None = None,
                threads: tuple[tuple[int, str], ...] = ()) -> None:
        self.procs.append({"pid": pid, "comm": comm, "ppid": ppid})
        self.task_rows.append((pid, pid, comm))
        self.task_rows += [(tid, pid, name) for tid, name in threads]

    def _h(self, ts: int, pid: int, op: int, value: int, bucket: int | None = None) -> None:
        win = (ts - T0) // 10**9
        b = bucket if bucket is not None else max(0, int(math.log2(max(1, value))))
        for key in ((win, pid, op, b), (win, pid, op, -1)):
            self.hist[key][0] += 1
            self.hist[key][1] += value

    def call(self, op: str, ts: int, dur: int, pid: int = MAIN, tid: int = MAIN_TID,
             nbytes: int = 0, always: bool = False) -> int:
        """A CUDA call: always in the histogram, stored when sampled, slow or special."""
        code = op_code(op)
        self._h(ts, pid, code, dur)
        self._tick += 1
        slow = dur > 8 * 10 * US
        if always or slow or self.sample == 1 or self._tick % self.sample == 0:
            self.events.append((ts, dur, pid, tid, code, 0, nbytes, 0, 0, 0, 0))
        return ts + dur

    def off_cpu(self, ts: int, dur: int, state: int, peer: int, tid: int = MAIN_TID,
                pid: int = MAIN, waker: int = 0, runq: int = 0) -> None:
        """Switch-out at ts, back at ts + dur; a sleeper's last ``runq`` ns were queued."""
        self.events.append((ts, dur, pid, tid, op_code("off_cpu"), 0, 0, peer, state, 0, 0))
        self._h(ts, pid, op_code("off_cpu"), dur)
        if state == 0:
            self.events.append((ts, dur, pid, tid, op_code("runq_wait"), 0, 0, peer, 0, 0, 0))
            self._h(ts, pid, op_code("runq_wait"), dur)
            return
        wake = ts + dur - runq
        if waker:
            self.events.append((wake, 0, pid, tid, op_code("wakeup"), 0, 0, waker, 0, 0, 0))
        if runq >= 50 * US:
            self.events.append((wake, runq, pid, tid, op_code("runq_wait"), 0, 0,
                                waker, state, 0, 0))
        self._h(wake, pid, op_code("runq_wait"), max(1, runq))

    def host(self, op: str, ts: int, dur: int, pid: int = MAIN, tid: int = MAIN_TID,
             a0: int = 0, nbytes: int = 0) -> None:
        self.events.append((ts, dur, pid, tid, op_code(op), 0, nbytes, 0, a0, 0, 0))
        self._h(ts, pid, op_code(op), dur)

    def pages(self, ts: int, pid: int, allocs: int, order: int = 0) -> None:
        key = ((ts - T0) // 10**9, pid, op_code("page_alloc"), order)
        self.hist[key][0] += allocs
        self.hist[key][1] += allocs << order
        tot = (key[0], pid, key[2], -1)
        self.hist[tot][0] += allocs
        self.hist[tot][1] += allocs << order

    def write(self, path: Path, node: str = "gpu-01") -> Path:
        self.events.sort()
        with BatchWriter(path, node) as w:
            w.add_processes(self.procs)
            w.add_tasks(self.task_rows)
            w.add_events(self.events)  # type: ignore[arg-type]
            w.add_aggregates([
                (1, T0 + win * 10**9, 10**9, pid, op, b, c, s)
                for (win, pid, op, b), (c, s) in sorted(self.hist.items())
            ])
        return path


Hook = Callable[[Timeline, int, int], int]


def training_loop(tl: Timeline, steps: int = 600, step_ns: int = 10 * MS,
                  launches: int = 20, sync_every: int = 10, gpu_ns: int = 2 * MS,
                  hook: Hook | None = None) -> None:
    """A steady loop; ``hook(tl, step, t)`` may add work and return the new time."""
    tl.process(MAIN, "python3", 1, ((MAIN_TID, "python3"),))
    rng = tl.rng
    for step in range(steps):
        t = T0 + step * step_ns
        for _ in range(launches):
            t = tl.call("cudaLaunchKernel", t, int(rng.uniform(6, 10) * US)) + 15 * US
        t = tl.call("cudaMemcpyAsync", t, int(rng.uniform(9, 12) * US), nbytes=4096) + 10 * US
        if hook:
            t = hook(tl, step, t)
        if step % sync_every == sync_every - 1:
            t = tl.call("cudaStreamSynchronize", t, int(gpu_ns * rng.uniform(0.9, 1.15)),
                        always=True)
        _noise(tl, step, T0 + step * step_ns, step_ns)


def _noise(tl: Timeline, step: int, t: int, step_ns: int) -> None:
    """What every machine does: short preemptions by a kworker, IRQs between calls."""
    rng = tl.rng
    if step % 7 == 0:
        at = t + step_ns - 2 * MS
        tl.off_cpu(at, int(rng.uniform(60, 120) * US), 0, KWORKER)
    if step % 11 == 0:
        tl.host("hardirq", t + step_ns - 1 * MS, 25 * US, a0=42)


def base(tl: Timeline) -> None:
    tl.process(STRESS, "stress", 1)
    tl.process(KWORKER, "kworker/u16:2", 2)


# ---- scenarios --------------------------------------------------------------------


def quiet(path: Path, sample: int = 1) -> Path:
    tl = Timeline(sample=sample)
    base(tl)

    def rare(tl: Timeline, step: int, t: int) -> int:
        # Two slow launches with nothing on the host: the GPU side, and tiny.
        return tl.call("cudaLaunchKernel", t, 90 * US) if step in (100, 400) else t

    training_loop(tl, hook=rare)
    return tl.write(path)


def cpu_hog(path: Path) -> Path:
    tl = Timeline()
    base(tl)

    def hog(tl: Timeline, step: int, t: int) -> int:
        if step % 4 != 0:
            return t
        t = tl.call("cudaStreamSynchronize", t, int(2 * MS * tl.rng.uniform(0.9, 1.1)),
                    always=True)
        # The sync is preempted by stress, pinned to the same core: the switch-out is
        # inside the call, and the call returns only after the hog's slice.
        slice_ns = int(tl.rng.uniform(3, 6) * MS)
        ts = t
        tl.off_cpu(ts + 200 * US, slice_ns, 0, STRESS)
        tl.call("cudaStreamSynchronize", ts, 2 * MS + slice_ns, always=True)
        return ts + 2 * MS + slice_ns

    training_loop(tl, hook=hog, sync_every=1)
    return tl.write(path)


def lock_wait(path: Path) -> Path:
    tl = Timeline()
    base(tl)
    tl.process(HALO, "halolet", 1, ((HALO_TID, "halolet-poll"),))

    def lock(tl: Timeline, step: int, t: int) -> int:
        if step % 5 != 0:
            return t
        wait = int(tl.rng.uniform(4, 7) * MS)
        tl.off_cpu(t + 5 * US, wait, 2, KWORKER, waker=HALO_TID, runq=60 * US)
        return tl.call("cudaLaunchKernel", t, wait + 20 * US)

    training_loop(tl, hook=lock)
    return tl.write(path)


def block_stall(path: Path) -> Path:
    tl = Timeline()
    base(tl)

    def ckpt(tl: Timeline, step: int, t: int) -> int:
        if step % 50 != 25:
            return t
        wait = int(tl.rng.uniform(40, 70) * MS)
        tl.host("syscall", t, wait + 100 * US, a0=74)
        tl.off_cpu(t + 50 * US, wait, 2, 0, waker=KWORKER, runq=0)
        for i in range(4):
            tl.host("block_io", t + 60 * US + i * (wait // 4), wait // 4, a0=8,
                    nbytes=1 << 20)
        return t + wait + 200 * US

    training_loop(tl, hook=ckpt, step_ns=12 * MS)
    return tl.write(path)


def host_sync(path: Path) -> Path:
    tl = Timeline()
    base(tl)
    training_loop(tl, launches=5, sync_every=1, gpu_ns=7 * MS)
    return tl.write(path)


def alloc_churn(path: Path) -> Path:
    tl = Timeline()
    base(tl)

    def churn(tl: Timeline, step: int, t: int) -> int:
        t = tl.call("cudaMalloc", t, int(tl.rng.uniform(300, 600) * US), always=True)
        return tl.call("cudaFree", t + 50 * US, int(tl.rng.uniform(400, 900) * US),
                       always=True)

    training_loop(tl, hook=churn)
    return tl.write(path)


def graph_storm(path: Path) -> Path:
    tl = Timeline(sample=10)
    base(tl)
    tl.process(MAIN, "python3", 1)
    storms = [(150, 190), (330, 370), (480, 520)]
    for step in range(600):
        t = T0 + step * 10 * MS
        if any(a <= step < b for a, b in storms):
            if step % 4 == 0:  # re-capture: capture, instantiate, and few launches
                t = tl.call("cudaStreamBeginCapture", t, 20 * US, always=True)
                for _ in range(30):
                    t = tl.call("cudaLaunchKernel", t, 8 * US) + 5 * US
                t = tl.call("cudaStreamEndCapture", t, 200 * US, always=True)
                t = tl.call("cudaGraphInstantiate", t, int(tl.rng.uniform(25, 35) * MS),
                            always=True)
            continue
        for _ in range(3):
            t = tl.call("cudaGraphLaunch", t, int(tl.rng.uniform(8, 12) * US), always=True)
            t += 2 * MS
        _noise(tl, step, T0 + step * 10 * MS, 10 * MS)
    tl.call("cudaStreamBeginCapture", T0, 20 * US, always=True)  # the first, legit capture
    return tl.write(path)


WORKERS = tuple(range(5001, 5007))


def dataloader(path: Path) -> Path:
    tl = Timeline()
    base(tl)
    for w in WORKERS:
        tl.process(w, "pt_data_worker", MAIN)

    def fight(tl: Timeline, step: int, t: int) -> int:
        if step % 20 == 0:
            for w in WORKERS:
                tl.pages(t, w, 900)
        if step % 3 != 0:
            return t
        w = WORKERS[step % len(WORKERS)]
        slice_ns = int(tl.rng.uniform(2, 4) * MS)
        tl.off_cpu(t + 3 * US, slice_ns, 0, w)
        return tl.call("cudaMemcpyAsync", t, slice_ns + 20 * US, nbytes=1 << 20)

    training_loop(tl, hook=fight)
    return tl.write(path)


SCENARIOS: dict[str, Callable[[Path], Path]] = {
    "quiet": quiet, "cpu_hog": cpu_hog, "lock_wait": lock_wait, "block_stall": block_stall,
    "host_sync": host_sync, "alloc_churn": alloc_churn, "graph_storm": graph_storm,
    "dataloader": dataloader,
}


def build(name: str, tmp_path: Path) -> Path:
    return SCENARIOS[name](tmp_path / f"{name}.db")
