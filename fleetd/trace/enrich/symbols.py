"""Names for addresses in a live process: which global a futex word belongs to, which
function a return address or a kernel's host stub is in.

A lock wait is recorded with its futex word's address. An address inside a loaded
file's data (a global ``pthread_mutex_t``, CPython's ``_PyRuntime`` that holds the
interpreter lock) is named from that file's ELF symbol table as ``symbol+offset
(file)``; heap and stack addresses have no name. BCC's symbolizer only knows functions,
so this reads the symbol tables itself (pyelftools), once per file, while the process
is alive (its mappings are gone when it exits).

A process that has exited is still named from its executable mappings as the tracer
last read them (:meth:`FunctionSymbols.remember`): each one's file, load address, device
and inode. The file is then read by its path, only if that path still holds the very
file the process mapped (same device and inode): a loaded tracer that drains a short
job's launches after the job has gone names them like any other.

Those mappings are kept from the moment each is made, not only when the tracer reads
them: the kernel reports every executable mapping of a file by a candidate process
(:meth:`FunctionSymbols.note_mapped`, from ``fl_rb_maps``). While the process lives a
report has its maps read (once for all the reports that read covers); once it has
gone, a report of a file whose layout is known (the same path at the same offset, read
before in any process) is kept as it stands. A process that starts after the
tracer, maps only files already seen and exits before the tracer gets to it (a loaded
tracer, a job of a few milliseconds) is named all the same.

Functions (:class:`FunctionSymbols`) come from the same tables, keyed by the file's GNU
build id (the same library under two paths, or two processes, is read once), with C++
names demangled by the C++ runtime's own ``__cxa_demangle``.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.security.procfs import regular_in_root
from fleetd.trace.host.libs import maps_device

if TYPE_CHECKING:
    from fleetd.trace.bpf.decoder import Batch
    from fleetd.trace.bpf.mapwatch import Mapped

log = logging.getLogger("fleetd.trace.enrich.symbols")

MAX_FILES = 256  # distinct files whose symbols are kept; a tracer sees few
NAME_EVERY_NS = 10 * 10**9  # a lock's name rides on one wait per this interval
MAX_LOCKS = 100_000  # (pid, address) pairs remembered before the memory starts over


@dataclass(frozen=True, slots=True)
class _Mapping:
    start: int
    end: int
    offset: int
    path: str
    executable: bool = False
    dev: int = 0  # the file's device and inode, as the kernel reports them in maps
    inode: int = 0


@dataclass(slots=True)
class _Image:
    """One ELF file: where its loadable segments start and end, and its data and
    function symbols sorted by address."""

    first_vaddr: int
    end_vaddr: int
    starts: list[int] = field(default_factory=list)
    symbols: list[tuple[int, int, str]] = field(default_factory=list)  # (addr, size, name)

    def name(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return None
        addr, size, name = self.symbols[i]
        return f"{name}+{vaddr - addr:#x}" if vaddr < addr + max(size, 1) else None


class DataSymbols:
    """``name(pid, addr)``, cached per (pid, addr) and per file."""

    def __init__(self) -> None:
        self._images: dict[str, _Image | None] = {}
        self._names: dict[tuple[int, int], str | None] = {}

    def name(self, pid: int, addr: int) -> str | None:
        key = (pid, addr)
        if key not in self._names:
            try:
                self._names[key] = self._resolve(pid, addr)
            except (OSError, ValueError) as exc:  # the process is gone, a file unreadable
                log.debug("address %#x of pid %d not named: %s", addr, pid, exc)
                self._names[key] = None
        return self._names[key]

    def _resolve(self, pid: int, addr: int) -> str | None:
        maps = mappings(pid)
        for path, base in bases(maps).items():
            image = self._image(path)
            if image is None:
                continue
            bias = base - (image.first_vaddr & ~0xFFF)
            if bias + image.first_vaddr <= addr < bias + image.end_vaddr:
                found = image.name(addr - bias)
                return f"{found} ({os.path.basename(path)})" if found else None
        return None

    def _image(self, path: str) -> _Image | None:
        if path not in self._images:
            if len(self._images) >= MAX_FILES:
                self._images.clear()
            self._images[path] = load_image(path)
        return self._images[path]


def mappings(pid: int) -> list[_Mapping]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append(_Mapping(lo, hi, int(parts[2], 16), parts[5].removesuffix(" (deleted)"),
                            "x" in parts[1], maps_device(parts[3]), int(parts[4])))
    return out


def bases(maps: list[_Mapping]) -> dict[str, int]:
    """Each file's lowest mapping of offset 0: where its first segment was loaded."""
    out: dict[str, int] = {}
    for m in maps:
        if m.offset == 0 and (m.path not in out or m.start < out[m.path]):
            out[m.path] = m.start
    return out


_DATA_KINDS = ("STT_OBJECT", "STT_FUNC", "STT_TLS")
# ELF symbol types by name (the low nibble of st_info).
_STT = {"STT_OBJECT": 1, "STT_FUNC": 2, "STT_TLS": 6, "STT_GNU_IFUNC": 10}
# Elf64_Sym, little-endian: st_name, st_info, st_other, st_shndx, st_value, st_size.
_SYM64 = struct.Struct("<IBBHQQ")


def load_image(path: str, kinds: tuple[str, ...] = _DATA_KINDS) -> _Image | None:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            if not loads:
                return None
            image = _Image(min(s["p_vaddr"] for s in loads),
                           max(s["p_vaddr"] + s["p_memsz"] for s in loads))
            syms: dict[int, tuple[int, int, str]] = {}
            fast = elf.elfclass == 64 and elf.little_endian
            for sec in elf.iter_sections():
                if not isinstance(sec, SymbolTableSection):
                    continue
                if fast:
                    _symbols64(sec.data(), elf.get_section(sec["sh_link"]).data(), kinds, syms)
                    continue
                for sym in sec.iter_symbols():
                    kind = sym["st_info"]["type"]
                    if kind in kinds and sym["st_value"] \
                            and sym.name:
                        syms.setdefault(sym["st_value"], (sym["st_value"], sym["st_size"],
                                                          sym.name))
    except (OSError, ELFError, ValueError, IndexError, struct.error) as exc:
        log.debug("no symbols from %s: %s", path, exc)
        return None
    image.symbols = sorted(syms.values())
    image.starts = [s[0] for s in image.symbols]
    return image


def _symbols64(table: bytes, strtab: bytes, kinds: tuple[str, ...],
               into: dict[int, tuple[int, int, str]]) -> None:
    """The named, non-zero symbols of these kinds from a 64-bit little-endian symbol
    table, read with one precompiled struct: pyelftools' per-symbol parsing takes
    seconds for a library such as libpython (16k symbols), and the tracer's loop waits
    for it while the ring buffers fill."""
    wanted = {_STT[k] for k in kinds if k in _STT}
    usable = len(table) - len(table) % _SYM64.size
    for name_at, info, _other, _shndx, value, size in _SYM64.iter_unpack(table[:usable]):
        if not value or not name_at or (info & 0xF) not in wanted or value in into:
            continue
        end = strtab.find(b"\0", name_at)
        name = strtab[name_at:end if end >= 0 else len(strtab)]
        if name:
            into[value] = (value, size, name.decode(errors="replace"))


class LockNames:
    """Puts the name of the futex word on lock waits (``args.lock``): on one wait per
    lock and :data:`NAME_EVERY_NS`, so a busy lock costs one small row now and then, and
    the analysis still finds a name for every lock that was waited on."""

    def __init__(self) -> None:
        self.symbols = DataSymbols()
        self._named: dict[tuple[int, int], int] = {}

    def resolve(self, batch: Batch) -> None:
        if not batch.futex_waits:
            return
        have = {row for row, _ in batch.args}
        now = time.monotonic_ns()
        if len(self._named) > MAX_LOCKS:
            self._named.clear()
        for row, pid, addr in batch.futex_waits:
            last = self._named.get((pid, addr))
            if last is not None and now - last < NAME_EVERY_NS:
                continue
            self._named[(pid, addr)] = now
            name = self.symbols.name(pid, addr)
            if name and row not in have:
                batch.args.append((row, {"lock": name}))


# ---- functions -------------------------------------------------------------------------

MAX_MAPS_AGE_S = 2.0  # a process's mappings are re-read on a miss at most this often
# Processes whose executable mappings are kept, live and exited alike, the least recently
# read dropped first: an agent lives for weeks and sees every short job on its node (a
# large job maps a few hundred files; only their executable mappings are kept).
MAX_PIDS = 1024
MAX_FILE_IDS = 16 * MAX_FILES  # (device, inode, mtime) -> build id, remembered


@dataclass(frozen=True, slots=True)
class _Text:
    """An executable mapping of a file as its process had it: enough to name the
    addresses in it from the file alone once the process has gone."""

    start: int
    end: int
    base: int  # where the file's first segment was loaded
    path: str
    dev: int
    inode: int
    offset: int = 0  # of the mapping in the file


# (path, offset in the file) -> (device, inode, start - base): where a mapping of that
# file at that offset sits from its first segment (the same in every process).
_Layout = tuple[int, int, int]


@dataclass(slots=True)
class _Snapshot:
    """A process's executable mappings, sorted by address, and when they were read."""

    read_at: float  # monotonic
    texts: list[_Text]
    starts: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, maps: list[_Mapping]) -> _Snapshot:
        loaded_at = bases(maps)
        texts = sorted((_Text(m.start, m.end, loaded_at[m.path], sys.intern(m.path), m.dev,
                              m.inode, m.offset)
                        for m in maps if m.executable and m.path in loaded_at),
                       key=lambda t: t.start)
        return cls(time.monotonic(), texts, [t.start for t in texts])

    def with_text(self, new: _Text) -> _Snapshot:
        """A copy with ``new`` in place of whatever it overlaps (a MAP_FIXED mapping
        replaces the pages under it); readers keep the old one until they look again."""
        texts = sorted([t for t in self.texts if t.end <= new.start or t.start >= new.end]
                       + [new], key=lambda t: t.start)
        return _Snapshot(self.read_at, texts, [t.start for t in texts])

    def find(self, addr: int) -> _Text | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.texts[i] if i >= 0 and addr < self.texts[i].end else None


class FunctionSymbols:
    """``name(pid, addr)``: the function an address of a process is in, as
    ``(name or None, file base name or None)``, demangled; ``locate`` also gives the
    address relative to the file (the same for every process that maps it). A process
    that has exited is named from its mappings as last read (module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Image | None] = {}  # build id (or path) -> functions
        self._ids: dict[tuple[int, int, int], str] = {}  # (dev, inode, mtime) -> build id
        self._maps: dict[int, _Snapshot] = {}  # in the order read: the oldest goes first
        self._layouts: dict[tuple[str, int], _Layout] = {}  # learned from every read
        self._writing = threading.Lock()
        # Hands over the mappings the kernel reported and no one has kept yet (set by
        # the tracer: fleetd.trace.bpf.mapwatch.MapWatch.catch_up); called on a miss.
        self.catch_up: Callable[[], None] | None = None

    def name(self, pid: int, addr: int) -> tuple[str | None, str | None]:
        sym, lib, _ = self.locate(pid, addr)
        return sym, lib

    def locate(self, pid: int, addr: int) -> tuple[str | None, str | None, int]:
        text = self._text(pid, addr)
        if text is None:
            return None, None, addr
        image = self._image(pid, text)
        lib = os.path.basename(text.path)
        if image is None:
            return None, lib, addr - text.base
        vaddr = addr - (text.base - (image.first_vaddr & ~0xFFF))
        i = bisect.bisect_right(image.starts, vaddr) - 1
        if i < 0:
            return None, lib, vaddr
        start, size, sym = image.symbols[i]
        if size and vaddr >= start + size:
            return None, lib, vaddr
        return demangle(sym), lib, vaddr

    def forget(self, pid: int) -> None:
        with self._writing:
            self._maps.pop(pid, None)

    def remember(self, pid: int) -> None:
        """Read ``pid``'s mappings now (the tracer does whenever it reads them itself: at
        start, at every maps scan, whenever a mapping hook holds the process): a tracer
        that falls behind names the addresses of a process that has exited since from
        its last mappings (the files stay on disk), instead of naming nothing."""
        with contextlib.suppress(OSError):
            self._keep(pid, _Snapshot.of(mappings(pid)))

    def note_mapped(self, m: Mapped) -> None:
        """The kernel saw ``m.pid`` map ``m.name`` executable at ``m.start``: keep it.
        A file whose layout is known (another read showed it at that offset) is placed
        with no read of the maps: while the process lives, once the mapping is checked
        to be that very file (one stat); once it has gone, as reported, and named later
        only while the path still holds that file (``_image``). Otherwise, and at a
        process's first report (the executable and the loader, mapped by exec, are
        reported by nothing), the maps are read while the process lives."""
        with self._writing:
            snap = self._maps.get(m.pid)
        if snap is not None and _shows(snap, m):
            return
        text = self._from_layout(m)
        if snap is not None and text is not None and _maps_file(m.pid, text):
            self._add(m.pid, text)
            return
        try:
            self._keep(m.pid, _Snapshot.of(mappings(m.pid)))
            return
        except OSError:  # gone already: what the report says is all there is
            pass
        if text is not None:
            self._add(m.pid, text)

    def _add(self, pid: int, text: _Text) -> None:
        with self._writing:
            snap = self._maps.get(pid)  # (the tracer's thread may have read it since)
        self._keep(pid, snap.with_text(text) if snap is not None
                   else _Snapshot(time.monotonic(), [text], [text.start]))

    def _from_layout(self, m: Mapped) -> _Text | None:
        if not m.name.startswith("/"):
            return None
        path = os.path.realpath(m.name)  # maps name the file by its resolved path
        layout = self._layouts.get((path, m.offset))
        if layout is None:
            return None
        dev, inode, from_base = layout
        return _Text(m.start, m.end, m.start - from_base, sys.intern(path), dev, inode,
                     m.offset)

    def _keep(self, pid: int, snap: _Snapshot) -> None:
        # Two threads write: the tracer's (a miss) and the mapping watcher's (remember,
        # note_mapped).
        with self._writing:
            self._maps.pop(pid, None)
            while len(self._maps) >= MAX_PIDS:
                del self._maps[next(iter(self._maps))]
            self._maps[pid] = snap
            if len(self._layouts) >= MAX_FILE_IDS:
                self._layouts.clear()
            for t in snap.texts:
                self._layouts[(t.path, t.offset)] = (t.dev, t.inode, t.start - t.base)

    def _text(self, pid: int, addr: int) -> _Text | None:
        snap = self._maps.get(pid)
        if snap is not None:
            found = snap.find(addr)
            if found is not None:
                return found
        if self.catch_up is not None:
            # Mappings the kernel reported that the watcher has not handed over yet (the
            # two threads run in no set order once a stopped tracer resumes).
            self.catch_up()
            snap = self._maps.get(pid)
            found = snap.find(addr) if snap is not None else None
            if found is not None:
                return found
        if snap is not None and time.monotonic() - snap.read_at <= MAX_MAPS_AGE_S:
            return None
        try:
            snap = _Snapshot.of(mappings(pid))
        except OSError:  # gone: what its last mappings did not name stays unnamed
            if snap is not None:
                snap.read_at = time.monotonic()  # (and /proc is not asked again at once)
            return None
        self._keep(pid, snap)
        return snap.find(addr)

    def _image(self, pid: int, text: _Text) -> _Image | None:
        # Through /proc/PID/root: the file as the process sees it (containers). Once the
        # process has exited (or while it exits), by the path from our own root, and only
        # while that path holds the very file it mapped (one replaced since is another).
        for owner in (pid, os.getpid()):
            mine = owner != pid
            try:
                st = os.stat(text.path if mine else f"/proc/{pid}/root{text.path}")
            except OSError:
                continue
            if mine and not _same_file(st, text):
                return None
            key = (st.st_dev, st.st_ino, int(st.st_mtime))
            bid = self._ids.get(key)
            if bid is not None and bid in self._by_id:
                return self._by_id[bid]
            # A file read for the first time: inside the root and a regular file only,
            # never a FIFO or device put at the mapped path (fleetd.security.procfs);
            # checked again on what was opened (the path may have changed since).
            with regular_in_root(owner, text.path) as safe:
                if safe is None or (mine and not _same_file(os.stat(safe), text)):
                    continue
                if bid is None:
                    bid = build_id(safe) or text.path
                    if len(self._ids) >= MAX_FILE_IDS:
                        self._ids.clear()
                    self._ids[key] = bid
                if len(self._by_id) >= MAX_FILES:
                    self._by_id.clear()
                self._by_id[bid] = load_image(safe, ("STT_FUNC", "STT_GNU_IFUNC"))
                return self._by_id[bid]
        return None


def _shows(snap: _Snapshot, m: Mapped) -> bool:
    t = snap.find(m.start)
    return t is not None and (t.start, t.end, t.offset) == (m.start, m.end, m.offset)


def _maps_file(pid: int, text: _Text) -> bool:
    """Whether ``pid``'s mapping at ``text`` is that very file (map_files names each
    mapping; no leading zeros)."""
    try:
        return _same_file(os.stat(f"/proc/{pid}/map_files/{text.start:x}-{text.end:x}"), text)
    except OSError:
        return False


def _same_file(st: os.stat_result, text: _Text) -> bool:
    return (st.st_dev, st.st_ino) == (text.dev, text.inode)


def build_id(path: str) -> str | None:
    """The file's GNU build id in hex, or None."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            from elftools.elf.sections import NoteSection

            sec = ELFFile(f).get_section_by_name(".note.gnu.build-id")
            if not isinstance(sec, NoteSection):
                return None
            for note in sec.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
    except (OSError, ELFError, ValueError):
        return None
    return None


@functools.lru_cache(maxsize=1)
def _cxa_demangle() -> tuple[Any, Any] | None:
    """``__cxa_demangle`` from the C++ runtime and libc's ``free``, or None."""
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_int)]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    return fn, free


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """A C++ (Itanium ABI) symbol as source reads it; other names as they are."""
    if not name.startswith("_Z"):
        return name
    api = _cxa_demangle()
    if api is None:
        return name
    fn, free = api
    status = ctypes.c_int(0)
    out = fn(name.encode(), None, None, ctypes.byref(status))
    if not out:
        return name
    try:
        text = ctypes.string_at(out).decode(errors="replace")
    finally:
        free(out)
    return text if status.value == 0 else name
