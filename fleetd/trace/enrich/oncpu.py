"""On-CPU samples of the traced threads: what the feeding thread does while it runs.

``bpf/oncpu.bpf.c`` takes a sample of whatever traced thread is on a CPU, ``hz`` times a
second per CPU (a software CPU-clock perf event): the thread, its native user stack, its
Python frames and whether its interpreter was collecting garbage. Here the samples are
drained from their own ring, symbolized while the process is alive (the same merge of
native and Python frames as the CUDA records' stacks, :mod:`fleetd.trace.enrich.stacks`) and
counted per (thread, stack): every ``interval_ns`` (a second) one ``cpu_sample`` event per
distinct (thread, stack) is written, ``a0`` samples, ``a1`` of them in the collector, ``bytes``
the sampling period. Storage grows with distinct stacks, not with samples.

Garbage collection is read from the interpreter's own state: the ``collecting`` flag of
the main interpreter's GC state (``PyInterpreterState.gc.collecting``), at an offset
measured per CPython version (3.10 to 3.12, ``tests/unit/pylayout_probe.c``-style
``offsetof``) or given by the interpreter's ``_Py_DebugOffsets`` (3.13). A sample in the
collector gets ``[garbage collection]`` as its innermost frame, so a flame graph shows
it; a run of such samples of one thread, no other sample of it between them, is one
``gc_pause`` event (start, estimated length, the stack that triggered it). Where the
interpreter has the USDT probes ``python:gc__start``/``gc__done`` (:mod:`fleetd.trace.
enrich.pyusdt`), each collection is measured instead, with its generation.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetd.store.catalog import op_code
from fleetd.store.schema import EventRow
from fleetd.store.writer import BatchWriter
from fleetd.trace.bpf.bpfsrc import CPU_SAMPLE, CPU_SAMPLE_SIZE, PY_FRAMES, PYFRAME, PYSTACK_HEAD
from fleetd.trace.bpf.decoder import StackRef
from fleetd.trace.bpf.ringbuf import Chunk, RingReader
from fleetd.trace.enrich import pydebug, pyframes
from fleetd.trace.enrich.pyusdt import GC_EVENT, GcProbes, load_bias
from fleetd.trace.enrich.stacks import PythonTargets, merge, stack_hash
from fleetd.trace.enrich.symbols import FunctionSymbols

log = logging.getLogger("fleetd.trace.enrich.oncpu")

OP_CPU_SAMPLE = op_code("cpu_sample")
OP_GC_PAUSE = op_code("gc_pause")
FL_CPU_GC = 1  # bpf/oncpu.bpf.c: the interpreter was collecting
GC_FRAME = "[garbage collection]"
DEFAULT_HZ = 49  # not a divisor of common timer rates: no lockstep with periodic work
# The counts are written every second: a GC storm or a hot loop that makes a rank late is
# seen by the watch's first cause ask (fleetd.fleet.straggle), a second or two after the
# samples were taken, not up to 5 s later when a CPU wait it caused was already named.
INTERVAL_NS = 1_000_000_000
# ...while the kernel's stack map (and the names resolved from its ids) is started afresh
# only every 5 s: each reset costs a delete per stored stack and a walk per stack seen again.
RESET_NS = 5_000_000_000
PY_DEEPER = 3  # FL_PY_DEEPER
GC_EVENT_KIND = 0x6763  # FL_GC_EVENT
# Consecutive GC samples of a thread belong to one pause while no more than this many
# periods lie between them (a sample can be missed while the thread is preempted).
PAUSE_GAP_PERIODS = 2.5
MAX_NAMES = 200_000  # Python frame names kept (a new code object at a reused address
# between intervals would keep a stale name at most this long; the cache is then reset)
# Offset of PyInterpreterState.gc.collecting, by offsetof against each version's own
# internal headers (3.10.13, 3.11.7 = Debian's 3.11.2, 3.12.1; 3.13.0's is 7600, read
# from _Py_DebugOffsets there instead).
GC_COLLECTING: dict[tuple[int, int], int] = {(3, 10): 816, (3, 11): 848, (3, 12): 312}

_PERF_TYPE_SOFTWARE = 1
_PERF_COUNT_SW_CPU_CLOCK = 0


def ring_pages(hz: int, ncpu: int | None = None) -> int:
    """Ring pages for about half a second of samples from every CPU (a power of two,
    64 at least): the consumer drains it on every poll, ten times a second."""
    cpus = ncpu or os.cpu_count() or 1
    need = cpus * max(hz, 1) * (CPU_SAMPLE_SIZE + 8) // 2 // 4096 + 1
    pages = 64
    while pages < need:
        pages *= 2
    return pages


@dataclass(slots=True)
class Sample:
    ts: int
    pid: int
    tid: int
    stack: int
    gc: bool
    py: list[tuple[int, int]]
    py_status: int
    kip: int = 0  # the kernel address it was interrupted at; 0: in user space


def parse(raw: bytes) -> Sample | None:
    """One ``struct fl_cpu_sample`` from the ring; None for a record of another size."""
    if len(raw) < CPU_SAMPLE_SIZE:
        return None
    ts, pid, tid, stack, flags, _cpu, _pad, kip = CPU_SAMPLE.unpack_from(raw, 0)
    n, status = PYSTACK_HEAD.unpack_from(raw, CPU_SAMPLE.size)
    at = CPU_SAMPLE.size + PYSTACK_HEAD.size
    py = [PYFRAME.unpack_from(raw, at + i * PYFRAME.size) for i in range(min(n, PY_FRAMES))]
    return Sample(ts, pid, tid, stack, bool(flags & FL_CPU_GC), py, status, kip)


@dataclass(slots=True)
class _Run:
    """A pause in progress: GC samples of one thread, back to back."""

    start: int
    last: int
    samples: int
    stack: int


@dataclass
class Counts:
    """Samples per (pid, tid, stack hash) since the interval began, and GC pauses."""

    period_ns: int
    interval_start: int = 0
    samples: dict[tuple[int, int, int], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0]))
    runs: dict[int, tuple[int, _Run]] = field(default_factory=dict)  # tid -> (pid, run)
    # (start, length, pid, tid, samples, stack hash, generation) of the pauses that ended
    pauses: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    exact: set[int] = field(default_factory=set)  # pids whose pauses come from USDT

    def add(self, s: Sample, h: int) -> None:
        """Count one symbolized sample (``h``: its stack's hash)."""
        c = self.samples[(s.pid, s.tid, h)]
        c[0] += 1
        c[1] += int(s.gc)
        if s.pid in self.exact:
            return  # its pauses are measured, not estimated
        got = self.runs.get(s.tid)
        if got is not None and (not s.gc or s.ts - got[1].last > self._gap()):
            self._close(s.tid)
            got = None
        if s.gc:
            if got is None:
                self.runs[s.tid] = (s.pid, _Run(s.ts, s.ts, 1, h))
            else:
                got[1].last, got[1].samples = s.ts, got[1].samples + 1

    def _gap(self) -> float:
        return PAUSE_GAP_PERIODS * self.period_ns

    def _close(self, tid: int) -> None:
        pid, run = self.runs.pop(tid)
        # The pause began up to half a period before its first sample and ended up to
        # half a period after its last: one period beyond the samples' span.
        self.pauses.append((run.start, run.last - run.start + self.period_ns, pid, tid,
                            run.samples, run.stack, -1))

    def close_stale(self, now: int) -> None:
        """End the pauses whose thread has had no sample for a while."""
        for tid, (_pid, run) in list(self.runs.items()):
            if now - run.last > self._gap():
                self._close(tid)

    def rows(self, end: int, to_wall: Callable[[int], int]) -> list[EventRow]:
        """The interval's ``cpu_sample`` rows and the pauses ended so far; resets both."""
        start = self.interval_start or end
        out: list[EventRow] = [
            (to_wall(start), max(0, end - start), pid, tid, OP_CPU_SAMPLE, 0, self.period_ns,
             0, n, gc, h)
            for (pid, tid, h), (n, gc) in self.samples.items()]
        out += [(to_wall(ts), dur, pid, tid, OP_GC_PAUSE, 0, 0, 0, n, gen, h)
                for ts, dur, pid, tid, n, h, gen in self.pauses]
        self.samples.clear()
        self.pauses.clear()
        self.interval_start = end
        return out


class CpuSampler:
    """Attaches the sampler, drains its ring, symbolizes and counts the samples, and
    writes the counts once per interval (and at the end)."""

    def __init__(self, bpf: Any, python: PythonTargets, symbols: FunctionSymbols, hz: int,
                 to_wall: Callable[[int], int], interval_ns: int = INTERVAL_NS) -> None:
        self.bpf, self.python, self.symbols, self.hz = bpf, python, symbols, hz
        self.to_wall, self.interval_ns = to_wall, interval_ns
        self._reset_at = 0  # monotonic ns: when the stack map was last started afresh
        self.stacks = bpf[b"fl_cpu_stacks"]
        self.gc_map = bpf[b"fl_cpu_gc"]
        self.counts = Counts(period_ns=1_000_000_000 // hz)
        self._reader: RingReader | None = None
        self._pending: list[bytes] = []
        self._hashes: dict[tuple[Any, ...], int] = {}  # sample key -> its stack's hash
        self._native_names: dict[tuple[int, int], list[tuple[str, str | None]]] = {}
        self._py_names: dict[tuple[int, int, int], str] = {}  # (pid, code, instr) -> name
        self._knames: dict[int, str] = {}  # kernel address -> "function (kernel)"
        self._places: dict[tuple[int, int], tuple[str | None, str | None, int]] = {}
        self._stored: set[int] = set()
        self._gc_done: set[int] = set()  # pids whose GC flag is known (or known absent)
        self.gc_problems: dict[int, str] = {}
        self.usdt = GcProbes(bpf)
        self.samples = 0
        self.unresolved = 0  # samples with no frame at all (counted as "[unknown]")
        self.rows_written = 0
        self.sampling = False  # the perf events are attached

    def attach(self, now_mono: int) -> None:
        self.resume()
        table = self.bpf[b"fl_rb_cpu"]
        try:
            self._reader = RingReader(table.map_fd, int(table.max_entries))
        except OSError as exc:  # read through BCC's callbacks instead
            log.info("on-CPU ring not mappable (%s); reading it record by record", exc)
            pending, string_at = self._pending, ctypes.string_at

            def callback(_ctx: Any, data: int, size: int) -> int:
                pending.append(string_at(data, size))
                return 0

            table.open_ring_buffer(callback)
        self.counts.interval_start = self._reset_at = now_mono

    def pause(self) -> None:
        """Stop sampling (the perf events closed); the ring and the counts stay."""
        if self.sampling:
            self.bpf.detach_perf_event(ev_type=_PERF_TYPE_SOFTWARE,
                                       ev_config=_PERF_COUNT_SW_CPU_CLOCK)
            self.sampling = False

    def resume(self) -> None:
        """Sample on every CPU at ``hz``."""
        if not self.sampling:
            self.bpf.attach_perf_event(ev_type=_PERF_TYPE_SOFTWARE,
                                       ev_config=_PERF_COUNT_SW_CPU_CLOCK,
                                       fn_name=b"fl_cpu_sample", sample_freq=self.hz)
            self.sampling = True

    # ---- the interpreter's GC flag ---------------------------------------------------

    def refresh_gc(self) -> None:
        """Tell the kernel where each new Python target keeps its GC "collecting" flag."""
        for pid, interp in list(self.python.interps.items()):
            if pid in self._gc_done or interp is None or interp.layout is None \
                    or interp.problem:
                continue
            self._gc_done.add(pid)
            try:
                addr = collecting_address(interp)
            except (OSError, struct.error, KeyError, pydebug.DebugOffsetsError) as exc:
                self.gc_problems[pid] = f"GC state unreadable: {exc}"
                continue
            if addr is None:
                self.gc_problems[pid] = f"{interp.label}: no known GC state offset"
            else:
                self.gc_map[ctypes.c_uint32(pid)] = ctypes.c_uint64(addr)
            bias = load_bias(pid, interp.path)
            if bias is not None and self.usdt.follow(pid, interp.path, bias):
                self.counts.exact.add(pid)
        for gone in self._gc_done - set(self.python.interps):
            self._gc_done.discard(gone)
            with contextlib.suppress(KeyError):
                del self.gc_map[ctypes.c_uint32(gone)]

    # ---- samples -------------------------------------------------------------------

    def drain(self, writer: BatchWriter) -> int:
        """Count what the ring holds; new stacks go to the store now (symbolized while
        their process is alive). Returns the samples taken."""
        raws: list[bytes] = []
        if self._reader is not None:
            if not self._reader.available():
                return 0
            chunks: list[Chunk] = []
            self._reader.drain(chunks, None)
            raws = [c.raw for c in chunks if c.count == 0]
        else:
            self.bpf.ring_buffer_consume()
            raws, self._pending[:] = self._pending[:], []
        new: list[tuple[int, list[str]]] = []
        for raw in raws:
            s = parse(raw)
            if s is not None:
                self.counts.add(s, self._hash(s, new))
            elif len(raw) >= GC_EVENT.size:  # an exact collection (USDT)
                ts, dur, pid, tid, gen, kind = GC_EVENT.unpack_from(raw, 0)
                if kind == GC_EVENT_KIND:
                    self.counts.pauses.append((ts, dur, pid, tid, 0, 0, gen))
        self.samples += len(raws)
        if new:
            writer.add_stacks(new)
        return len(raws)

    def _kernel_frame(self, kip: int) -> str | None:
        """The kernel function a sample was taken in, as a frame (``name (kernel)``);
        None for a sample in user space. Named once per address."""
        if not kip:
            return None
        name = self._knames.get(kip)
        if name is None:
            if len(self._knames) > MAX_NAMES:
                self._knames.clear()
            try:
                sym = self.bpf.ksym(kip)
                name = sym.decode(errors="replace") if isinstance(sym, bytes) else str(sym)
            except Exception:  # no kallsyms to read (kptr_restrict): the place is unknown
                name = "[unknown]"
            self._knames[kip] = name = f"{name} (kernel)"
        return name

    def _hash(self, s: Sample, new: list[tuple[int, list[str]]]) -> int:
        kernel = self._kernel_frame(s.kip)
        key = (s.pid, s.stack, s.gc, kernel, s.py_status, *s.py)
        h = self._hashes.get(key)
        if h is None:
            frames = self.frames(s, kernel)
            h = stack_hash(frames)
            self._hashes[key] = h
            if h not in self._stored:
                self._stored.add(h)
                new.append((h, frames))
        return h

    def frames(self, s: Sample, kernel: str | None = None) -> list[str]:
        """The sample's stack, innermost first: the kernel function when it was taken in
        the kernel, native frames above the interpreter, then the Python frames
        (:func:`fleetd.trace.enrich.stacks.merge`); a sample in the collector starts with
        :data:`GC_FRAME`."""
        native = self._native(s.pid, s.stack) if s.stack >= 0 else []
        py = [self._py_name(s.pid, code, instr) for code, instr in s.py]
        if s.py_status == PY_DEEPER:
            py.append("... (more Python frames)")
        interp = self.python.interps.get(s.pid)
        frames = merge(native, py, interp.path.rsplit("/", 1)[-1] if interp else None)
        if not frames:
            self.unresolved += 1
            frames = ["[unknown]"]
        if kernel is not None:
            frames = [kernel, *frames]
        return [GC_FRAME, *frames] if s.gc else frames

    # A hot loop is sampled at the same few places again and again: each native stack
    # and each Python (code, instruction) is named once (naming one costs tens of us).

    def _native(self, pid: int, stack_id: int) -> list[tuple[str, str | None]]:
        key = (pid, stack_id)
        got = self._native_names.get(key)
        if got is not None:
            return got
        out: list[tuple[str, str | None]] = []
        try:
            for addr in self.stacks.walk(stack_id):
                name, lib, rel = self._locate(pid, addr)
                if lib is None:
                    break  # past the frame-pointer walk's last real frame
                out.append((f"{name or hex(rel)} ({lib})", lib))
        except Exception as exc:  # an id the map no longer holds, a process gone
            log.debug("stack %d of pid %d unreadable: %s", stack_id, pid, exc)
        self._native_names[key] = out
        return out

    def _locate(self, pid: int, addr: int) -> tuple[str | None, str | None, int]:
        key = (pid, addr)
        got = self._places.get(key)
        if got is None:
            if len(self._places) >= MAX_NAMES:
                self._places.clear()
            got = self._places[key] = self.symbols.locate(pid, addr)
        return got

    def _py_name(self, pid: int, code: int, instr: int) -> str:
        key = (pid, code, instr)
        got = self._py_names.get(key)
        if got is None:
            if len(self._py_names) >= MAX_NAMES:
                self._py_names.clear()
            named = self.python.frames(StackRef(0, pid, -1, [(code, instr)], 1))
            got = self._py_names[key] = named[0] if named else f"{code:#x} (python)"
        return got

    def maybe_flush(self, writer: BatchWriter, now_mono: int) -> None:
        if now_mono - self.counts.interval_start >= self.interval_ns:
            self.flush(writer, now_mono)

    def flush(self, writer: BatchWriter, now_mono: int, final: bool = False) -> None:
        """Write the interval's counts and the pauses that ended; at the end, every
        pause. Every RESET_NS, start the native stack map afresh: ids resolved so far are
        in the cache's hashes, and a full map would stop native stacks."""
        self.drain(writer)
        self.counts.close_stale(1 << 62 if final else now_mono)
        rows = self.counts.rows(now_mono, self.to_wall)
        if rows:
            writer.add_events(rows)
            self.rows_written += len(rows)
        if final or now_mono - self._reset_at >= RESET_NS:
            self._reset(now_mono)
        if final:
            self.usdt.close()  # the semaphores raised in the targets go back down

    def _reset(self, now_mono: int) -> None:
        self._reset_at = now_mono
        self.stacks.clear()
        self._hashes.clear()
        self._native_names.clear()  # the ids start again with the map


def collecting_address(interp: pyframes.Interpreter) -> int | None:
    """Where the main interpreter's GC "collecting" flag lives in the process; None for
    a version whose offset is not known."""
    lay = interp.layout
    if lay is None or not interp.runtime:
        return None
    mem = pyframes.Memory(interp.pid)
    try:
        if interp.version >= pyframes.DEBUG_OFFSETS_FROM:
            _hexv, _free, off = pydebug.parse(lambda n: mem.read(interp.runtime, n))
            offset: int | None = off["interpreter_state.gc"] + off["gc.collecting"]
        else:
            offset = GC_COLLECTING.get(interp.version)
        if offset is None:
            return None
        head = mem.u64(interp.runtime + lay.runtime_interp_head)
        return head + offset if head else None
    finally:
        mem.close()


def start_sampler(bpf: Any, python: PythonTargets, symbols: FunctionSymbols, hz: int,
                  to_wall: Callable[[int], int], warn: Callable[[str], None]
                  ) -> CpuSampler | None:
    """The sampler, attached; None, said once through ``warn``, where this machine has
    no CPU-clock perf events to give (a container without perf_event_open, a strict
    perf_event_paranoid): the rest of the trace goes on without on-CPU samples."""
    sampler = CpuSampler(bpf, python, symbols, hz, to_wall)
    try:
        sampler.attach(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    except Exception as exc:  # bcc raises bare Exception when perf_event_open fails
        warn(f"no on-CPU samples: the CPU-clock perf event could not be attached ({exc}); "
             "fleetd profile, gc_pause and host_cpu_bound need them")
        return None
    return sampler
