"""The processes a trace session follows and the CUDA libraries it attaches to.

At start: the named pids are checked, written into the in-kernel target set (with their
children), and the libraries they map (or the usual copies, system-wide) are found and
their exports read while the BPF programs compile. About once a second after that
(:meth:`Targets.discover`, :meth:`Targets.maybe_scan_libraries`): the targets the
kernel added (children, cgroup members, CUDA callers) and the libraries mapped since.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fleetd.errors import TraceError, UsageError
from fleetd.store.writer import BatchWriter
from fleetd.trace import accounting
from fleetd.trace.bpf.bpfsrc import TARGET_SLOTS
from fleetd.trace.bpf.mapwatch import MapWatch
from fleetd.trace.bpf.probes import Attacher, AttachReport, library_symbols
from fleetd.trace.config import TraceConfig
from fleetd.trace.host import procinfo
from fleetd.trace.host.libs import (
    LAYER_OF_KIND,
    Library,
    all_mapped_libraries,
    mapped_libraries,
    override_libraries,
    scan_mapped,
    search_usual_places,
)

log = logging.getLogger("fleetd.trace.targets")

# How a target came to be one: the values of the in-kernel target set (bpf/common.bpf.c).
ORIGIN = {1: "named", 2: "cgroup", 3: "cuda-user", 4: "child"}
# Seconds between scans of the targets' maps for new libraries (sooner after an exec).
MAPS_SCAN_S = 2.0


def check_pids(pids: list[int]) -> list[int]:
    """The named pids, each a live process other than fleetd itself."""
    for pid in pids:
        if pid <= 0:
            raise UsageError(f"--pid {pid} is not a process id", "pass a positive pid")
        if pid == os.getpid():
            raise UsageError(f"--pid {pid} is fleetd itself", "pass the workload's pid")
    gone = [p for p in pids if not procinfo.alive(p)]
    if gone:
        raise TraceError(
            f"no such process: {', '.join(map(str, gone))}",
            "check the pid (ps -ef); it may have exited already",
        )
    return list(pids)


def prefetch_symbols(libs: list[Library]) -> None:
    """Read each library's exports now (cached), so attaching later does not wait."""
    for lib in libs:
        with contextlib.suppress(OSError, ValueError):  # the attach reports it, by name
            library_symbols(lib)


class Targets:
    def __init__(self, cfg: TraceConfig, warn: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.pids: dict[int, str] = {}  # pid -> origin
        self.exited: dict[int, int | None] = {}  # pid -> exit code
        # Targets that called exec since the last Python refresh: their interpreter (if
        # any) is another image now, at other addresses.
        self.execed: set[int] = set()
        self.libs: dict[tuple[int, int, str], Library] = {}
        self.report = AttachReport()
        self.attacher: Attacher | None = None  # set once the programs are compiled
        self._warn = warn
        self._last_maps_scan = 0.0
        # Attaching happens on the tracer's thread (maps scans) and on the mapping
        # watcher's (a held process): one at a time.
        self.lock = threading.RLock()
        self.watch: MapWatch | None = None
        self.hidden: dict[str, list[int]] = {}  # stripped runtime's path -> pids seen
        # Told of each process whose mappings were read (the symbolizer keeps them, to
        # name its addresses even after it exits).
        self.on_mapped: Callable[[int], None] | None = None

    def initial_libraries(self) -> list[Library]:
        cfg = self.cfg
        libs = override_libraries(cfg.cuda_libs)
        if cfg.cuda_libs:
            return libs
        for pid in [*cfg.pids, *procinfo.descendants(cfg.pids)]:
            libs += mapped_libraries(pid)
        # Always the usual copies too: a uprobe on a file is installed when a process
        # maps it, so a later dlopen of one (torch loads CUDA lazily) or a process started
        # later that maps one is covered from its first call, with no stop.
        libs += search_usual_places()
        if cfg.system_wide:
            libs += all_mapped_libraries()
        return libs

    def fill(self, bpf: Any, named: list[int]) -> None:
        """The in-kernel target set: the named pids, their children, the cgroups."""
        t, slots = bpf[b"fl_targets"], bpf[b"fl_target_slots"]
        pids = {p: 1 for p in named}
        if self.cfg.follow_children:
            for child in procinfo.descendants(named):
                pids.setdefault(child, 4)
        for pid, origin in pids.items():
            # The hash first, then the slot that answers "is it a target" without it
            # (the order bpf/common.bpf.c relies on; FL_SLOTS there).
            t[ctypes.c_uint32(pid)] = ctypes.c_uint32(origin)
            slots[ctypes.c_int(pid % TARGET_SLOTS)] = ctypes.c_uint64(pid + 1)
            self.pids[pid] = ORIGIN[origin]
        if self.cfg.cgroups:
            cg = bpf[b"fl_cgroups"]
            for path in self.cfg.cgroups:
                try:
                    cid = procinfo.cgroup_id(path)
                except OSError as exc:
                    raise UsageError(
                        f"--cgroup {path!r}: {exc.strerror}",
                        "pass a cgroup v2 directory, e.g. /sys/fs/cgroup/system.slice/x.service",
                    ) from exc
                cg[ctypes.c_uint64(cid)] = ctypes.c_uint32(1)

    def attach(self, lib: Library) -> bool:
        """Probes on ``lib`` unless it has them already; whether it got them now."""
        with self.lock:
            return self._attach(lib)

    def _attach(self, lib: Library) -> bool:
        if lib.key in self.libs:
            return False
        layer = LAYER_OF_KIND[lib.kind]
        if layer not in self.cfg.layers:
            return False
        self.libs[lib.key] = lib
        assert self.attacher is not None
        rep = self.attacher.attach(lib, self.cfg.layers)
        self.report.merge(rep)
        n = len(rep.attached.get(lib.path, []))
        log.info("attached %d probes to %s (%s, found by %s, via %s)", n, lib.path, lib.kind,
                 lib.found_by, rep.mechanism.get(lib.path, "-"))
        for err in rep.failed.get(lib.path, []):
            self._warn(f"probe on {lib.path} failed: {err}")
        return True

    def settle(self, pid: int) -> list[str]:
        """Attach the CUDA code ``pid`` maps now that has no probes yet (the mapping
        watcher calls it while the process is held); the paths attached. A stripped file
        that carries the runtime is said once per file."""
        if self.on_mapped is not None:
            self.on_mapped(pid)
        if self.cfg.cuda_libs:
            return []
        mapped = scan_mapped(pid)
        attached = [lib.path for lib in mapped.libs if self.attach(lib)]
        for path in mapped.hidden_runtimes:
            self._hidden_runtime(pid, path)
        return attached

    def _hidden_runtime(self, pid: int, path: str) -> None:
        with self.lock:
            seen = self.hidden.setdefault(path, [])
            if pid in seen:
                return
            seen.append(pid)
        self._warn(
            f"pid {pid} ({procinfo.comm(pid) or '?'}) runs {path}, which carries the CUDA "
            "runtime linked in (libcudart_static) with its symbols stripped: its runtime "
            "calls cannot be probed; the driver layer (libcuda) is still traced. Build "
            "it unstripped (or keep .symtab) to trace the runtime layer")

    def require_something_attached(self) -> None:
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

    def discover(self, bpf: Any, writer: BatchWriter) -> None:
        """Targets the kernel added (children, cgroup members, CUDA callers)."""
        new: list[int] = []
        for k, v in bpf[b"fl_targets"].items():
            pid = int(k.value)
            if pid not in self.pids:
                if procinfo.tgid_of(pid) not in (None, pid):
                    continue  # a thread id; its process is a target already
                self.pids[pid] = ORIGIN.get(int(v.value), "?")
                new.append(pid)
        if new:
            log.info("new targets: %s", ", ".join(map(str, new)))
            writer.add_processes(procinfo.process_row(p) for p in new)

    def rescan_soon(self) -> None:
        """Scan the maps at the next chance: libraries appear right after an exec."""
        self._last_maps_scan = 0.0

    def maybe_scan_libraries(self) -> None:
        if time.monotonic() - self._last_maps_scan >= MAPS_SCAN_S:
            self._last_maps_scan = time.monotonic()
            self.scan_libraries()

    def scan_libraries(self) -> None:
        if self.cfg.cuda_libs:
            return
        pids = [p for p in self.pids if p not in self.exited]
        for pid in pids:
            attached = self.settle(pid)
            if attached and self.watch is not None:
                # No mapping event announced these: probed late, by an unknown margin.
                self.watch.late_from_scan(pid, attached)
                self._warn(f"pid {pid}: probes on {', '.join(attached)} attached at a maps "
                           "scan, after the process mapped it: its first calls may be "
                           "missing (see the session's targets.mapping)")
        if self.cfg.system_wide:
            for lib in all_mapped_libraries():
                self.attach(lib)

    def live(self) -> list[int]:
        return [p for p in self.pids if p not in self.exited and procinfo.alive(p)]

    def gone(self) -> bool:
        """True when every named target (and every child it started) has exited."""
        if self.cfg.system_wide or self.cfg.cgroups:
            return False
        return not self.live()

    def json(self) -> accounting.TargetsJson:
        """What is traced, for the session row (:func:`fleetd.trace.accounting.targets_json`)."""
        got = accounting.targets_json(self.cfg, self.pids, list(self.libs.values()),
                                      self.report)
        if self.watch is not None:
            got["mapping"] = self.watch.json()
        if self.hidden:
            got["hidden_runtimes"] = {path: pids[:20] for path, pids in self.hidden.items()}
        return got
