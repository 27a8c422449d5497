"""Finding the CUDA code to probe, and the entry points it defines.

Uprobes bind to a file's inode, so we attach to the exact file a target process has
mapped (read from /proc/PID/maps), not to some other copy: the file is opened through
/proc/PID/map_files (or resolved inside the process's root), checked to be the maps
line's device and inode, and read and probed only through that descriptor
(:func:`verified_file`), never by a path the kernel would resolve again. A mapped file is told by
the symbols it defines (.dynsym and .symtab), not by its name: a libcudart.so, a copy
vendored under another name (libcudart-1a2b3c4d.so.12), an executable or a framework's
.so linked with the static runtime, libnccl (which carries the runtime too) are all
found; a stripped file that carries the runtime is recognised by the static runtime's
table of API names in its .rodata (it cannot be probed: the tracer warns). The usual
places (venv ``nvidia/*/lib`` and ``*.libs`` directories, torch's ``lib``,
/usr/local/cuda*, the dynamic linker cache) are probed at start, before anything maps
them. ``--cuda-lib`` overrides.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import re
import site
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from fleetd.security import procfs

log = logging.getLogger("fleetd.trace.host.libs")

# kind -> file name pattern, for the usual places searched before any process maps a
# file (the dynamic linker's cache holds hundreds of libraries: their names say enough);
# a copy vendored by auditwheel carries a hash (libcudart-1a2b3c4d.so.12). Mapped files
# are told by the symbols they define (file_kinds), whatever their names.
KINDS: dict[str, re.Pattern[str]] = {
    "cudart": re.compile(r"^libcudart(-[0-9a-f]{8})?\.so(\.\d+)*$"),
    "cuda": re.compile(r"^libcuda\.so(\.\d+)*$"),
    "nccl": re.compile(r"^libnccl(-[0-9a-f]{8})?\.so(\.\d+)*$"),
}
LAYER_OF_KIND = {"cudart": "cuda", "cuda": "driver", "nccl": "nccl"}
MAX_CLASSIFIED = 65536  # mapped files whose kinds are remembered by (device, inode)


@dataclass(frozen=True, slots=True)
class MapsLine:
    """Where a process maps a library: what opens that very file again."""

    pid: int
    span: str  # "7f12a000-7f12b000", as the maps line gives it
    path: str  # as the process mapped it (inside its own root)
    key: tuple[str, int]  # (device as the maps line writes it, inode)


@dataclass(frozen=True, slots=True)
class Library:
    kind: str  # cudart | cuda | nccl
    # What users and reports see: /proc/PID/root/<mapped path> for a mapped library,
    # else the host path. Never opened or probed by this path (verified_file).
    path: str
    dev: int
    ino: int
    found_by: str  # "maps:PID", "override", "venv", "torch", "ldconfig", "cache"
    mapped: MapsLine | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple[int, int, str]:
        """One file may carry more than one kind (libnccl links the runtime statically)."""
        return (self.dev, self.ino, self.kind)


def kind_of(path: str | Path) -> str | None:
    name = Path(path).name
    for kind, pattern in KINDS.items():
        if pattern.match(name):
            return kind
    return None


def _library(path: str, kind: str, found_by: str) -> Library | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Library(kind, path, st.st_dev, st.st_ino, found_by)


@dataclass(slots=True)
class Mapped:
    """What one process maps: its CUDA code by kind, and the files that carry the
    runtime where their symbol tables cannot show its entry points (stripped)."""

    libs: list[Library] = field(default_factory=list)
    hidden_runtimes: list[str] = field(default_factory=list)  # paths as the process sees them


# (device as /proc/PID/maps writes it, inode) -> (kinds, hidden runtime): a mapped file
# is read once, however many processes map it and however often they are scanned.
_classified: dict[tuple[str, int], tuple[tuple[str, ...], bool]] = {}


def scan_mapped(pid: int) -> Mapped:
    """The executable file mappings of ``pid`` (empty if it is gone), told by symbols."""
    out = Mapped()
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return out
    seen: set[tuple[str, int]] = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or "x" not in parts[1] or not parts[5].startswith("/"):
            continue
        path, key = parts[5], (parts[3], int(parts[4]))
        if key in seen or path.endswith(" (deleted)"):
            continue
        seen.add(key)
        if _classified.get(key) == ((), False):
            continue  # read before: no CUDA code in it, nothing to open
        with _mapped_file(pid, parts[0], path, key) as opened:
            if opened is None:
                continue
            fd_path, st = opened
            kinds, hidden = _classify(key, fd_path)
        # Shown as the process's own file; opened again for the attach through the
        # maps line (verified_file), never through this path.
        where = MapsLine(pid, parts[0], path, key)
        out.libs += [Library(kind, f"/proc/{pid}/root{path}", st.st_dev, st.st_ino,
                             f"maps:{pid}", where) for kind in kinds]
        if hidden:
            out.hidden_runtimes.append(path)
    return out


@contextlib.contextmanager
def _mapped_file(pid: int, span: str, path: str, key: tuple[str, int]
                 ) -> Iterator[tuple[str, os.stat_result] | None]:
    """The file of one maps line, open: (a /proc/self/fd path to read it through, its
    stat), or None where no file that can be opened is the mapped one.

    Opened first, checked after: the descriptor's own device and inode must be the maps
    line's, so a container that swaps the file at the path between a check and an open
    cannot make us read (or probe) another file. ``/proc/PID/map_files`` is the mapped
    file itself, whatever its path names now; on an overlay filesystem, where the maps
    line may give the overlay's inode and map_files the layer's, the path resolved
    inside the process's root (fleetd.security.procfs) is tried too."""
    start, _, end = span.partition("-")
    spans = f"{int(start, 16):x}-{int(end, 16):x}"  # map_files names have no leading 0s
    tries: list[Callable[[], contextlib.AbstractContextManager[str | None]]] = [
        lambda: _opened(f"/proc/{pid}/map_files/{spans}"),
        lambda: procfs.regular_in_root(pid, path)]
    for attempt in tries:
        with attempt() as fd_path:
            st = _stat_if(fd_path)
            if fd_path is not None and st is not None and _same_file(st, key):
                yield fd_path, st
                return
    yield None


@contextlib.contextmanager
def verified_file(lib: Library) -> Iterator[str]:
    """``lib``'s very file, open for the block, as a ``/proc/self/fd/N`` path: what its
    symbols are read through and its probes attached to (the kernel's lookup of that
    path follows the descriptor to its file, so a uprobe lands on this inode). A mapped
    library is opened again through its maps line, a found one by its host path; either
    must be the device and inode the library was found as. OSError (ESTALE) otherwise:
    the process has unmapped it or exited, or another file is at the path now."""
    if lib.mapped is not None:
        m = lib.mapped
        with _mapped_file(m.pid, m.span, m.path, m.key) as opened:
            if opened is None:
                raise OSError(errno.ESTALE, f"pid {m.pid} no longer maps {m.path} "
                                            f"(inode {m.key[1]}) at {m.span}")
            yield opened[0]
        return
    with _opened(lib.path) as fd_path:
        st = _stat_if(fd_path)
        if fd_path is None or st is None or not stat.S_ISREG(st.st_mode) or (
                st.st_dev, st.st_ino) != (lib.dev, lib.ino):
            raise OSError(errno.ESTALE, f"{lib.path} is no longer the file found there "
                                        f"(inode {lib.ino})")
        yield fd_path


@contextlib.contextmanager
def _opened(path: str) -> Iterator[str | None]:
    """``path`` open for reading (never blocking) for the block, as a /proc/self/fd
    path; None where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _stat_if(fd_path: str | None) -> os.stat_result | None:
    if fd_path is None:
        return None
    try:
        return os.stat(fd_path)  # the open file's own (the magic link is followed)
    except OSError:
        return None


def maps_device(text: str) -> int:
    """The device a maps line writes as "fd:01" (hex major:minor); ValueError if not."""
    major, _, minor = text.partition(":")
    return os.makedev(int(major, 16), int(minor, 16))


def _same_file(st: os.stat_result, key: tuple[str, int]) -> bool:
    """A regular file whose device and inode are a maps line's ("fd:01", inode)."""
    try:
        dev = maps_device(key[0])
    except ValueError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (dev, key[1])


def _classify(key: tuple[str, int], path: str) -> tuple[tuple[str, ...], bool]:
    got = _classified.get(key)
    if got is None:
        try:
            kinds, hidden = file_kinds(path)
            got = (tuple(kinds), hidden)
        except (OSError, ValueError) as exc:  # not ELF (a JIT's file), unreadable
            log.debug("%s: not classified: %s", path, exc)
            got = ((), False)
        if len(_classified) >= MAX_CLASSIFIED:
            _classified.clear()
        _classified[key] = got
    return got


def mapped_libraries(pid: int) -> list[Library]:
    """CUDA code mapped by ``pid`` right now (empty if it is gone)."""
    return scan_mapped(pid).libs


def all_mapped_libraries() -> list[Library]:
    """CUDA libraries mapped by any process but ours (system-wide discovery)."""
    out: dict[tuple[int, int, str], Library] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != me:
            for lib in mapped_libraries(int(entry.name)):
                out.setdefault(lib.key, lib)
    return list(out.values())


def _site_dirs() -> list[Path]:
    dirs = [Path(p) for p in sys.path if p.endswith("site-packages")]
    with contextlib.suppress(AttributeError):  # missing in some embedded Pythons
        dirs += [Path(p) for p in site.getsitepackages()]
    env = os.environ.get("VIRTUAL_ENV")
    if env:
        dirs += list(Path(env).glob("lib/python3*/site-packages"))
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def _ldconfig_libs() -> list[str]:
    try:
        out = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines() if "=>" in line]


def search_usual_places(extra_dirs: Iterable[Path] = ()) -> list[Library]:
    """CUDA libraries in the usual places: probed before any process maps them (a
    uprobe on a file is installed by the kernel when a process maps it, so a later
    dlopen of one of these is covered from its first call). Found by name (the
    dynamic linker's cache alone lists hundreds of files), then each one's kinds by
    its symbols (libnccl carries the runtime too)."""
    found: dict[tuple[int, int, str], Library] = {}

    def add(path: Path | str, by: str) -> None:
        named = kind_of(path)
        if named is None:
            return
        real = str(Path(path).resolve())
        try:
            kinds = file_kinds(real)[0] or [named]
        except (OSError, ValueError):
            kinds = [named]
        for kind in kinds:
            lib = _library(real, kind, by)
            if lib is not None:
                found.setdefault(lib.key, lib)

    for d in extra_dirs:
        for p in d.glob("*.so*"):
            add(p, "cache")
    for sp in _site_dirs():
        for p in sp.glob("nvidia/*/lib/*.so*"):
            add(p, "venv")
        for p in sp.glob("torch/lib/*.so*"):
            add(p, "torch")
        for p in sp.glob("*.libs/*.so*"):  # copies vendored by auditwheel
            add(p, "venv")
    for toolkit in glob.glob("/usr/local/cuda*/lib64/*.so*") + glob.glob(
            "/usr/local/cuda*/targets/*/lib/*.so*"):
        add(toolkit, "cuda-toolkit")
    for cached in _ldconfig_libs():
        add(cached, "ldconfig")
    return list(found.values())


def override_libraries(paths: Iterable[str]) -> list[Library]:
    """``--cuda-lib PATH`` values; the kind comes from the name, else from exports."""
    from fleetd.errors import UsageError

    out: list[Library] = []
    for raw in paths:
        path: str = os.path.realpath(raw)
        if not os.path.isfile(path):
            raise UsageError(
                f"--cuda-lib {raw!r} is not a file",
                "pass the path of libcudart.so*, libcuda.so* or libnccl.so* "
                "(as the target process maps it: see /proc/PID/maps)",
            )
        kind = kind_of(path) or _kind_from_exports(path)
        if kind is None:
            raise UsageError(
                f"--cuda-lib {raw!r} exports no CUDA runtime, driver or NCCL function",
                "pass libcudart.so*, libcuda.so* or libnccl.so*",
            )
        lib = _library(path, kind, "override")
        if lib is not None:
            out.append(lib)
    return out


def _kind_from_exports(path: str) -> str | None:
    try:
        kinds = file_kinds(path)[0]
    except (OSError, ValueError):
        return None
    return kinds[0] if kinds else None


# ---- ELF: the CUDA entry points a file defines -----------------------------------------

# The symbols that say which CUDA code a file carries, whatever its name: the runtime
# (a libcudart.so, a copy vendored as libcudart-1a2b3c4d.so.12, an executable or a
# framework's .so linked with libcudart_static.a), the driver, NCCL.
KIND_MARKERS: dict[str, tuple[str, ...]] = {
    "cudart": ("cudaLaunchKernel", "cudaMalloc"),
    "cuda": ("cuInit", "cuLaunchKernel"),
    "nccl": ("ncclAllReduce", "ncclCommInitRank"),
}
_MARKERS = frozenset(n for names in KIND_MARKERS.values() for n in names)
# Strings of the static runtime's own table of its API names (.rodata), which a stripped
# executable keeps when its symbol tables are gone: both together are the runtime's.
RUNTIME_FINGERPRINT = (b"__cudaInitModule\0", b"cudaGetDriverEntryPoint\0")
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_PHDR = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr


@dataclass(frozen=True, slots=True)
class ElfExports:
    offsets: dict[str, int] = field(default_factory=dict)  # name -> file offset
    # The static runtime's fingerprint in a file whose symbol tables do not name it
    # (stripped): the runtime is in there, its entry points cannot be found.
    hidden_runtime: bool = False

    def __contains__(self, name: object) -> bool:
        return name in self.offsets


def file_kinds(path: str) -> tuple[list[str], bool]:
    """The kinds of CUDA code ``path`` defines entry points for (by its symbols, not its
    name), and whether it carries a runtime that its symbol tables do not name."""
    found = exported_functions(path, _MARKERS, fingerprint=True)
    kinds = [k for k, names in KIND_MARKERS.items() if any(n in found for n in names)]
    return kinds, found.hidden_runtime and "cudart" not in kinds


def exported_functions(path: str, wanted: frozenset[str] | None = None, *,
                       fingerprint: bool = False) -> ElfExports:
    """The function symbols of ``wanted`` (default: every kind marker) that ``path``
    defines in .dynsym or .symtab, with their file offsets.

    Cheap on any file, a 1 GB framework library included: cached by the opened file's
    (dev, inode, mtime, ctime); only the section headers, the symbol tables and the
    matching bytes of the string tables are touched (through a read-only mapping), each
    name found with a byte search rather than by decoding every symbol. A stripped
    library keeps .dynsym (what the dynamic linker resolves); a static executable's
    entry points are in .symtab. Version suffixes (``@@libcudart.so.12``) are not part of the names.
    """
    # Opened once, then stat'ed and read through that descriptor: a path looked up twice
    # (a stat, then an open) could name two files, one's exports cached as the other's.
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns,
               wanted if wanted is not None else _MARKERS, fingerprint)
        got = _exports.get(key)
        if got is None:
            got = _exports_of(path, f, key[4], fingerprint)
            if len(_exports) >= MAX_CLASSIFIED:
                _exports.clear()
            _exports[key] = got
    return got


# (dev, inode, mtime, ctime, wanted, fingerprint) -> exports: a file read once, whatever
# path (a /proc/self/fd/N of the moment) it was read through.
_exports: dict[tuple[int, int, int, int, frozenset[str], bool], ElfExports] = {}


def _exports_of(path: str, f: BinaryIO, wanted: frozenset[str], fingerprint: bool
                ) -> ElfExports:
    try:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError as exc:  # an empty file
        raise ValueError(f"{path} is not an ELF file") from exc
    with data:
        try:
            return _scan(path, data, wanted, fingerprint)
        except (struct.error, IndexError, TypeError) as exc:  # a truncated or odd ELF file
            raise ValueError(f"{path}: malformed ELF file ({exc})") from exc


def _scan(path: str, data: mmap.mmap, wanted: frozenset[str], fingerprint: bool
          ) -> ElfExports:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", data, 0x36)
    if shoff + shnum * shentsize > len(data) or phoff + phnum * phentsize > len(data):
        raise ValueError(f"{path}: section or program headers past the end of the file")
    loads = [(p[3], p[6], p[2]) for p in (_PHDR.unpack_from(data, phoff + i * phentsize)
                                          for i in range(phnum)) if p[0] == 1]  # PT_LOAD
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    offsets: dict[str, int] = {}
    has_symtab = False
    for sh in sections:
        if sh[1] not in (_SHT_SYMTAB, _SHT_DYNSYM) or sh[6] >= len(sections):
            continue
        has_symtab |= sh[1] == _SHT_SYMTAB
        table = _Table(data, sh, sections[sh[6]])
        for name in wanted - offsets.keys():
            value = table.defined(name)
            if value is None:
                continue
            for vaddr, memsz, off in loads:
                if vaddr <= value < vaddr + memsz:
                    offsets[name] = value - vaddr + off
                    break
    hidden = False
    if fingerprint and not has_symtab and not offsets.keys() & set(KIND_MARKERS["cudart"]):
        rodata = _section(data, sections, shstrndx, b".rodata")
        if rodata is not None:
            lo, hi = rodata[4], rodata[4] + rodata[5]
            hidden = all(_has_string(data, s, lo, hi) for s in RUNTIME_FINGERPRINT)
    return ElfExports(offsets, hidden)


class _Table:
    """One symbol table: its entries' name indexes as one packed array (a strided copy
    made in C), so that a name's entries are found by a byte search, not a loop."""

    def __init__(self, data: mmap.mmap, symtab: tuple[int, ...], strtab: tuple[int, ...]
                 ) -> None:
        self.data = data
        self.s_lo, self.s_hi = strtab[4], min(strtab[4] + strtab[5], len(data))
        self.t_lo, ent = symtab[4], symtab[9] or _SYM.size
        count = max(0, min(symtab[5], len(data) - symtab[4])) // ent
        raw = memoryview(data)[self.t_lo:self.t_lo + count * ent]
        # st_name is each entry's first 4 bytes: every (ent/4)-th uint32.
        self.names = raw.cast("I")[::ent // 4].tobytes() if ent % 4 == 0 else b""
        raw.release()
        self.ent = ent

    def defined(self, name: str) -> int | None:
        """The address of ``name`` if the table defines it as a function: every place
        the string table holds the name (a linker may share it as another name's
        tail), then the entries that point there."""
        data, needle = self.data, name.encode() + b"\0"
        at = data.find(needle, self.s_lo, self.s_hi)
        while at >= 0:
            key = struct.pack("<I", at - self.s_lo)
            hit = self.names.find(key)
            while hit >= 0:
                if hit % 4 == 0:
                    _n, info, _o, shndx, value, _sz = _SYM.unpack_from(
                        data, self.t_lo + hit // 4 * self.ent)
                    if shndx != 0 and (info & 0xF) in (2, 10) and value:  # FUNC, IFUNC
                        return int(value)
                hit = self.names.find(key, hit + 1)
            at = data.find(needle, at + 1, self.s_hi)
        return None


def _has_string(data: mmap.mmap, s: bytes, lo: int, hi: int) -> bool:
    """A whole NUL-terminated string ``s`` between ``lo`` and ``hi`` (searched without
    its leading NUL: a search that starts with a common byte is several times slower)."""
    at = data.find(s, lo, hi)
    while at >= 0:
        if at == lo or data[at - 1] == 0:
            return True
        at = data.find(s, at + 1, hi)
    return False


def _section(data: mmap.mmap, sections: list[tuple[int, ...]], shstrndx: int, name: bytes
             ) -> tuple[int, ...] | None:
    if shstrndx >= len(sections):
        return None
    base = sections[shstrndx][4]
    for sh in sections:
        end = data.find(b"\0", base + sh[0])
        if data[base + sh[0]:end] == name:
            return sh
    return None
