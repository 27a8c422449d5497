"""Probes before the first call: the tracer's side of the mapping hook (bpf/proc.bpf.c).

When a target maps a file executable (a dlopen, an exec) that fleetd has not yet
classified, the kernel stops the process (SIGSTOP, before it returns to user space) and
writes an event into ``fl_rb_hold``. A thread here waits on that ring; for each event it
has the process's mappings scanned (the CUDA code in the new file attached through
``settle``), marks the file known (``fl_known_files``: the same file mapped later, by
any process, passes without a stop) and resumes the process with SIGCONT. So a library
mapped after the session started is probed before the process's first call into it.

Every executable mapping of a file by a candidate, held or not, also comes through
``fl_rb_maps`` (:class:`Mapped`: where, at which file offset, the name as opened) to
``on_mapping`` (the symbolizer keeps it): a process that maps only files already known
and exits before anyone reads its maps still has its addresses named. The tracer's
thread catches up on that ring (:meth:`MapWatch.catch_up`) before it gives up naming an
address of a process that has gone, so the order of the two threads does not matter.

Every event is measured: how long the process was held, and, where it could not be
held (``FLEETD_NO_HOLD``, or the kernel refused the signal), the window between the
mapping and the probes (calls in it may be missed): :class:`Windows`, in the session's
targets (``mapping``) and ``fleetd check``.

Side effects of the stop, for the record: the process's parent sees it stopped and
continued only if it asks (waitpid with WUNTRACED/WCONTINUED: an interactive shell's job
control does, a batch launcher or torchrun does not), a process blocked in one of the few
calls Linux does not restart after a stop (epoll_wait, semop, sigtimedwait) returns
EINTR, and each distinct file costs one stop of a few milliseconds, once per node.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from fleetd.trace.bpf.ringbuf import Chunk, RingReader

log = logging.getLogger("fleetd.trace.bpf.mapwatch")

# struct fl_hold: ts, pid, tid, hash, how (0 mmap, 1 exec), held.
HOLD = struct.Struct("<QIIQII")
HOW = ("mmap", "exec")
RING = b"fl_rb_hold"
# struct fl_mapped: ts, pid, tid, start, len, off, then the name (NUL-terminated).
MAPPED = struct.Struct("<QIIQQQ")
MAPS_RING = b"fl_rb_maps"
MAX_LATE = 50  # windows kept by name in the session row; all are counted

# The releaser: a small process that outlives a tracer killed outright (SIGKILL, OOM)
# and resumes every process the kernel stopped for it that it could not resume itself.
# It holds descriptors of fl_hold_ctl and fl_held (tgid -> stop time, filled by the BPF
# side before it stops a process) and waits for its stdin to close (the tracer's end
# goes with the tracer). Then it turns the holds off first (the programs may outlive
# the pipe by seconds while the dying tracer's descriptors close: a resumed process
# must not be stopped again with no one left to resume it), and sends SIGCONT to each
# pid listed, twice (a stop decided just before the switch). Standard library only,
# run with -I -S.
RELEASER = r"""
import ctypes, os, platform, signal, sys, time
held_fd, ctl_fd = int(sys.argv[1]), int(sys.argv[2])
sys.stdin.buffer.read()
nr = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("key", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint64), ("zero", ctypes.c_uint8 * 96)]
def bpf(cmd, attr):
    return nr is not None and libc.syscall(nr, cmd, ctypes.byref(attr),
                                           ctypes.sizeof(attr)) == 0
zero, off = ctypes.c_uint32(0), ctypes.c_uint32(0)
bpf(2, Attr(map_fd=ctl_fd, key=ctypes.addressof(zero), value=ctypes.addressof(off)))
for attempt in range(2):
    key, nxt = ctypes.c_uint32(0), ctypes.c_uint32(0)
    attr = Attr(map_fd=held_fd, key=0, value=ctypes.addressof(nxt))
    for _ in range(4096):
        if not bpf(4, attr):
            break
        try:
            os.kill(nxt.value, signal.SIGCONT)
        except OSError:
            pass
        key.value = nxt.value
        attr.key = ctypes.addressof(key)
    time.sleep(0.05)
"""


class LateWindow(TypedDict):
    pid: int
    how: str  # mmap | exec | maps-scan
    libraries: list[str]
    window_ms: float | None  # mapping to probes; None: the mapping's time is unknown


class MappingJSON(TypedDict):
    hook: str  # "hold" | "no-hold (why)" | "off (why)"
    events: int
    held: int
    held_ms_max: float
    held_ms_total: float
    late: int
    late_windows: list[LateWindow]


@dataclass
class Windows:
    """What the mapping hook did over a session, and every window in which calls could
    have been missed."""

    hook: str = "off"
    events: int = 0
    held: int = 0
    held_ms_max: float = 0.0
    held_ms_total: float = 0.0
    late: list[LateWindow] = field(default_factory=list)
    late_count: int = 0

    def add_late(self, w: LateWindow) -> None:
        self.late_count += 1
        if len(self.late) < MAX_LATE:
            self.late.append(w)

    def json(self) -> MappingJSON:
        return {"hook": self.hook, "events": self.events, "held": self.held,
                "held_ms_max": round(self.held_ms_max, 3),
                "held_ms_total": round(self.held_ms_total, 3),
                "late": self.late_count, "late_windows": list(self.late)}


@dataclass(frozen=True, slots=True)
class HoldEvent:
    ts: int  # CLOCK_MONOTONIC ns of the mapping
    pid: int
    tid: int
    hash: int
    how: str
    held: bool


@dataclass(frozen=True, slots=True)
class Mapped:
    """An executable mapping of a file, as the kernel saw it made."""

    pid: int
    start: int
    end: int
    offset: int  # in the file
    name: str  # as the process opened it ("" when not seen)


def parse_mapped(raw: bytes) -> Mapped | None:
    if len(raw) < MAPPED.size:
        return None
    _ts, pid, _tid, start, length, off = MAPPED.unpack_from(raw)
    name = raw[MAPPED.size:].split(b"\0", 1)[0].decode(errors="surrogateescape")
    # The mapping ends where its last page does, as maps and map_files say.
    end = start + (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    return Mapped(pid, start, end, off, name)


def parse(raw: bytes) -> HoldEvent | None:
    if len(raw) < HOLD.size:
        return None
    ts, pid, tid, h, how, held = HOLD.unpack_from(raw)
    return HoldEvent(ts, pid, tid, h, HOW[how] if how < len(HOW) else "?", bool(held))


class MapWatch:
    """The watcher thread. ``settle(pid)`` scans ``pid``'s mappings and attaches what
    is new, returning the library paths it attached; it runs on this thread."""

    def __init__(self, bpf: Any, settle: Callable[[int], list[str]],
                 warn: Callable[[str], None]) -> None:
        self.bpf = bpf
        self.settle = settle
        self.warn = warn
        self.windows = Windows()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: RingReader | None = None
        self._known = bpf[b"fl_known_files"]
        self._held = bpf[b"fl_held"]
        self._lock = threading.Lock()  # windows: this thread writes, the tracer reads
        self._releaser: subprocess.Popen[bytes] | None = None
        # Told of each executable mapping (fl_rb_maps); the ring waits until it is set.
        self.on_mapping: Callable[[Mapped], None] | None = None
        self._maps: RingReader | None = None
        self._maps_lock = threading.Lock()  # this thread and the tracer's catch_up

    def start(self) -> None:
        """Open the ring, start the thread, then let the kernel hold processes."""
        table = self.bpf[RING]
        try:
            self._reader = RingReader(int(table.map_fd), int(table.max_entries))
        except (OSError, ValueError, AttributeError) as exc:
            self.windows.hook = f"off (the hold ring cannot be mapped: {exc})"
            self.warn(f"libraries mapped after the start are found by the maps scan only "
                      f"(up to 2 s late): {self.windows.hook}")
            return
        with contextlib.suppress(OSError, ValueError, AttributeError, KeyError):
            maps = self.bpf[MAPS_RING]
            self._maps = RingReader(int(maps.map_fd), int(maps.max_entries))
        self._thread = threading.Thread(target=self._run, name="fleetd-mapwatch",
                                        daemon=True)
        self._thread.start()
        if os.environ.get("FLEETD_NO_HOLD"):
            self.windows.hook = "no-hold (FLEETD_NO_HOLD is set)"
            return
        try:
            self._releaser = _start_releaser(int(self._held.map_fd),
                                             int(self.bpf[b"fl_hold_ctl"].map_fd))
        except OSError as exc:
            self.windows.hook = f"no-hold (no releaser: {exc})"
            return
        self.bpf[b"fl_hold_ctl"][ctypes.c_int(0)] = ctypes.c_uint32(1)
        self.windows.hook = "hold"

    def stop(self) -> None:
        """No more holds; handle what is queued (every held process is resumed)."""
        with contextlib.suppress(KeyError, OSError):
            self.bpf[b"fl_hold_ctl"][ctypes.c_int(0)] = ctypes.c_uint32(0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._drain()
        lost = self.lost_mappings()
        if lost:
            self.warn(f"{lost} executable mappings were not reported (fl_rb_maps was "
                      "full): kernels of processes that exited before the tracer read "
                      "their maps may be unnamed")
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        with self._maps_lock:
            if self._maps is not None:
                self._maps.close()
                self._maps = None
        if self._releaser is not None:
            # Its stdin closes: it resumes whatever is still listed, then exits.
            with contextlib.suppress(OSError):
                assert self._releaser.stdin is not None
                self._releaser.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._releaser.wait(5)
            self._releaser = None

    def json(self) -> MappingJSON:
        with self._lock:
            return self.windows.json()

    def _run(self) -> None:
        assert self._reader is not None
        ep = select.epoll()
        try:
            ep.register(self._reader.fd, select.EPOLLIN)
            if self._maps is not None:
                ep.register(self._maps.fd, select.EPOLLIN)
            while not self._stop.is_set():
                ep.poll(0.1)
                self._drain()
                self.catch_up()
        except Exception as exc:  # the thread must not die silently: holds would hang
            log.error("mapping watcher failed: %s", exc)
            with contextlib.suppress(KeyError, OSError):
                self.bpf[b"fl_hold_ctl"][ctypes.c_int(0)] = ctypes.c_uint32(0)
            self.warn(f"mapping watcher stopped ({exc}); libraries mapped from now on are "
                      "found by the maps scan only")
        finally:
            ep.close()

    def _drain(self) -> None:
        if self._reader is None:
            return
        chunks: list[Chunk] = []
        self._reader.drain(chunks)
        for chunk in chunks:
            # struct fl_hold is not the size of a plain record: each comes out alone.
            ev = parse(chunk.raw) if chunk.count == 0 else None
            if ev is not None:
                self._handle(ev)

    def catch_up(self) -> None:
        """Hand every executable mapping the kernel has reported so far to
        ``on_mapping`` (either thread may call it; one at a time)."""
        with self._maps_lock:
            if self._maps is None or self.on_mapping is None:
                return
            chunks: list[Chunk] = []
            self._maps.drain(chunks)
            for chunk in chunks:
                m = parse_mapped(chunk.raw) if chunk.count == 0 else None
                if m is None:
                    continue
                try:
                    self.on_mapping(m)
                except Exception as exc:  # one bad record must not stop the rest
                    log.warning("pid %d: mapping at %#x not kept: %s", m.pid, m.start, exc)

    def lost_mappings(self) -> int:
        """Mapping records the kernel had no room for (their processes' addresses are
        named only while they live)."""
        try:
            return int(self.bpf[b"fl_maps_lost"][ctypes.c_int(0)].value)
        except (KeyError, OSError):
            return 0

    def _handle(self, ev: HoldEvent) -> None:
        try:
            attached = self.settle(ev.pid)
        except Exception as exc:  # resume the process whatever happened
            log.warning("pid %d: mappings not settled: %s", ev.pid, exc)
            attached = []
        if ev.hash:
            with contextlib.suppress(OSError, KeyError):
                self._known[ctypes.c_uint64(ev.hash)] = ctypes.c_uint8(1)
        if ev.held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ev.pid, signal.SIGCONT)
            with contextlib.suppress(KeyError, OSError):
                del self._held[ctypes.c_uint32(ev.pid)]
        ms = (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - ev.ts) / 1e6
        with self._lock:
            w = self.windows
            w.events += 1
            if ev.held:
                w.held += 1
                w.held_ms_total += ms
                w.held_ms_max = max(w.held_ms_max, ms)
            elif attached:
                w.add_late({"pid": ev.pid, "how": ev.how, "libraries": attached,
                            "window_ms": round(ms, 3)})
        if attached:
            log.info("pid %d %s: probes on %s %s", ev.pid, ev.how, ", ".join(attached),
                     f"before it resumed (held {ms:.1f} ms)" if ev.held
                     else f"{ms:.1f} ms after the mapping (not held)")

    def late_from_scan(self, pid: int, attached: list[str]) -> None:
        """Libraries the periodic maps scan found that no event announced: mapped at an
        unknown time before now (a target adopted after it mapped them)."""
        with self._lock:
            self.windows.add_late({"pid": pid, "how": "maps-scan", "libraries": attached,
                                   "window_ms": None})


def _start_releaser(held_fd: int, ctl_fd: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", RELEASER, str(held_fd),
                             str(ctl_fd)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, pass_fds=(held_fd, ctl_fd),
                            start_new_session=True)
