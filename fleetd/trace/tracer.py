"""The Tracer: load the BPF programs, attach, stream records into the node store.

Life cycle: ``start()`` checks the environment, compiles (header ladder), fills the
in-kernel target set, attaches uprobes to every CUDA library the targets map and
opens one ring buffer per layer, mapped into this process (:mod:`fleetd.trace.bpf.rings`);
``poll()`` takes what the rings hold in bulk, decodes it in bulk into the batch writer
and, about once a second, does the bookkeeping (new targets from fork/cgroup/
system-wide discovery, newly mapped libraries, clock re-sampling, in-kernel
histograms into aggregate rows, session counters); ``stop()`` freezes the BPF side,
drains what is left, writes the final aggregates and session record, and closes.

The parts, each a module: the configuration and the summary (:mod:`fleetd.trace.config`),
the targets and the libraries attached (:mod:`fleetd.trace.targets`), the rings
(:mod:`fleetd.trace.bpf.rings`), the path from the rings to the writer
(:mod:`fleetd.trace.intake`) and the rows made in user space
(:mod:`fleetd.trace.siderows`). This module starts, runs and stops them in order.

Every loss is counted: ring-buffer reserve failures and full maps (kernel counters),
rows the writer refused or failed to write. The session row carries them all; what it
says, and how losses and histograms are counted, is :mod:`fleetd.trace.accounting`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fleetd.store.health import TracerCounts
from fleetd.store.writer import BatchWriter
from fleetd.trace import accounting
from fleetd.trace.bpf.bpfsrc import ProgramOptions, compile_program, detach_all
from fleetd.trace.bpf.decoder import Decoder
from fleetd.trace.bpf.mapwatch import MapWatch
from fleetd.trace.bpf.probes import Attacher, AttachReport
from fleetd.trace.bpf.ringbuf import RingReader
from fleetd.trace.bpf.rings import DRAIN_BYTES as DRAIN_BYTES
from fleetd.trace.bpf.rings import Rings
from fleetd.trace.config import GPU_LAYERS as GPU_LAYERS
from fleetd.trace.config import TraceConfig as TraceConfig
from fleetd.trace.config import TraceSummary as TraceSummary
from fleetd.trace.dutycycle import DutyCycle
from fleetd.trace.enrich.oncpu import CpuSampler, ring_pages, start_sampler
from fleetd.trace.enrich.stacks import KernelNames, PythonTargets, StackResolver, WaitChannels
from fleetd.trace.enrich.symbols import FunctionSymbols
from fleetd.trace.host import procinfo
from fleetd.trace.host.clock import ClockMap
from fleetd.trace.host.headers import HeaderRoute
from fleetd.trace.host.libs import Library
from fleetd.trace.host.preflight import ensure_tracefs as ensure_tracefs
from fleetd.trace.host.preflight import preflight
from fleetd.trace.intake import FORGET_EVERY_S, Intake, task_gone
from fleetd.trace.intake import STAGES as STAGES
from fleetd.trace.siderows import SideRows
from fleetd.trace.targets import Targets, check_pids, prefetch_symbols

log = logging.getLogger("fleetd.trace.tracer")
# After the freeze at stop, up to this many 10 ms rounds for in-flight handlers to finish.
STOP_SETTLE_TRIES = 50


class Tracer:
    def __init__(self, cfg: TraceConfig, *, writer: BatchWriter | None = None) -> None:
        self.cfg = cfg
        self._writer_given = writer
        self.writer: BatchWriter | None = writer
        self.bpf: Any = None
        self.route: HeaderRoute | None = None
        self.clock = ClockMap()
        self.decoder = Decoder(self.clock.to_wall)
        self.session = 0
        # The parts, each its own module: what is traced (processes, libraries, probes),
        # the rings, and the path from the rings into the writer.
        self.scope = Targets(cfg, self._warn)
        self.rings = Rings()
        self.intake = Intake(self.decoder, self.scope)
        self.hist = accounting.Histograms()
        self._last_maint = 0.0
        self._last_forget = time.monotonic()
        self._started_mono = 0
        self._stopped = False
        self._python: PythonTargets | None = None
        self._oncpu: CpuSampler | None = None
        self._duty: DutyCycle | None = None
        # Rows made here rather than sent through a ring (cgroup samples, reclaim runs,
        # queued kernel work); ksym is looked up late: bpf is loaded at start.
        self.side_rows = SideRows(lambda addr: self.bpf.ksym(addr))
        self.warnings: list[str] = []
        self._python_told: set[int] = set()

    # The parts' state, under the names the callers (CLI, agent, tests, benchmarks) use.

    @property
    def attacher(self) -> Attacher | None:
        return self.scope.attacher

    @property
    def targets(self) -> dict[int, str]:
        """pid -> how it became a target (named, cgroup, cuda-user, child)."""
        return self.scope.pids

    @property
    def exited(self) -> dict[int, int | None]:
        """pid -> exit code."""
        return self.scope.exited

    @property
    def libs(self) -> dict[tuple[int, int, str], Library]:
        return self.scope.libs

    @property
    def report(self) -> AttachReport:
        return self.scope.report

    @property
    def ring_counts(self) -> dict[str, int]:
        return self.rings.counts

    @property
    def _readers(self) -> dict[str, RingReader]:
        """The mapped rings (empty on the callback path, which a test checks)."""
        return self.rings.readers

    @property
    def stage_ns(self) -> dict[str, int]:
        """CPU ns this thread spent per stage of the hot path (STAGES)."""
        return self.intake.stage_ns

    # ---- start ------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile, attach, open the rings and the database; ``progress`` hears each
        stage (BCC's compile takes seconds: a user should see what is happening).

        The compile runs on its own thread (BCC's C++ releases the GIL) while this one
        finds the libraries, reads their symbols and opens the database."""
        say = progress or (lambda _msg: None)
        preflight()
        named = check_pids(self.cfg.pids)
        opts = self._program_options()
        compiled: list[tuple[Any, HeaderRoute]] = []
        failure: list[BaseException] = []
        # The worker says whether it compiles or loads the cache's programs.
        worker = threading.Thread(target=_compile_into, args=(opts, compiled, failure, say),
                                  name="fleetd-compile", daemon=True)
        worker.start()
        libs = self.scope.initial_libraries()
        say(f"reading the symbols of {len(libs)} CUDA librar{'y' if len(libs) == 1 else 'ies'}")
        prefetch_symbols(libs)
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
        say(f"BPF programs ready ({len(opts.layers)} layers, headers: {self.route.name}); "
            "attaching probes")
        self.scope.attacher = Attacher(self.bpf, launch_entry=not self.cfg.launch_returns
                                       or self.cfg.mode == "always-on")
        try:
            self.scope.fill(self.bpf, named)
            for lib in libs:
                self.scope.attach(lib)
            self._watch_mappings()
            self.scope.require_something_attached()
            self.rings.open(self.bpf, opts.rings())
            self._start_enrichers()
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

    def _watch_mappings(self) -> None:
        """From here on a target that maps an unknown file is held until its CUDA code
        is probed (fleetd.trace.bpf.mapwatch); then the targets are read once more, for
        what they mapped between the first read and now."""
        self.scope.watch = MapWatch(self.bpf, self.scope.settle, self._warn)
        self.scope.watch.start()
        for pid in list(self.scope.pids):
            self.scope.settle(pid)

    def _start_enrichers(self) -> None:
        """Python frames and stacks, the on-CPU sampler, kernel names, wait channels."""
        symbols = FunctionSymbols()
        # Each target's mappings are kept from when they are first read: a launch
        # drained after its process exited is still named (a loaded tracer can lag).
        self.scope.on_mapped = symbols.remember
        if self.scope.watch is not None:  # and every executable mapping, as it is made
            symbols.catch_up = self.scope.watch.catch_up
            self.scope.watch.on_mapping = symbols.note_mapped
        for pid in list(self.scope.pids):
            symbols.remember(pid)
        if self.cfg.stacks or self.cfg.cpu_sample_hz:
            self._python = PythonTargets(self.bpf)
        if self.cfg.stacks and self._python is not None:
            self.intake.stacks = StackResolver(self.bpf, self._python, symbols)
        if self.cfg.cpu_sample_hz and self._python is not None:
            self._oncpu = start_sampler(self.bpf, self._python, symbols,
                                        self.cfg.cpu_sample_hz, self.clock.to_wall, self._warn)
        self._refresh_python()
        self.intake.kernels = KernelNames(self.bpf, symbols)
        self.intake.wchan = _wait_channels(self.bpf)

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
        return accounting.read_counters(self.bpf)["emitted"] + made + self.side_rows.made

    # ---- poll -------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for records, store them; returns how many."""
        assert self.writer is not None
        self.rings.wait(self.bpf, timeout_ms)
        if self.rings.mapped:
            n = self.intake.drain(self.rings, self.writer)
        else:
            n = self.intake.flush_pending(self.rings, self.writer)
        if self._oncpu is not None:
            self._oncpu.drain(self.writer)
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

    def ask_launch_window(self, for_ns: int) -> bool:
        """Launch probes on for ``for_ns`` from the next poll (any thread may ask: the
        agent's loop does, fleetd.node.detail). False without a duty cycle: in full
        mode they are on all the time."""
        duty = self._duty
        if duty is None:
            return False
        duty.ask(for_ns)
        return True

    def stop_duty_cycle(self) -> None:
        """Back to continuous launch probes (the benchmark's comparison)."""
        if self._duty is not None and self.attacher is not None:
            self.attacher.set_launches(True)
        self._duty = None
        self.hist.launch_on = None

    def backlog(self) -> int:
        """Bytes waiting in the mapped rings (0 when read through BCC's callbacks)."""
        return self.rings.backlog()

    # ---- bookkeeping ------------------------------------------------------------------

    def _maintain(self) -> None:
        assert self.writer is not None
        self._last_maint = time.monotonic()
        self.clock.maybe_resample()
        self.scope.discover(self.bpf, self.writer)
        self._refresh_python()
        self.scope.maybe_scan_libraries()
        self._sample_cgroups()
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self._oncpu is not None:
            self._oncpu.maybe_flush(self.writer, now)
        if now - self.hist.window_start >= self.cfg.agg_interval_ns:
            self._write_aggregates(now)
            self._update_session(final=False)
        if self._last_maint - self._last_forget >= FORGET_EVERY_S:
            self._last_forget = self._last_maint
            self.intake.forget_gone(task_gone)

    def _sample_cgroups(self) -> None:
        assert self.writer is not None
        self.side_rows.sample_cgroups(self.writer, self.live_targets(), time.time_ns())

    def _refresh_python(self) -> None:
        """New Python targets and threads get their frames read from now on; a target
        whose interpreter cannot be followed is said so once."""
        if self._python is None:
            return
        for pid in self.scope.execed:  # read again from the new image
            self._python.forget(pid)
        self.scope.execed.clear()
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
        return self.scope.live()

    def targets_gone(self) -> bool:
        """True when every named target (and every child it started) has exited."""
        return self.scope.gone()

    # ---- aggregates and counters --------------------------------------------------------

    def _write_aggregates(self, now_mono: int) -> None:
        assert self.writer is not None
        start = self.hist.window_start
        rows = self.hist.close_window(self.bpf, self.session, self.clock.to_wall, now_mono)
        if rows:
            self.writer.add_aggregates(rows)
        # Kernel work the targets queued over the same window.
        self.side_rows.kernel_work(self.writer, self.bpf, self.clock.to_wall(start),
                              self.clock.to_wall(now_mono))

    def _drain_all(self) -> None:
        assert self.writer is not None and self.bpf is not None
        if self.rings.mapped:
            while self.intake.drain(self.rings, self.writer):
                pass
        else:
            self.bpf.ring_buffer_consume()
            self.intake.flush_pending(self.rings, self.writer)

    def counters(self) -> dict[str, int]:
        return accounting.read_counters(self.bpf)

    def drops(self) -> dict[str, int]:
        writer = self.writer.stats if self.writer is not None else None
        return accounting.drops(self.counters(), writer)

    @staticmethod
    def lost_total(drops: dict[str, int]) -> int:
        return accounting.lost_total(drops)

    def status(self) -> TracerCounts:
        d = self.drops()
        return {
            "records": self.decoder.records,
            "lost": self.lost_total(d),
            "targets": len(self.live_targets()),
            "probes": self.report.uprobes,
            "libraries": len(self.libs),
        }

    def _targets_json(self) -> accounting.TargetsJson:
        got = self.scope.json()
        if self.cfg.stacks:
            got["python"] = self.python_status()
        return got

    def _stack_drops(self) -> int:
        """Stacks asked for and not stored: the kernel's (stack map full, Python
        frames unreadable) and the symbolizer's (nothing resolved)."""
        c = self.counters()
        stacks = self.intake.stacks
        return c["stack_lost"] + c["py_stack_lost"] + (
            stacks.unresolved if stacks is not None else 0)

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
        self._drain_all()
        # A handler that was running at the freeze (preempted, on a busy node) may still
        # submit the record it counted: drain until the count holds still.
        emitted = self.counters()["emitted"]
        for _ in range(STOP_SETTLE_TRIES):
            time.sleep(0.01)
            self._drain_all()
            emitted, before = self.counters()["emitted"], emitted
            if emitted == before:
                break
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self._oncpu is not None:
            self._oncpu.flush(self.writer, now, final=True)
        self._write_aggregates(now)
        self._sample_cgroups()
        self.side_rows.reclaim_leftovers(self.writer, self.bpf, self.clock.to_wall)
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
        made_here = (self._oncpu.rows_written if self._oncpu else 0) + self.side_rows.made
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
            mapping=dict(self.scope.watch.json()) if self.scope.watch is not None else {},
        )

    def _cleanup_bpf(self) -> None:
        if self.bpf is None:
            return
        if self.scope.watch is not None:
            self.scope.watch.stop()  # no process may stay held once we are gone
        self.rings.close()  # before the maps' fds close
        try:
            if self.attacher is not None:
                self.attacher.close()
            detach_all(self.bpf)
        except Exception as exc:  # detaching must not hide the real outcome
            log.warning("detaching probes failed: %s", exc)
        self.bpf = None


# ---- helpers ------------------------------------------------------------------------------

def _compile_into(opts: ProgramOptions, out: list[tuple[Any, HeaderRoute]],
                  failure: list[BaseException], say: Callable[[str], None]) -> None:
    try:
        out.append(compile_program(opts, say))
    except BaseException as exc:  # handed to the starting thread, which raises it
        failure.append(exc)


def _wait_channels(bpf: Any) -> WaitChannels | None:
    """The D-state wait-channel resolver, when the scheduler layer is compiled in."""
    try:
        return WaitChannels(bpf)
    except KeyError:  # no scheduler layer: no kernel stacks map
        return None
