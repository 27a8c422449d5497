"""Python frames of CUDA calls: which interpreter a process runs, where its threads'
frame chains start, and what a (code object, instruction) pair means as file:line.

CPython 3.10 to 3.13 (docs/python-frames.md). The walk itself happens in the kernel at
the call (bpf/common.bpf.c ``fl_py_walk``): it needs, per process, where this CPython
version keeps a thread's current frame and a frame's fields (:class:`Layout`), and per
thread the address of its ``PyThreadState``. A thread calling into CUDA through ctypes
(or any extension that releases the GIL) is not the interpreter's "current" thread, so
the thread states are found here instead, by reading the interpreter's thread list
from ``_PyRuntime`` (an exported symbol of the executable or of libpython) and filed
by native thread id. :func:`walk` is the same walk from user space.

Code objects outlive the calls that ran them, so their names and line tables are read
from the process's memory after the event, once per code object.

Where the offsets come from: up to 3.12 a table (:data:`LAYOUTS`) measured on x86-64
with ``offsetof`` against each version's own headers; from 3.13 the interpreter's own
``_Py_DebugOffsets`` (:mod:`fleetd.trace.enrich.pydebug`), read from the running process.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.security.procfs import regular_in_root
from fleetd.trace.enrich import pydebug, symbols

log = logging.getLogger("fleetd.trace.enrich.pyframes")

FL_PY_DIRECT = 0xFFFFFFFF  # bpf/fleetd.h: the tstate field already is the current frame
NO_OWNER_SKIP = 0xFF  # no shim frames to skip in this version
MAX_THREADS = 4096  # thread states followed per interpreter, against a corrupt list
MAX_TEXT = 4096  # characters read of a file or function name


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one CPython version keeps what the walk and the naming read."""

    runtime_interp_head: int  # _PyRuntimeState.interpreters.head
    interp_threads_head: int  # PyInterpreterState.threads.head (3.10: tstate_head)
    tstate_next: int
    tstate_tid: int  # PyThreadState.native_thread_id (3.10: thread_id, a pthread_t)
    tstate_frame: int  # .frame (3.10), .cframe (3.11, 3.12), .current_frame (3.13)
    cframe_frame: int  # _PyCFrame.current_frame, or FL_PY_DIRECT
    frame_code: int  # f_code (f_executable in 3.13)
    frame_previous: int  # previous (3.10: PyFrameObject.f_back)
    frame_instr: int  # prev_instr (3.11, 3.12), instr_ptr (3.13), f_lasti (3.10)
    frame_owner: int
    owner_skip: int  # owner of frames that run no Python code, or NO_OWNER_SKIP
    code_filename: int
    code_qualname: int  # co_qualname (3.10 has none: co_name)
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int  # co_code_adaptive: the instructions, inline in the code object
    bytes_data: int = 32  # PyBytesObject.ob_sval
    var_size: int = 16  # PyVarObject.ob_size
    str_length: int = 16  # PyASCIIObject.length
    str_state: int = 32  # PyASCIIObject.state
    str_ascii_data: int = 48  # sizeof(PyASCIIObject)
    str_compact_data: int = 72  # sizeof(PyCompactUnicodeObject)
    # 3.10 keeps frames as objects: the instruction is f_lasti, an int index in code
    # units (the walk's 8-byte read also takes f_lineno above it: only the low half
    # counts), and its line table is pairs of (bytes, line delta).
    lasti_index: bool = False
    lines_310: bool = False
    # 3.10 files threads by pthread_self(), glibc's struct pthread: the kernel's id of
    # the thread is a field of it, found per process (:func:`_pthread_tid_offset`).
    pthread_tid: bool = False
    gil: int = 0  # the GIL (struct _gil_runtime_state): in _PyRuntime, or per interpreter
    gil_in_interp: bool = False  # 3.12+: at the interpreter state, not _PyRuntime
    gil_size: int = 208
    source: str = "table"  # or "_Py_DebugOffsets" (read from the interpreter itself)


# Measured with offsetof against each pyenv build's own headers (tests/unit/
# pylayout_probe.c, compiled with gcc per version; tests/unit/test_pyframes_layouts.py
# recompiles it against every installed interpreter and compares with this table).
# 3.11: Debian's 3.11.2 and pyenv's 3.11.7 are identical. 3.13 is read from the process
# (_Py_DebugOffsets, fleetd.trace.enrich.pydebug): its row here, measured from 3.13.0, is
# used only where that table cannot be read.
LAYOUTS: dict[tuple[int, int], Layout] = {
    (3, 10): Layout(  # 3.10.13
        runtime_interp_head=32, interp_threads_head=8, tstate_next=8, tstate_tid=176,
        tstate_frame=24, cframe_frame=FL_PY_DIRECT, frame_code=32, frame_previous=24,
        frame_instr=96, frame_owner=0, owner_skip=NO_OWNER_SKIP, code_filename=104,
        code_qualname=112, code_firstlineno=40, code_linetable=120, code_adaptive=0,
        lasti_index=True, lines_310=True, pthread_tid=True, gil=352),
    (3, 11): Layout(  # 3.11.7, 3.11.2
        runtime_interp_head=40, interp_threads_head=16, tstate_next=8, tstate_tid=160,
        tstate_frame=56, cframe_frame=8, frame_code=32, frame_previous=48, frame_instr=56,
        frame_owner=69, owner_skip=NO_OWNER_SKIP, code_filename=112, code_qualname=128,
        code_firstlineno=72, code_linetable=136, code_adaptive=184, gil=360),
    (3, 12): Layout(  # 3.12.1: thread states and GIL under the interpreter
        runtime_interp_head=40, interp_threads_head=72, tstate_next=8, tstate_tid=144,
        tstate_frame=56, cframe_frame=0, frame_code=0, frame_previous=8, frame_instr=56,
        frame_owner=70, owner_skip=3, code_filename=112, code_qualname=128,
        code_firstlineno=68, code_linetable=136, code_adaptive=192, str_ascii_data=40,
        str_compact_data=56, gil=1040, gil_in_interp=True),
    (3, 13): Layout(  # 3.13.0: no _PyCFrame; the frame's code is f_executable
        runtime_interp_head=632, interp_threads_head=7344, tstate_next=8, tstate_tid=160,
        tstate_frame=72, cframe_frame=FL_PY_DIRECT, frame_code=0, frame_previous=8,
        frame_instr=56, frame_owner=70, owner_skip=3, code_filename=112,
        code_qualname=128, code_firstlineno=68, code_linetable=136, code_adaptive=200,
        str_ascii_data=40, str_compact_data=56, gil=7752, gil_in_interp=True),
}
DEBUG_OFFSETS_FROM = (3, 13)  # _Py_DebugOffsets exists from here on
FRAME_OWNED_BY_CSTACK = 3  # 3.12, 3.13 (pycore_frame.h): not in _Py_DebugOffsets
SUPPORTED = ", ".join(f"{a}.{b}" for a, b in sorted(LAYOUTS)) + " (3.13+: _Py_DebugOffsets)"


def layout_from_debug(off: dict[str, int], free_threaded: bool) -> Layout:
    """The walk's layout from a process's own _Py_DebugOffsets (3.13)."""
    ascii_size = off["unicode_object.asciiobject_size"]
    return Layout(
        runtime_interp_head=off["runtime_state.interpreters_head"],
        interp_threads_head=off["interpreter_state.threads_head"],
        tstate_next=off["thread_state.next"],
        tstate_tid=off["thread_state.native_thread_id"],
        tstate_frame=off["thread_state.current_frame"], cframe_frame=FL_PY_DIRECT,
        frame_code=off["interpreter_frame.executable"],
        frame_previous=off["interpreter_frame.previous"],
        frame_instr=off["interpreter_frame.instr_ptr"],
        frame_owner=off["interpreter_frame.owner"], owner_skip=FRAME_OWNED_BY_CSTACK,
        code_filename=off["code_object.filename"], code_qualname=off["code_object.qualname"],
        code_firstlineno=off["code_object.firstlineno"],
        code_linetable=off["code_object.linetable"],
        code_adaptive=off["code_object.co_code_adaptive"],
        bytes_data=off["bytes_object.ob_sval"], var_size=off["bytes_object.ob_size"],
        str_length=off["unicode_object.length"], str_state=off["unicode_object.state"],
        # PyCompactUnicodeObject adds utf8_length and utf8 (two words) to PyASCIIObject.
        str_ascii_data=ascii_size, str_compact_data=ascii_size + 16,
        gil=0 if free_threaded else off["interpreter_state.gil_runtime_state"],
        gil_in_interp=True, source="_Py_DebugOffsets")


_PY_FILE = re.compile(r"(?:^|/)(?:lib)?python(\d)\.(\d+)(t?)d?m?u?(?:\.so[.\d]*)?$")


@dataclass(slots=True)
class Interpreter:
    """A CPython process: its version, and where its runtime state lives (or why it
    cannot be followed)."""

    pid: int
    version: tuple[int, int]
    path: str  # the file holding _PyRuntime
    runtime: int = 0
    layout: Layout | None = None
    problem: str | None = None  # why its frames are not read
    free_threaded: bool = False  # no interpreter lock (3.13t)
    hexversion: int = 0  # PY_VERSION_HEX, where _Py_DebugOffsets said it
    note: str | None = None  # how the layout was found, where that is worth saying
    code_type: int = 0  # the address of PyCode_Type, once seen
    tid_offset: int | None = None  # 3.10: the kernel thread id's place in struct pthread
    names: dict[int, tuple[str, str, int, bytes] | None] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"CPython {self.version[0]}.{self.version[1]}{'t' if self.free_threaded else ''}"


def find_interpreter(pid: int) -> Interpreter | None:
    """The CPython a process runs, from its mappings; None if it runs none."""
    try:
        maps = symbols.mappings(pid)
    except OSError:
        return None
    bases = symbols.bases(maps)
    # libpython (a shared build) holds the runtime where it is mapped; else the executable.
    paths = sorted(bases, key=lambda p: "libpython" not in os.path.basename(p))
    for path in paths:
        m = _PY_FILE.search(os.path.basename(path))
        if m is not None:
            return _open(pid, path, bases[path], m)
    return None


def _open(pid: int, path: str, base: int, m: re.Match[str]) -> Interpreter:
    interp = Interpreter(pid, (int(m.group(1)), int(m.group(2))), path,
                         free_threaded=bool(m.group(3)))
    # The file as the process maps it, resolved inside its root: a container may have
    # put a link, a FIFO or a device at that path since (fleetd.security.procfs).
    with regular_in_root(pid, path) as file:
        image = symbols.load_image(file, ("STT_OBJECT",)) if file is not None else None
        runtime = _symbol(image, "_PyRuntime") if image is not None else None
        if file is None or image is None or runtime is None:
            interp.problem = (f"{interp.label} at {path} has no _PyRuntime symbol "
                              "(stripped?); native stacks only")
            return interp
        interp.runtime = at = base - (image.first_vaddr & ~0xFFF) + runtime
        mem, real = Memory(pid), file
        try:
            _choose_layout(interp, lambda n: mem.read(at, n),
                           lambda n: _file_bytes(real, runtime, n))
        finally:
            mem.close()
    return interp


def _choose_layout(interp: Interpreter, read_live: Callable[[int], bytes],
                   read_file: Callable[[int], bytes]) -> None:
    """3.13+: the interpreter's own _Py_DebugOffsets (the running process's, else the
    file's: the table is a constant); before: the measured table. Sets the layout, or
    the problem."""
    if interp.version >= DEBUG_OFFSETS_FROM:
        why = "?"
        for read in (read_live, read_file):
            try:
                hexv, free, off = pydebug.parse(read)
            except (OSError, pydebug.DebugOffsetsError, struct.error, KeyError) as exc:
                why = str(exc)
                if isinstance(exc, pydebug.DebugOffsetsError):
                    break  # the bytes were read: another copy says the same
                continue
            if pydebug.version_of(hexv) != interp.version:
                why = (f"_Py_DebugOffsets says {pydebug.version_of(hexv)}, the file name "
                       f"{interp.version}")
                break
            interp.hexversion, interp.free_threaded = hexv, free
            interp.layout = layout_from_debug(off, free)
            return
        fallback = LAYOUTS.get(interp.version)
        if fallback is None or interp.free_threaded:
            interp.problem = f"{interp.label}: {why}; native stacks only"
            return
        interp.layout, interp.note = fallback, f"measured table ({why})"
        return
    interp.layout = LAYOUTS.get(interp.version)
    if interp.layout is None:
        interp.problem = (f"{interp.label} is not supported (supported: {SUPPORTED}); "
                          "native stacks only")


def _file_bytes(path: str, vaddr: int, n: int) -> bytes:
    """n bytes at a virtual address of an ELF file's initialised data."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            for seg in ELFFile(f).iter_segments():
                lo = seg["p_vaddr"]
                if seg["p_type"] == "PT_LOAD" and lo <= vaddr and vaddr + n <= lo + seg["p_filesz"]:
                    f.seek(seg["p_offset"] + vaddr - lo)
                    return f.read(n)
    except ELFError as exc:
        raise OSError(f"{path}: {exc}") from exc
    raise OSError(f"{path}: {vaddr:#x} is not in the file's data")


def gil_address(interp: Interpreter, mem: Memory) -> int | None:
    """Where the (main) interpreter's lock lives: in _PyRuntime up to 3.11, in the
    interpreter state from 3.12 (the main interpreter's is itself inside _PyRuntime).
    None for a free-threaded build: it has no interpreter lock."""
    lay = interp.layout
    if lay is None or interp.free_threaded or not interp.runtime:
        return None
    if not lay.gil_in_interp:
        return interp.runtime + lay.gil
    head = mem.u64(interp.runtime + lay.runtime_interp_head)
    return head + lay.gil if head else None


def _symbol(image: Any, name: str) -> int | None:
    for addr, _size, sym in image.symbols:
        if sym == name:
            return int(addr)
    return None


_USER_END = 1 << 63  # pread's offset is signed: higher addresses are no one's memory


class Memory:
    """Reads of another process's memory through /proc/PID/mem."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None

    def read(self, addr: int, n: int) -> bytes:
        # A pointer read from a frame the target is rewriting can be any 64-bit value;
        # pread takes a signed offset, so one past 2^63 is as unreadable as a hole.
        if not 0 <= addr < _USER_END:
            raise OSError(f"unreadable address {addr:#x}")
        if self._fd is None:
            self._fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
        data = os.pread(self._fd, n, addr)
        if len(data) != n:
            raise OSError(f"short read at {addr:#x}")
        return data

    def u64(self, addr: int) -> int:
        return int(struct.unpack("<Q", self.read(addr, 8))[0])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def thread_states(interp: Interpreter, mem: Memory) -> dict[int, int]:
    """native thread id -> PyThreadState address, of the main interpreter's threads."""
    lay = interp.layout
    assert lay is not None
    head = mem.u64(interp.runtime + lay.runtime_interp_head)
    states: list[tuple[int, int]] = []  # (the tstate's thread field, tstate)
    if not head:
        return {}
    ts = mem.u64(head + lay.interp_threads_head)
    while ts and len(states) < MAX_THREADS:
        states.append((mem.u64(ts + lay.tstate_tid), ts))
        ts = mem.u64(ts + lay.tstate_next)
    if not lay.pthread_tid:
        return {tid & 0xFFFFFFFF: t for tid, t in states if tid & 0xFFFFFFFF}
    if interp.tid_offset is None:
        interp.tid_offset = _pthread_tid_offset(interp.pid, mem, [p for p, _ in states])
        if interp.tid_offset is None:
            return {}
    out = {}
    for pthread, t in states:
        try:  # a thread that has just exited may have its struct pthread unmapped
            tid = struct.unpack("<i", mem.read(pthread + interp.tid_offset, 4))[0] \
                if pthread else 0
        except OSError:
            continue
        if tid > 0:
            out[tid] = t
    return out


PTHREAD_SCAN = 2048  # bytes of glibc's struct pthread searched for its tid field


def _pthread_tid_offset(pid: int, mem: Memory, pthreads: list[int]) -> int | None:
    """Where glibc keeps the kernel's thread id in struct pthread (pthread_t is its
    address): the one 4-byte slot that holds, for every thread CPython lists, a task id
    of the process, and the process id for one of them (the main thread). Found in the
    target itself, so its own glibc's layout counts, not fleetd's."""
    try:
        tasks = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        blobs = [mem.read(p, PTHREAD_SCAN) for p in pthreads if p]
    except (OSError, ValueError) as exc:
        log.debug("thread ids of pid %d unreadable: %s", pid, exc)
        return None
    if not blobs:
        return None
    for off in range(0, PTHREAD_SCAN, 4):
        ids = [struct.unpack_from("<i", b, off)[0] for b in blobs]
        if pid in ids and all(i in tasks for i in ids) and len(set(ids)) == len(ids):
            return off
    return None


def frame_name(interp: Interpreter, mem: Memory, code: int, instr: int) -> str | None:
    """``qualname (file:line)`` of a frame; None where the code object is unreadable.
    fleetd.analyze.stacks recognises Python frames by this shape."""
    lay = interp.layout
    assert lay is not None
    if code not in interp.names:
        interp.names[code] = _read_code(interp, mem, code)
    got = interp.names[code]
    if got is None:
        return None
    filename, qualname, first, table = got
    line: int | None = None
    if lay.lasti_index:  # 3.10: f_lasti (int, -1 before the first instruction)
        lasti = instr & 0xFFFFFFFF
        if lasti < 0x80000000:
            line = line_at_310(table, first, lasti * 2)
    elif instr:
        index = (instr - (code + lay.code_adaptive)) // 2
        line = line_at(table, first, index) if index >= 0 else None
    return f"{qualname} ({filename}:{line if line is not None else first})"


def walk(interp: Interpreter, mem: Memory, tstate: int, limit: int = 64) -> list[str]:
    """A thread's Python frames, innermost first, read from user space: the twin of the
    kernel's walk (bpf/common.bpf.c fl_py_walk), with the same offsets and the same
    frames left out. Exact for a thread that holds still (asleep, or in a call)."""
    lay = interp.layout
    assert lay is not None
    frame = mem.u64(tstate + lay.tstate_frame)
    if lay.cframe_frame != FL_PY_DIRECT and frame:
        frame = mem.u64(frame + lay.cframe_frame)
    out: list[str] = []
    while frame and len(out) < limit:
        owner = mem.read(frame + lay.frame_owner, 1)[0]
        if lay.owner_skip == NO_OWNER_SKIP or owner != lay.owner_skip:
            code, instr = mem.u64(frame + lay.frame_code), mem.u64(frame + lay.frame_instr)
            out.append(frame_name(interp, mem, code, instr) or f"{code:#x} (python)")
        frame = mem.u64(frame + lay.frame_previous)
    return out


def _read_code(interp: Interpreter, mem: Memory, code: int) -> tuple[str, str, int, bytes] | None:
    lay = interp.layout
    assert lay is not None
    try:
        kind = mem.u64(code + 8)
        if interp.code_type and kind != interp.code_type:
            return None  # not a code object (a frame the walk read half-built)
        if not interp.code_type:
            if _cstring(mem, mem.u64(kind + 24)) != "code":  # tp_name
                return None
            interp.code_type = kind
        filename = _str(mem, lay, mem.u64(code + lay.code_filename))
        qualname = _str(mem, lay, mem.u64(code + lay.code_qualname))
        first = struct.unpack("<i", mem.read(code + lay.code_firstlineno, 4))[0]
        tab = mem.u64(code + lay.code_linetable)
        size = mem.u64(tab + lay.var_size)
        table = mem.read(tab + lay.bytes_data, min(size, 1 << 20)) if size else b""
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        log.debug("code object %#x of pid %d unreadable: %s", code, interp.pid, exc)
        return None
    return filename, qualname, int(first), table


def _str(mem: Memory, lay: Layout, obj: int) -> str:
    """A str object's text (compact strings: every name and path the compiler makes)."""
    length = mem.u64(obj + lay.str_length)
    state = struct.unpack("<I", mem.read(obj + lay.str_state, 4))[0]
    kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
    if not compact:
        return "?"
    n = min(length, MAX_TEXT)
    if ascii_:
        return mem.read(obj + lay.str_ascii_data, n).decode("ascii", errors="replace")
    width = {1: 1, 2: 2, 4: 4}.get(kind, 1)
    raw = mem.read(obj + lay.str_compact_data, n * width)
    codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[width]
    return raw.decode(codec, errors="replace")


def _cstring(mem: Memory, addr: int) -> str:
    data = mem.read(addr, 64)
    return data.split(b"\0", 1)[0].decode(errors="replace")


# ---- line tables (3.11+: Objects/locations.md of CPython) ----------------------------------

def _varint(t: bytes, i: int) -> tuple[int, int]:
    b = t[i]
    i += 1
    v, shift = b & 63, 0
    while b & 64:
        b = t[i]
        i += 1
        shift += 6
        v |= (b & 63) << shift
    return v, i


def _svarint(t: bytes, i: int) -> tuple[int, int]:
    v, i = _varint(t, i)
    return (-(v >> 1) if v & 1 else v >> 1), i


def line_at(table: bytes, first: int, index: int) -> int | None:
    """The line of instruction ``index`` (code units) from a 3.11+ location table:
    entries of 1-8 code units, each with a line delta (or no location at all)."""
    line, pos, i = first, 0, 0
    try:
        while i < len(table):
            head = table[i]
            i += 1
            code, length = (head >> 3) & 15, (head & 7) + 1
            delta: int | None
            if code == 15:  # no location
                delta = None
            elif code == 14:  # long form: line delta, end line, column, end column
                delta, i = _svarint(table, i)
                for _ in range(3):
                    _, i = _varint(table, i)
            elif code == 13:  # no column
                delta, i = _svarint(table, i)
            elif code >= 10:  # one line: delta code - 10, then column and end column
                delta, i = code - 10, i + 2
            else:  # short form: same line, one byte of columns
                delta, i = 0, i + 1
            if delta is not None:
                line += delta
            if pos <= index < pos + length:
                return line if delta is not None else None
            pos += length
    except IndexError:
        return None
    return None


def line_at_310(table: bytes, first: int, offset: int) -> int | None:
    """The line at byte ``offset`` from a 3.10 line table (co_linetable): pairs of an
    unsigned byte count and a signed line delta, -128 meaning no line (CPython 3.10's
    Objects/lnotab_notes.txt)."""
    line, end = first, 0
    for i in range(0, len(table) - 1, 2):
        start, end = end, end + table[i]
        delta = table[i + 1] - 256 if table[i + 1] > 127 else table[i + 1]
        if delta != -128:
            line += delta
        if start <= offset < end:
            return line if delta != -128 else None
    return None


# ---- what `fleetd check` says ---------------------------------------------------------------

def installed_interpreters() -> list[str]:
    """The CPython executables of the usual places (the system's, pyenv's, conda-style
    prefixes) and of the running fleetd."""
    import glob
    import sys

    roots = ["/usr/bin", "/usr/local/bin", "/opt/conda/bin", "/opt/python/*/bin"]
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    roots.append(f"{pyenv}/versions/*/bin")
    found = {os.path.realpath(p) for d in roots for p in glob.glob(f"{d}/python3.*")
             if re.search(r"python3\.\d+t?$", p)}
    found.add(os.path.realpath(sys.executable))
    return sorted(p for p in found if os.access(p, os.X_OK))


def support_of(path: str) -> str | None:
    """None when fleetd reads this interpreter's frames, else why not. Read from the
    files alone: the executable, or the libpython of its version beside it."""
    m = _PY_FILE.search(os.path.basename(path))
    if m is None:
        return "not a CPython executable name"
    interp = Interpreter(0, (int(m.group(1)), int(m.group(2))), path,
                         free_threaded=bool(m.group(3)))
    if interp.version not in LAYOUTS and interp.version < DEBUG_OFFSETS_FROM:
        return f"{interp.label} is not supported (supported: {SUPPORTED})"
    lib_dir = Path(path).resolve().parent.parent / "lib"
    lib = f"libpython{interp.version[0]}.{interp.version[1]}{m.group(3)}.so*"
    for candidate in [path, *sorted(str(p) for p in lib_dir.glob(lib))]:
        image = symbols.load_image(candidate, ("STT_OBJECT",))
        runtime = _symbol(image, "_PyRuntime") if image is not None else None
        if runtime is None:
            continue

        def from_file(n: int, file: str = candidate, at: int = runtime) -> bytes:
            return _file_bytes(file, at, n)

        _choose_layout(interp, from_file, from_file)
        return interp.problem
    return "no _PyRuntime symbol (stripped?)"


def running_interpreters() -> dict[int, Interpreter]:
    """pid -> its CPython, for every process on the machine that runs one."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            exe = os.readlink(f"/proc/{name}/exe")
            maps = Path(f"/proc/{name}/maps").read_text() if "python" not in exe else ""
        except OSError:
            continue  # gone, or a kernel thread
        if "python" in exe or "libpython" in maps:
            interp = find_interpreter(int(name))
            if interp is not None:
                out[int(name)] = interp
    return out


def describe(interp: Interpreter) -> str:
    """What `fleetd check` says of one process's interpreter."""
    if interp.problem or interp.layout is None:
        return f"{interp.label}: no Python frames ({interp.problem or 'unsupported'})"
    how = interp.note or ("offsets from its _Py_DebugOffsets"
                          if interp.layout.source == "_Py_DebugOffsets"
                          else "offsets from fleetd's table")
    lock = ("no interpreter lock (free-threaded: its locks are ordinary locks)"
            if interp.free_threaded else
            "interpreter lock per interpreter" if interp.layout.gil_in_interp
            else "interpreter lock in _PyRuntime")
    return f"{interp.label}: Python frames read ({how}); {lock}"


def brief(interp: Interpreter) -> str:
    """One process's interpreter in a few words: version, and how (or whether) read."""
    if interp.problem or interp.layout is None:
        return f"{interp.label} (native stacks only)"
    return f"{interp.label} (frames via {interp.layout.source})"
