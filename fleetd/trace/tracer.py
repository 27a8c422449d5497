"""The Tracer: load the BPF programs, attach, stream records into the node store.

Life cycle: ``start()`` checks the environment, compiles (header ladder), fills the
in-kernel target set, attaches uprobes to every CUDA library the targets map and
opens one ring buffer per layer, mapped into this process (:mod:`fleetd.trace.ringbuf`);
``poll()`` takes what the rings hold in bulk, decodes it in bulk into the batch writer
and, about once a second, does the bookkeeping (new targets from fork/cgroup/
system-wide discovery, newly mapped libraries, clock re-sampling, in-kernel
histograms into aggregate rows, session counters); ``stop()`` freezes the BPF side,
drains what is left, writes the final aggregates and session record, and closes.

Every loss is counted: ring-buffer reserve failures and full maps (kernel counters),
rows the writer refused or failed to write. The session row carries them all; what it
says, and how losses and histograms are counted, is :mod:`fleetd.trace.accounting`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.errors import TraceError, UsageError
from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter, WriterStats
from fleetd.trace import accounting, procinfo
from fleetd.trace.bpfsrc import (
    HOST_PARTS,
    RINGS,
    TARGET_SLOTS,
    ProgramOptions,
    compile_program,
    detach_all,
)
from fleetd.trace.cgroups import ThrottleSampler, process_placement
from fleetd.trace.clock import ClockMap
from fleetd.trace.decoder import OP_EXEC, OP_EXIT, OP_FORK, Batch, Decoder, Lifecycle
from fleetd.trace.dutycycle import DutyCycle
from fleetd.trace.headers import HeaderRoute
from fleetd.trace.libs import (
    LAYER_OF_KIND,
    Library,
    all_mapped_libraries,
    exported_functions,
    mapped_libraries,
    override_libraries,
    search_usual_places,
)
from fleetd.trace.memory import KernelWork, MemorySampler, leftover_runs
from fleetd.trace.modes import LAUNCH_RETURNS
from fleetd.trace.oncpu import DEFAULT_HZ, CpuSampler, ring_pages, start_sampler
from fleetd.trace.preflight import ensure_tracefs as ensure_tracefs
from fleetd.trace.preflight import preflight
from fleetd.trace.probes import Attacher, AttachReport
from fleetd.trace.ringbuf import Chunk, RingReader
from fleetd.trace.stacks import KernelNames, PythonTargets, StackResolver, WaitChannels
from fleetd.trace.symbols import FunctionSymbols, LockNames

log = logging.getLogger("fleetd.trace.tracer")

GPU_LAYERS = ("cuda", "driver", "nccl")
# Bytes taken from one ring per poll: bounds a batch (and the time it holds the GIL)
# when a ring is full; whatever is left is taken on the next poll, at once.
DRAIN_BYTES = 4 << 20
STAGES = ("poll", "decode", "enrich", "queue")
_ORIGIN = {1: "named", 2: "cgroup", 3: "cuda-user", 4: "child"}


@dataclass
class TraceConfig:
    db: Path
    node: str
    pids: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    cuda_libs: list[str] = field(default_factory=list)
    layers: frozenset[str] = frozenset((*GPU_LAYERS, "host"))
    host_parts: frozenset[str] = frozenset(HOST_PARTS)
    sample: int = 100
    slow_k: int = 8
    slow_min_ns: int = 20_000
    err_burst: int = 10
    stacks: bool = False
    stack_sample: int = 100  # with stacks: 1 in N kept calls carries one ...
    stack_slow_ns: int = 1_000_000  # ... and every call at least this long
    # ... and the waker's on a wakeup by a followed Python thread, at most once per
    # (waker, woken) thread pair per this many ns (None: never)
    wake_stack_ns: int | None = 20_000_000
    ring_pages: int = 256
    thresholds_ns: dict[str, int] = field(default_factory=lambda: {
        "offcpu": 50_000, "runq": 50_000, "irq": 20_000, "syscall": 1_000_000,
        "block": 10_000_000,
    })
    agg_interval_ns: int = 10_000_000_000
    max_db_bytes: int | None = None
    command: str | None = None
    follow_children: bool = True
    cpu_sample_hz: int = DEFAULT_HZ  # on-CPU samples per second per CPU; 0: off
    # False: launch-type calls traced at entry, their returns sampled (fleetd.trace.modes)
    launch_returns: bool = LAUNCH_RETURNS
    # "always-on": launch probes only duty_on_ns of every aggregate window (dutycycle.py)
    mode: str = "full"
    duty_on_ns: int = 1_000_000_000

    @property
    def system_wide(self) -> bool:
        return not self.pids and not self.cgroups


@dataclass
class TraceSummary:
    session: int
    records: int
    events_written: int
    lost: dict[str, int]
    lost_total: int
    sampled_out: int
    emitted_by_kernel: int  # with the rows made in user space (below)
    made_in_user_space: int  # on-CPU sample counts, cgroup samples, map reads: no ring
    unreported_loss: int
    duration_s: float
    targets: list[int]
    libraries: list[str]
    probes: int
    headers_route: str
    writer: WriterStats


class Tracer:
    def __init__(self, cfg: TraceConfig, *, writer: BatchWriter | None = None) -> None:
        self.cfg = cfg
        self._writer_given = writer
        self.writer: BatchWriter | None = writer
        self.bpf: Any = None
        self.attacher: Attacher | None = None
        self.route: HeaderRoute | None = None
        self.clock = ClockMap()
        self.decoder = Decoder(self.clock.to_wall)
        self.session = 0
        self.report = AttachReport()
        self.libs: dict[tuple[int, int], Library] = {}
        self.targets: dict[int, str] = {}  # pid -> origin
        self.exited: dict[int, int | None] = {}  # pid -> exit code
        self._pending: list[bytes] = []
        self.ring_counts: dict[str, int] = {}
        # Rings mapped into this process and read in bulk (ringbuf); empty when BCC's
        # per-record callbacks are used instead (a ring that cannot be mapped).
        self._readers: dict[str, RingReader] = {}
        self._epoll: select.epoll | None = None
        # CPU ns this thread spent per stage of the hot path (STAGES; the writer's
        # commits are in WriterStats.commit_cpu_ns): where each event's time goes.
        self.stage_ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.hist = accounting.Histograms()
        self._last_maint = 0.0
        self._last_maps_scan = 0.0
        self._started_mono = 0
        self._stopped = False
        self._stacks: StackResolver | None = None
        self._python: PythonTargets | None = None
        self._kernels: KernelNames | None = None
        self._wchan: WaitChannels | None = None
        self._oncpu: CpuSampler | None = None
        self._duty: DutyCycle | None = None
        self._locks = LockNames()
        self._throttle = ThrottleSampler(op_code("cpu_throttle"), procinfo.environ)
        self._memory = MemorySampler(op_code("mem_cgroup"), procinfo.environ)
        self._kwork = KernelWork(op_code("kwork_queued"), lambda addr: self.bpf.ksym(addr))
        # Rows made here rather than sent through a ring (cgroup samples, reclaim runs read
        # from their map, queued kernel work): counted beside the kernel's, so that what
        # was made equals what was written plus what was lost.
        self._side_rows = 0
        self._proc_comm: dict[int, str] = {}  # the name each process row was given
        self.warnings: list[str] = []
        self._python_told: set[int] = set()

    # ---- start ------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile, attach, open the rings and the database; ``progress`` hears each
        stage (BCC's compile takes seconds: a user should see what is happening).

        The compile runs on its own thread (BCC's C++ releases the GIL) while this one
        finds the libraries, reads their symbols and opens the database."""
        say = progress or (lambda _msg: None)
        preflight()
        named = self._check_pids()
        opts = self._program_options()
        say(f"compiling the BPF programs ({len(opts.layers)} layers)")
        compiled: list[tuple[Any, HeaderRoute]] = []
        failure: list[BaseException] = []
        worker = threading.Thread(target=_compile_into, args=(opts, compiled, failure),
                                  name="fleetd-compile", daemon=True)
        worker.start()
        libs = self._initial_libraries()
        say(f"reading the symbols of {len(libs)} CUDA librar{'y' if len(libs) == 1 else 'ies'}")
        _prefetch_symbols(libs)
        if self.writer is None:
            self.writer = BatchWriter(self.cfg.db, self.cfg.node, host=socket.gethostname(),
                                      max_bytes=self.cfg.max_db_bytes)
        worker.join()
        if failure:
            if self._writer_given is None:
                self.writer.close()  # nothing was written; the file stays as it was
                self.writer = None
            raise failure[0]
        self.bpf, self.route = compiled[0]
        say(f"compiled (headers: {self.route.name}); attaching probes")
        self.attacher = Attacher(self.bpf, launch_entry=not self.cfg.launch_returns
                                 or self.cfg.mode == "always-on")
        try:
            self._fill_targets(named)
            for lib in libs:
                self._attach(lib)
            self._require_something_attached()
            self._open_rings(opts)
            symbols = FunctionSymbols()
            if self.cfg.stacks or self.cfg.cpu_sample_hz:
                self._python = PythonTargets(self.bpf)
            if self.cfg.stacks and self._python is not None:
                self._stacks = StackResolver(self.bpf, self._python, symbols)
            if self.cfg.cpu_sample_hz and self._python is not None:
                self._oncpu = start_sampler(self.bpf, self._python, symbols,
                                            self.cfg.cpu_sample_hz, self.clock.to_wall, self._warn)
            self._refresh_python()
            self._kernels = KernelNames(self.bpf, symbols)
            self._wchan = _wait_channels(self.bpf)
            self._begin_session()
        except BaseException:
            self._cleanup_bpf()
            raise
        self._started_mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self.cfg.mode == "always-on":
            self.start_duty_cycle(self.cfg.duty_on_ns, self.cfg.agg_interval_ns)
        self.hist.window_start = self._started_mono
        self._last_maint = time.monotonic()
        self._sample_cgroups()  # the baseline: the first interval starts here

    def _program_options(self) -> ProgramOptions:
        return ProgramOptions(
            tracer_pid=os.getpid(), layers=self.cfg.layers, host_parts=self.cfg.host_parts,
            system_wide=self.cfg.system_wide, cgroups=bool(self.cfg.cgroups),
            sample_n=self.cfg.sample, slow_k=self.cfg.slow_k,
            slow_min_ns=self.cfg.slow_min_ns, err_burst=self.cfg.err_burst,
            stacks=self.cfg.stacks, stack_sample=self.cfg.stack_sample,
            stack_slow_ns=self.cfg.stack_slow_ns, wake_stack_ns=self.cfg.wake_stack_ns,
            ring_pages=self.cfg.ring_pages,
            thresholds_ns=dict(self.cfg.thresholds_ns),
            cpu_sample_hz=self.cfg.cpu_sample_hz, cpu_ring_pages=ring_pages(self.cfg.cpu_sample_hz),
        )

    def _check_pids(self) -> list[int]:
        for pid in self.cfg.pids:
            if pid <= 0:
                raise UsageError(f"--pid {pid} is not a process id", "pass a positive pid")
            if pid == os.getpid():
                raise UsageError(f"--pid {pid} is fleetd itself", "pass the workload's pid")
        gone = [p for p in self.cfg.pids if not procinfo.alive(p)]
        if gone:
            raise TraceError(
                f"no such process: {', '.join(map(str, gone))}",
                "check the pid (ps -ef); it may have exited already",
            )
        return list(self.cfg.pids)

    def _initial_libraries(self) -> list[Library]:
        libs = override_libraries(self.cfg.cuda_libs)
        if self.cfg.cuda_libs:
            return libs
        for pid in [*self.cfg.pids, *procinfo.descendants(self.cfg.pids)]:
            libs += mapped_libraries(pid)
        if self.cfg.system_wide or not libs:
            # System-wide, or named targets that have not loaded CUDA yet (torch loads
            # it lazily): the usual copies, so a later dlopen of one is already covered.
            libs += search_usual_places()
            if self.cfg.system_wide:
                libs += all_mapped_libraries()
        return libs

    def _fill_targets(self, named: list[int]) -> None:
        t, slots = self.bpf[b"fl_targets"], self.bpf[b"fl_target_slots"]
        pids = {p: 1 for p in named}
        if self.cfg.follow_children:
            for child in procinfo.descendants(named):
                pids.setdefault(child, 4)
        for pid, origin in pids.items():
            # The hash first, then the slot that answers "is it a target" without it
            # (the order bpf/common.bpf.c relies on; FL_SLOTS there).
            t[ctypes.c_uint32(pid)] = ctypes.c_uint32(origin)
            slots[ctypes.c_int(pid % TARGET_SLOTS)] = ctypes.c_uint64(pid + 1)
            self.targets[pid] = _ORIGIN[origin]
        if self.cfg.cgroups:
            cg = self.bpf[b"fl_cgroups"]
            for path in self.cfg.cgroups:
                try:
                    cid = procinfo.cgroup_id(path)
                except OSError as exc:
                    raise UsageError(
                        f"--cgroup {path!r}: {exc.strerror}",
                        "pass a cgroup v2 directory, e.g. /sys/fs/cgroup/system.slice/x.service",
                    ) from exc
                cg[ctypes.c_uint64(cid)] = ctypes.c_uint32(1)

    def _attach(self, lib: Library) -> None:
        if lib.key in self.libs:
            return
        layer = LAYER_OF_KIND[lib.kind]
        if layer not in self.cfg.layers:
            return
        self.libs[lib.key] = lib
        assert self.attacher is not None
        rep = self.attacher.attach(lib, self.cfg.layers)
        self.report.merge(rep)
        n = len(rep.attached.get(lib.path, []))
        log.info("attached %d probes to %s (%s, found by %s, via %s)", n, lib.path, lib.kind,
                 lib.found_by, rep.mechanism.get(lib.path, "-"))
        for err in rep.failed.get(lib.path, []):
            self._warn(f"probe on {lib.path} failed: {err}")

    def _require_something_attached(self) -> None:
        host_on = "host" in self.cfg.layers
        if self.report.uprobes == 0:
            where = ", ".join(sorted({lib.path for lib in self.libs.values()})) or "none found"
            if not host_on:
                raise TraceError(
                    f"no CUDA probe could be attached (libraries: {where})",
                    "start the workload first and pass --pid, or point --cuda-lib at the "
                    "libcudart.so the workload loads (see /proc/PID/maps)",
                )
            self._warn("no CUDA library attached yet; tracing host events only "
                       "(libraries mapped later by the targets are picked up)")
        elif self.report.failed:
            failed = sum(map(len, self.report.failed.values()))
            self._warn(f"{failed} probes failed to attach; the rest are active")

    def _open_rings(self, opts: ProgramOptions) -> None:
        rings = opts.rings()
        for ring in rings:
            self.ring_counts[ring] = 0
        try:
            if os.environ.get("FLEETD_NO_RING_MMAP"):
                raise OSError("disabled by FLEETD_NO_RING_MMAP")
            self._map_rings(rings)
            return
        except OSError as exc:  # no mmap of ring buffers here: BCC's callbacks instead
            self._unmap_rings()
            log.info("ring buffers not mappable (%s); reading them record by record", exc)
        for ring in rings:
            self.bpf[RINGS[ring].encode()].open_ring_buffer(self._make_callback(ring))

    def _map_rings(self, rings: list[str]) -> None:
        ep = self._epoll = select.epoll()
        for ring in rings:
            table = self.bpf[RINGS[ring].encode()]
            reader = RingReader(table.map_fd, int(table.max_entries))
            self._readers[ring] = reader
            ep.register(reader.fd, select.EPOLLIN)

    def _unmap_rings(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    def _make_callback(self, ring: str) -> Callable[[Any, int, int], int]:
        pending, counts, string_at = self._pending, self.ring_counts, ctypes.string_at

        def callback(_ctx: Any, data: int, size: int) -> int:
            pending.append(string_at(data, size))
            counts[ring] += 1
            return 0

        return callback

    def _begin_session(self) -> None:
        assert self.writer is not None
        fields = accounting.opening_fields(self.clock, accounting.rank_of(self.targets),
                                           self._targets_json(), self.route, self.cfg.command)
        self.session = self.writer.begin_session(fields)
        self.writer.track_session(self.session, self._emitted)
        self.writer.add_processes(procinfo.process_row(p) for p in self.targets)

    def _emitted(self) -> int:
        """The kernel's count of records it handed to the ring buffers, and the sample
        counts made of its samples (writer thread)."""
        made = self._oncpu.rows_written if self._oncpu is not None else 0
        return accounting.read_counters(self.bpf)["emitted"] + made + self._side_rows

    # ---- poll -------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for records, store them; returns how many."""
        if self._epoll is not None:
            if not self.backlog():
                # The BPF side wakes us only every few hundred records (fl_submit), so
                # a quiet ring is also drained when the wait times out.
                self._epoll.poll(timeout_ms / 1000)
            n = self._drain_rings()
        else:
            self.bpf.ring_buffer_poll(timeout_ms)
            # Records that arrived without a wakeup too.
            self.bpf.ring_buffer_consume()
            n = self._flush_pending()
        if self._oncpu is not None:
            self._oncpu.drain(self.writer)  # type: ignore[arg-type]
        if self._duty is not None:
            self._duty.tick(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        if time.monotonic() - self._last_maint >= 1.0:
            self._maintain()
        return n

    def start_duty_cycle(self, on_ns: int, period_ns: int) -> None:
        """The always-on mode: launch probes on for ``on_ns`` of every ``period_ns``
        (the aggregate window's length, so that each window's launch statistics are
        scaled by its own on-time)."""
        assert self.attacher is not None
        self._duty = DutyCycle(self.attacher, on_ns, period_ns,
                               time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        self.hist.launch_on = self._duty.take_on_ns

    def stop_duty_cycle(self) -> None:
        """Back to continuous launch probes (the benchmark's comparison)."""
        if self._duty is not None and self.attacher is not None:
            self.attacher.set_launches(True)
        self._duty = None
        self.hist.launch_on = None

    def backlog(self) -> int:
        """Bytes waiting in the mapped rings (0 when read through BCC's callbacks)."""
        return sum(r.available() for r in self._readers.values())

    def _drain_rings(self, max_bytes: int | None = DRAIN_BYTES) -> int:
        """Take what every mapped ring holds, decode it in bulk and store it."""
        clock, st = time.thread_time_ns, self.stage_ns
        t0 = clock()
        chunks: list[Chunk] = []
        for ring, reader in self._readers.items():
            self.ring_counts[ring] += reader.drain(chunks, max_bytes)
        t1 = clock()
        st["poll"] += t1 - t0
        if not chunks:
            return 0
        batch = self.decoder.decode_bulk(chunks)
        st["decode"] += clock() - t1
        self._store(batch)
        return len(batch.rows)

    def _flush_pending(self) -> int:
        if not self._pending:
            return 0
        blobs = self._pending[:]
        del self._pending[:]
        t0 = time.thread_time_ns()
        batch = self.decoder.decode(blobs)
        self.stage_ns["decode"] += time.thread_time_ns() - t0
        self._store(batch)
        return len(blobs)

    def _store(self, batch: Batch) -> None:
        w = self.writer
        assert w is not None
        clock, st = time.thread_time_ns, self.stage_ns
        t0 = clock()
        if batch.stacks and self._stacks is not None:
            self._stacks.resolve(batch, w)
        if batch.kernels and self._kernels is not None:
            self._kernels.resolve(batch)
        self.decoder.remember_launches(batch)
        if batch.kstack_ids and self._wchan is not None:
            self._wchan.resolve(batch)
        self._locks.resolve(batch)
        t1 = clock()
        st["enrich"] += t1 - t0
        # Args may be finished JSON text (repeated launches), which add_events takes
        # as it is; its signature names only the dicts other callers pass.
        w.add_events(batch.rows, batch.args)
        st["queue"] += clock() - t1
        if batch.tasks:
            w.add_tasks(batch.tasks)
        seen = [(tid, pid, procinfo.comm(pid, tid)) for tid, pid in batch.new_tids]
        if seen:
            w.add_tasks(seen)
        for ev in batch.lifecycle:
            self._lifecycle(ev)
        self._rename_processes([*batch.tasks, *seen])

    def _rename_processes(self, tasks: list[tuple[int, int | None, str | None]]) -> None:
        """A process that names itself after fork (prctl PR_SET_NAME in a worker: a
        DataLoader worker, a producer) shows it on its main thread's comm; the process
        row, read at fork, still has the parent's name: carry the new one over."""
        assert self.writer is not None
        renamed = []
        for tid, pid, comm in tasks:
            # A main thread (tid == pid); a peer's pid is often unknown (None), but a tid
            # that has a process row of ours is that process's main thread too.
            main = tid == pid or (pid is None and tid in self._proc_comm)
            if main and comm and self._proc_comm.get(tid) != comm:
                first = tid not in self._proc_comm
                self._proc_comm[tid] = comm
                renamed.append({"pid": tid, "comm": comm, **(_job_of(tid) if first else {})})
        if renamed:
            self.writer.add_processes(renamed)

    def _lifecycle(self, ev: Lifecycle) -> None:
        w = self.writer
        assert w is not None
        if ev.op == OP_FORK and ev.child:
            self.targets.setdefault(ev.child, "child")
            row = procinfo.process_row(ev.child)
            row.update(ppid=ev.pid, start_ns=row.get("start_ns") or ev.ts_ns)
            row["comm"] = row["comm"] or ev.comm  # a child's comm is its parent's at fork
            self._proc_comm[ev.child] = str(row["comm"] or "")
            w.add_processes([row])
        elif ev.op == OP_EXEC:
            row = procinfo.process_row(ev.pid)
            row["comm"] = row["comm"] or ev.comm  # short-lived: /proc may be gone already
            self._proc_comm[ev.pid] = str(row["comm"] or "")
            w.add_processes([row])
            self._last_maps_scan = 0.0  # libraries appear right after exec
        elif ev.op == OP_EXIT:
            self.exited[ev.pid] = ev.exit_code
            w.add_processes([{"pid": ev.pid, "exit_ns": ev.ts_ns, "exit_code": ev.exit_code}])

    # ---- bookkeeping ------------------------------------------------------------------

    def _maintain(self) -> None:
        self._last_maint = time.monotonic()
        self.clock.maybe_resample()
        self._discover_targets()
        self._refresh_python()
        if time.monotonic() - self._last_maps_scan >= 2.0:
            self._last_maps_scan = time.monotonic()
            self._scan_libraries()
        self._sample_cgroups()
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self._oncpu is not None:
            self._oncpu.maybe_flush(self.writer, now)  # type: ignore[arg-type]
        if now - self.hist.window_start >= self.cfg.agg_interval_ns:
            self._write_aggregates(now)
            self._update_session(final=False)

    def _sample_cgroups(self) -> None:
        """CPU-quota throttling and memory limits of the targets' cgroups since the
        last sample."""
        assert self.writer is not None
        live, now = self.live_targets(), time.time_ns()
        self._add_side_rows(self._throttle.sample(live, now) + self._memory.sample(live, now))

    def _add_side_rows(self, found: list[Any]) -> None:
        """Rows with their args made in user space: written, and counted as made."""
        assert self.writer is not None
        if found:
            self._side_rows += len(found)
            self.writer.add_events([row for row, _ in found],
                                   [(i, args) for i, (_, args) in enumerate(found)])

    def _reclaim_leftovers(self) -> None:
        """The reclaim stall runs the kernel had not sent yet (it sends a run once it
        spans 10 ms): read from its map once the BPF side is frozen."""
        assert self.writer is not None and self.bpf is not None
        try:
            table = self.bpf[b"fl_reclaim"]
        except KeyError:  # no reclaim tracepoints compiled in
            return
        rows = leftover_runs(table, self.clock.to_wall)
        if rows:
            self._side_rows += len(rows)
            self.writer.add_events(rows)  # type: ignore[arg-type]

    def _discover_targets(self) -> None:
        """Targets the kernel added (children, cgroup members, CUDA callers)."""
        assert self.writer is not None
        new: list[int] = []
        for k, v in self.bpf[b"fl_targets"].items():
            pid = int(k.value)
            if pid not in self.targets:
                if procinfo.tgid_of(pid) not in (None, pid):
                    continue  # a thread id; its process is a target already
                self.targets[pid] = _ORIGIN.get(int(v.value), "?")
                new.append(pid)
        if new:
            log.info("new targets: %s", ", ".join(map(str, new)))
            self.writer.add_processes(procinfo.process_row(p) for p in new)

    def _scan_libraries(self) -> None:
        if self.cfg.cuda_libs:
            return
        pids = [p for p in self.targets if p not in self.exited]
        for pid in pids:
            for lib in mapped_libraries(pid):
                self._attach(lib)
        if self.cfg.system_wide:
            for lib in all_mapped_libraries():
                self._attach(lib)

    def _refresh_python(self) -> None:
        """New Python targets and threads get their frames read from now on; a target
        whose interpreter cannot be followed is said so once."""
        if self._python is None:
            return
        self._python.refresh(self.live_targets())
        if self._oncpu is not None:
            self._oncpu.refresh_gc()
        for pid, why in self._python.problems.items():
            if pid not in self._python_told:
                self._python_told.add(pid)
                self._warn(f"pid {pid}: Python frames not read: {why}")

    def python_status(self) -> dict[str, str]:
        """pid -> the interpreter followed, or why not (the session's targets)."""
        if self._python is None:
            return {}
        out = {str(p): i.label for p, i in self._python.interps.items()
               if i is not None and not i.problem}
        out.update({str(p): why for p, why in self._python.problems.items()})
        return out

    def live_targets(self) -> list[int]:
        return [p for p in self.targets if p not in self.exited and procinfo.alive(p)]

    def targets_gone(self) -> bool:
        """True when every named target (and every child it started) has exited."""
        if self.cfg.system_wide or self.cfg.cgroups:
            return False
        return not self.live_targets()

    # ---- aggregates and counters --------------------------------------------------------

    def _write_aggregates(self, now_mono: int) -> None:
        assert self.writer is not None
        start = self.hist.window_start
        rows = self.hist.close_window(self.bpf, self.session, self.clock.to_wall, now_mono)
        if rows:
            self.writer.add_aggregates(rows)
        self._kernel_work(start, now_mono)

    def _kernel_work(self, start_mono: int, now_mono: int) -> None:
        """Kernel work the targets queued over the histograms' window (FL_KWORK)."""
        assert self.writer is not None and self.bpf is not None
        try:
            table = self.bpf[b"fl_kwork"]
        except KeyError:  # not compiled in: no mem part, or no such tracepoint
            return
        self._add_side_rows(self._kwork.rows(table, self.clock.to_wall(start_mono),
                                             self.clock.to_wall(now_mono)))

    def counters(self) -> dict[str, int]:
        return accounting.read_counters(self.bpf)

    def drops(self) -> dict[str, int]:
        writer = self.writer.stats if self.writer is not None else None
        return accounting.drops(self.counters(), writer)

    @staticmethod
    def lost_total(drops: dict[str, int]) -> int:
        return accounting.lost_total(drops)

    def status(self) -> dict[str, Any]:
        d = self.drops()
        return {
            "records": self.decoder.records,
            "lost": self.lost_total(d),
            "targets": len(self.live_targets()),
            "probes": self.report.uprobes,
            "libraries": len(self.libs),
        }

    def _targets_json(self) -> dict[str, Any]:
        got = accounting.targets_json(self.cfg, self.targets, self.libs.values(), self.report)
        if self.cfg.stacks:
            got["python"] = self.python_status()
        return got

    def _stack_drops(self) -> int:
        """Stacks asked for and not stored: the kernel's (stack map full, Python
        frames unreadable) and the symbolizer's (nothing resolved)."""
        c = self.counters()
        return c["stack_lost"] + c["py_stack_lost"] + (
            self._stacks.unresolved if self._stacks is not None else 0)

    def _update_session(self, *, final: bool) -> None:
        assert self.writer is not None
        d = self.drops()
        fields = accounting.progress_fields(d, self.counters(), self.clock,
                                            self._targets_json(), final=final)
        fields["dropped_stacks"] = self._stack_drops()
        if self.cfg.stacks and self.cfg.wake_stack_ns is not None:
            c = self.counters()
            # Not losses: how many wakeups got their waker's stack, and how many the
            # per-pair rate limit left without one (by design, as sampled_out).
            fields["drops"] = {**fields["drops"], "wake_stacks": c["wake_stacks"],
                               "wake_stacks_skipped": c["wake_stacks_skipped"]}
        self.writer.update_session(self.session, fields)

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        log.warning("%s", msg)

    # ---- stop ---------------------------------------------------------------------------

    def stop(self) -> TraceSummary:
        if self._stopped:
            raise RuntimeError("tracer already stopped")
        self._stopped = True
        assert self.writer is not None and self.bpf is not None
        # Freeze the BPF side, then drain: counters and histograms stop moving, so
        # what the kernel says it emitted matches what we drained.
        self.bpf[b"fl_ctl"][ctypes.c_int(0)] = ctypes.c_uint64(1)
        time.sleep(0.02)
        if self._readers:
            while self._drain_rings():
                pass
        else:
            self.bpf.ring_buffer_consume()
            self._flush_pending()
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self._oncpu is not None:
            self._oncpu.flush(self.writer, now, final=True)
        self._write_aggregates(now)
        self._sample_cgroups()
        self._reclaim_leftovers()
        counters = self.counters()
        self._update_session(final=True)
        # The BPF side goes away below: no commit may still be reading its counters.
        self.writer.track_session(None)
        self.writer.flush()
        drops = self.drops()
        self._cleanup_bpf()
        if self._writer_given is None:
            stats = self.writer.close()
        else:
            self.writer.flush()
            stats = self.writer.stats
        drops["writer_queue"] = stats.queue_dropped
        drops["writer_failed"] = stats.failed_rows
        lost = self.lost_total(drops)
        records = self.decoder.records
        made_here = (self._oncpu.rows_written if self._oncpu else 0) + self._side_rows
        emitted = counters["emitted"] + made_here
        return TraceSummary(
            session=self.session, records=records, events_written=stats.events_written,
            lost=drops, lost_total=lost, sampled_out=counters["sampled_out"],
            emitted_by_kernel=emitted, made_in_user_space=made_here,
            # Records the kernel emitted that neither reached the store nor were
            # counted as lost by the writer: must be 0.
            unreported_loss=emitted - stats.events_written - stats.queue_dropped
            - stats.failed_rows,
            duration_s=(now - self._started_mono) / 1e9,
            targets=sorted(self.targets), libraries=[lib.path for lib in self.libs.values()],
            probes=self.report.uprobes,
            headers_route=self.route.describe() if self.route else "",
            writer=stats,
        )

    def _cleanup_bpf(self) -> None:
        if self.bpf is None:
            return
        self._unmap_rings()  # before the maps' fds close
        try:
            if self.attacher is not None:
                self.attacher.close()
            detach_all(self.bpf)
        except Exception as exc:  # detaching must not hide the real outcome
            log.warning("detaching probes failed: %s", exc)
        self.bpf = None


# ---- helpers ------------------------------------------------------------------------------

def _job_of(pid: int) -> dict[str, Any]:
    """The torchrun job of a process seen first as a waker or a culprit, without its
    rank: a rank that another node traces must be known here as one of the job (a
    peer's wait is the collective's, never a data-starvation cause), yet must not count
    among this node's own ranks (tracks, rank books). Its parent tells a worker of the
    traced rank (which inherits the rank's environment) from a peer. Where it runs (its
    cgroup, container and pod) comes with it: a culprit is named with its pod too."""
    env = procinfo.environ(pid)
    place = {k: v for k, v in process_placement(pid, env).items() if v is not None}
    if "RANK" not in env:
        return place
    size = procinfo.ranks_of(env)["world_size"]
    return {**place, "ppid": procinfo.ppid_of(pid), "world_size": size,
            "job": procinfo.job_of(env)}


def _compile_into(opts: ProgramOptions, out: list[tuple[Any, HeaderRoute]],
                  failure: list[BaseException]) -> None:
    try:
        out.append(compile_program(opts))
    except BaseException as exc:  # handed to the starting thread, which raises it
        failure.append(exc)


def _prefetch_symbols(libs: list[Library]) -> None:
    """Read each library's exports now (cached), so attaching later does not wait."""
    for lib in libs:
        with contextlib.suppress(OSError, ValueError):  # the attach reports it, by name
            exported_functions(lib.path)


def _wait_channels(bpf: Any) -> WaitChannels | None:
    """The D-state wait-channel resolver, when the scheduler layer is compiled in."""
    try:
        return WaitChannels(bpf)
    except KeyError:  # no scheduler layer: no kernel stacks map
        return None
