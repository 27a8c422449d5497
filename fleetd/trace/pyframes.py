"""Python frames of CUDA calls: which interpreter a process runs, where its threads'
frame chains start, and what a (code object, instruction) pair means as file:line.

The walk itself happens in the kernel at the call (bpf/common.bpf.c ``fl_py_walk``): it
needs, per process, where this CPython version keeps a thread's current frame and a
frame's fields (:class:`Layout`), and per thread the address of its ``PyThreadState``.
A thread calling into CUDA through ctypes (or any extension that releases the GIL) is
not the interpreter's "current" thread, so the thread states are found here instead,
by reading the interpreter's thread list from ``_PyRuntime`` (an exported symbol of the
executable or of libpython) and filed by native thread id.

Code objects outlive the calls that ran them, so their names and line tables are read
from the process's memory after the event, once per code object.

The offsets are those of the x86-64 builds, measured with ``offsetof`` against each
version's own headers (a small C program compiled with gcc).
"""

from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.trace.symbols import _bases, _load, _mappings

log = logging.getLogger("fleetd.trace.pyframes")

FL_PY_DIRECT = 0xFFFFFFFF  # bpf/fleetd.h: the tstate field already is the current frame
NO_OWNER_SKIP = 0xFF  # no shim frames to skip in this version
MAX_THREADS = 4096  # thread states followed per interpreter, against a corrupt list
MAX_TEXT = 4096  # characters read of a file or function name


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one CPython version keeps what the walk and the naming read."""

    runtime_interp_head: int  # _PyRuntimeState.interpreters.head
    interp_threads_head: int  # PyInterpreterState.threads.head
    tstate_next: int
    tstate_tid: int  # PyThreadState.native_thread_id
    tstate_frame: int  # .cframe (3.11, 3.12) / .current_frame (3.13)
    cframe_frame: int  # _PyCFrame.current_frame, or FL_PY_DIRECT
    frame_code: int
    frame_previous: int
    frame_instr: int  # prev_instr (3.11, 3.12): the instruction running
    frame_owner: int
    owner_skip: int  # owner of frames that run no Python code, or NO_OWNER_SKIP
    code_filename: int
    code_qualname: int
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int  # co_code_adaptive: the instructions, inline in the code object
    bytes_data: int = 32  # PyBytesObject.ob_sval
    var_size: int = 16  # PyVarObject.ob_size
    str_length: int = 16  # PyASCIIObject.length
    str_state: int = 32  # PyASCIIObject.state
    str_ascii_data: int = 48  # sizeof(PyASCIIObject)
    str_compact_data: int = 72  # sizeof(PyCompactUnicodeObject)


# Measured against CPython 3.11.2 (Debian) and 3.11.7 (pyenv) headers: identical.
LAYOUTS: dict[tuple[int, int], Layout] = {
    (3, 11): Layout(
        runtime_interp_head=40, interp_threads_head=16, tstate_next=8, tstate_tid=160,
        tstate_frame=56, cframe_frame=8, frame_code=32, frame_previous=48, frame_instr=56,
        frame_owner=69, owner_skip=NO_OWNER_SKIP, code_filename=112, code_qualname=128,
        code_firstlineno=72, code_linetable=136, code_adaptive=184),
}
SUPPORTED = ", ".join(f"{a}.{b}" for a, b in sorted(LAYOUTS))

_PY_FILE = re.compile(r"(?:^|/)(?:lib)?python(\d)\.(\d+)(?:\.so[.\d]*|d?m?u?)?$")


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
    code_type: int = 0  # the address of PyCode_Type, once seen
    names: dict[int, tuple[str, str, int, bytes] | None] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"CPython {self.version[0]}.{self.version[1]}"


def find_interpreter(pid: int) -> Interpreter | None:
    """The CPython a process runs, from its mappings; None if it runs none."""
    try:
        maps = _mappings(pid)
    except OSError:
        return None
    bases = _bases(maps)
    # libpython (a shared build) holds the runtime where it is mapped; else the executable.
    paths = sorted(bases, key=lambda p: "libpython" not in os.path.basename(p))
    for path in paths:
        m = _PY_FILE.search(os.path.basename(path))
        if m is None:
            continue
        interp = Interpreter(pid, (int(m.group(1)), int(m.group(2))), path)
        interp.layout = LAYOUTS.get(interp.version)
        if interp.layout is None:
            interp.problem = (f"{interp.label} is not supported (supported: {SUPPORTED}); "
                              "native stacks only")
            return interp
        image = _load(f"/proc/{pid}/root{path}", ("STT_OBJECT",))
        runtime = _symbol(image, "_PyRuntime") if image is not None else None
        if image is None or runtime is None:
            interp.problem = (f"{interp.label} at {path} has no _PyRuntime symbol "
                              "(stripped?); native stacks only")
            return interp
        interp.runtime = bases[path] - (image.first_vaddr & ~0xFFF) + runtime
        return interp
    return None


def _symbol(image: Any, name: str) -> int | None:
    for addr, _size, sym in image.symbols:
        if sym == name:
            return int(addr)
    return None


class Memory:
    """Reads of another process's memory through /proc/PID/mem."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None

    def read(self, addr: int, n: int) -> bytes:
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
    out: dict[int, int] = {}
    if not head:
        return out
    ts = mem.u64(head + lay.interp_threads_head)
    while ts and len(out) < MAX_THREADS:
        tid = mem.u64(ts + lay.tstate_tid) & 0xFFFFFFFF
        if tid:
            out[tid] = ts
        ts = mem.u64(ts + lay.tstate_next)
    return out


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
    index = (instr - (code + lay.code_adaptive)) // 2 if instr else -1
    line = line_at(table, first, index) if index >= 0 else None
    return f"{qualname} ({filename}:{line if line is not None else first})"


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


# ---- what `fleetd check` says ---------------------------------------------------------------

def installed_interpreters() -> list[str]:
    """The CPython executables of the usual places and of the running fleetd."""
    import glob
    import sys

    found = {os.path.realpath(p) for d in ("/usr/bin", "/usr/local/bin")
             for p in glob.glob(f"{d}/python3.*") if re.search(r"python3\.\d+$", p)}
    found.add(os.path.realpath(sys.executable))
    return sorted(p for p in found if os.access(p, os.X_OK))


def support_of(path: str) -> str | None:
    """None when fleetd reads this interpreter's frames, else why not."""
    m = _PY_FILE.search(os.path.basename(path))
    if m is None:
        return "not a CPython executable name"
    version = (int(m.group(1)), int(m.group(2)))
    if version not in LAYOUTS:
        return f"CPython {version[0]}.{version[1]} is not supported (supported: {SUPPORTED})"
    lib_dir = Path(path).resolve().parent.parent / "lib"
    for candidate in [path, *sorted(str(p) for p in lib_dir.glob("libpython3*.so*"))]:
        image = _load(candidate, ("STT_OBJECT",))
        if image is not None and _symbol(image, "_PyRuntime") is not None:
            return None
    return "no _PyRuntime symbol (stripped?)"
