"""Finding the CUDA libraries to probe, and the functions they export.

Uprobes bind to a file's inode, so we attach to the exact file a target process has
mapped (read from /proc/PID/maps, opened through /proc/PID/root so that a process in
a container resolves to its own file), not to some other copy. When tracing
system-wide (or before a named target has loaded CUDA), the usual places are searched:
venv ``nvidia/*/lib`` directories (the wheels' ``nvidia/cuda_runtime/lib/libcudart.so.12``
and ``nvidia/nccl/lib/libnccl.so.2``), torch's ``lib`` directory, and the dynamic linker
cache. ``--cuda-lib`` overrides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import site
import struct
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("fleetd.trace.libs")

# kind -> file name pattern. The kind selects which probe layer the file gets.
KINDS: dict[str, re.Pattern[str]] = {
    "cudart": re.compile(r"^libcudart\.so(\.\d+)*$"),
    "cuda": re.compile(r"^libcuda\.so(\.\d+)*$"),
    "nccl": re.compile(r"^libnccl\.so(\.\d+)*$"),
}
LAYER_OF_KIND = {"cudart": "cuda", "cuda": "driver", "nccl": "nccl"}


@dataclass(frozen=True, slots=True)
class Library:
    kind: str  # cudart | cuda | nccl
    path: str  # a path the tracer can open that names the mapped inode
    dev: int
    ino: int
    found_by: str  # "maps:PID", "override", "venv", "torch", "ldconfig", "cache"

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


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


def mapped_libraries(pid: int) -> list[Library]:
    """CUDA libraries mapped by ``pid`` right now (empty if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    out: dict[tuple[int, int], Library] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5]
        kind = kind_of(path)
        if kind is None or path.endswith(" (deleted)"):
            continue
        ino = int(parts[4])
        # Through /proc/PID/root the path names the process's own file, even in a
        # container; fall back to the plain path if that view is not readable.
        for candidate in (f"/proc/{pid}/root{path}", path):
            lib = _library(candidate, kind, f"maps:{pid}")
            if lib is not None and lib.ino == ino:
                out.setdefault(lib.key, lib)
                break
    return list(out.values())


def all_mapped_libraries() -> list[Library]:
    """CUDA libraries mapped by any process but ours (system-wide discovery)."""
    out: dict[tuple[int, int], Library] = {}
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
    """CUDA libraries in the usual places, for system-wide tracing."""
    found: dict[tuple[int, int], Library] = {}

    def add(path: Path | str, by: str) -> None:
        kind = kind_of(path)
        if kind is None:
            return
        lib = _library(str(Path(path).resolve()), kind, by)
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
        names = exported_functions(path)
    except (OSError, ValueError):
        return None
    for kind, probe in (("cudart", "cudaLaunchKernel"), ("cuda", "cuInit"),
                        ("nccl", "ncclAllReduce")):
        if probe in names:
            return kind
    return None


# ---- ELF: exported function symbols ---------------------------------------------------

@dataclass(frozen=True, slots=True)
class ElfExports:
    offsets: dict[str, int] = field(default_factory=dict)  # name -> file offset

    def __contains__(self, name: object) -> bool:
        return name in self.offsets


def exported_functions(path: str) -> ElfExports:
    """Defined function symbols of ``path``'s .dynsym, with their file offsets.

    A stripped library keeps .dynsym (that is what the dynamic linker resolves), so
    this works on the CUDA wheels. Version suffixes (``@@libcudart.so.12``) live in a
    separate section and are not part of the names here.
    """
    st = os.stat(path)
    return _exports_cached(path, st.st_ino, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _exports_cached(path: str, _ino: int, _mtime: int) -> ElfExports:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    endian = "<" if data[5] == 1 else ">"
    (phoff, shoff) = struct.unpack_from(endian + "QQ", data, 0x20)
    (phentsize, phnum, shentsize, shnum) = struct.unpack_from(endian + "HHHH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (vaddr, memsz, offset)
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _pa, _fs, p_memsz = struct.unpack_from(
            endian + "IIQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_memsz, p_offset))
    sections = []
    for i in range(shnum):
        sections.append(struct.unpack_from(endian + "IIQQQQIIQQ", data, shoff + i * shentsize))
    offsets: dict[str, int] = {}
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        sym_off, sym_size, entsize = sh[4], sh[5], sh[9] or 24
        for j in range(sym_size // entsize):
            name_i, info, _other, shndx, value, _size = struct.unpack_from(
                endian + "IBBHQQ", data, sym_off + j * entsize)
            if shndx == 0 or (info & 0xF) not in (2, 10) or value == 0:  # FUNC, IFUNC
                continue
            end = data.index(b"\0", str_off + name_i)
            name = data[str_off + name_i:end].decode(errors="replace")
            for vaddr, memsz, off in loads:
                if vaddr <= value < vaddr + memsz:
                    offsets.setdefault(name, value - vaddr + off)
                    break
    return ElfExports(offsets)
