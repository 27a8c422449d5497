"""The compiled-program cache: what BCC's compile produced, kept for the next start.

BCC compiles the C source with clang on every start (seconds of CPU, more on a busy
node). What it hands back after a compile is plain data: each function's instructions,
in which a map is referenced by a 64-bit immediate load holding the map's descriptor,
and the maps' attributes. An entry keeps exactly that, with every descriptor replaced
by the map's index; a later start recreates the maps and loads the instructions with
the new descriptors patched in (``bpfload``), as libbpf does with an object file. The
kernel's verifier checks every program at that load, as after a compile.

Values that change on every start (the tracer's own pid) are compiled as a sentinel
and patched at load, so one entry serves every start of the same configuration.

Layout: ``<cache dir>/bpf/<key>.prog``, the key a SHA-256 of everything that changes
the compiler's output (:func:`cache_key`). A file is ``MAGIC``, the SHA-256 of the
payload in hex, a newline, then the payload (JSON). The directory is private to its
owner (0700, checked on every use, refused when a link or writable by others) and a
file is used only when it is a regular file of the same owner that no one else may
read or write; it is checked against its digest before use. A file that fails any
check is removed with a log line, and the start compiles.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import logging
import os
import platform
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from fleetd.security.private_dir import UnsafePathError, create_file, open_regular, private_dir

log = logging.getLogger("fleetd.trace.bpf.bpfcache")

FORMAT = 1
MAGIC = b"FLEETD-BPF-PROGRAMS %d\n" % FORMAT
MAX_BYTES = 64 << 20  # an entry of fleetd's programs is about 1 MiB
_INSN = 8
_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
_PSEUDO_MAP_FD = 1  # src_reg of a load of a map's descriptor
_PSEUDO_MAP_VALUE = 2  # ... of the address of a value in an array map


class CacheError(Exception):
    """An entry that cannot be used: the message says why (logged, then recompiled)."""


class TableSpec(TypedDict):
    """A map as the compile created it (what the kernel reports of it), and BCC's JSON
    descriptions of its key and value types ("" where it has none: a ring buffer)."""

    name: str
    map_type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str
    leaf_desc: str


@dataclass(frozen=True, slots=True)
class Entry:
    """A compiled module: maps by index, and instructions that refer to them by index."""

    license: str
    kern_version: int
    route: tuple[str, str | None, str]  # the header route compiled with: HeaderRoute's fields
    tables: tuple[TableSpec, ...]
    funcs: dict[str, bytes]  # name -> instructions, map references as table indices


class _EntryJSON(TypedDict):
    key: str
    license: str
    kern_version: int
    route: list[str | None]
    tables: list[TableSpec]
    funcs: dict[str, str]  # name -> base64 of the instructions


class KeyInputs(TypedDict):
    """Everything that changes what BCC's compile produces (hashed into the key)."""

    format: int
    fleetd: str
    bcc: str
    libbcc: str  # the library file: path, size and mtime (a rebuilt BCC)
    machine: str
    release: str
    proc_version: str  # the kernel's build (release strings repeat across builds)
    kconfig: str  # SHA-256 of /proc/config.gz, "" when absent
    headers: str  # the header route the compile starts from
    source: str
    cflags: list[str]


def cache_key(inputs: KeyInputs) -> str:
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def kernel_inputs() -> tuple[str, str, str]:
    """(release, /proc/version, SHA-256 of /proc/config.gz or "")."""
    version = Path("/proc/version").read_text().strip()
    try:
        kconfig = hashlib.sha256(gzip.decompress(Path("/proc/config.gz").read_bytes())).hexdigest()
    except OSError:
        kconfig = ""
    return platform.release(), version, kconfig


# ---- instructions -----------------------------------------------------------------------

def _slots(insns: bytes | bytearray) -> int:
    if len(insns) % _INSN:
        raise CacheError(f"instructions of {len(insns)} bytes, not a multiple of {_INSN}")
    return len(insns) // _INSN


def _aligned(insns: bytes | bytearray, pattern: bytes, where: int) -> list[int]:
    """Offsets of ``pattern`` at byte ``where`` of an instruction slot (a C-speed
    search: an entry holds some 60,000 instructions to patch on every start)."""
    out, at = [], insns.find(pattern)
    while at >= 0:
        if at % _INSN == where:
            out.append(at)
        at = insns.find(pattern, at + 1)
    return out


def map_refs(insns: bytes | bytearray) -> list[int]:
    """Byte offsets of the immediates that hold a map descriptor (or, in an entry, a
    table index): the first half of each 64-bit load with a map pseudo source. The
    second half of such a load has opcode 0, so an aligned 0x18 is always a first."""
    _slots(insns)
    return [at + 4 for at in _aligned(insns, bytes([_LD_IMM64]), 0)
            if insns[at + 1] >> 4 in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE)]


def _imm(insns: bytes | bytearray, at: int) -> int:
    return int.from_bytes(insns[at:at + 4], "little", signed=True)


def _set_imm(insns: bytearray, at: int, value: int) -> None:
    insns[at:at + 4] = value.to_bytes(4, "little", signed=True)


def fds_to_indices(insns: bytes, index_of_fd: dict[int, int]) -> bytes:
    """Map descriptors -> table indices; CacheError on a descriptor of no known table."""
    out = bytearray(insns)
    for at in map_refs(insns):
        fd = _imm(insns, at)
        if fd not in index_of_fd:
            raise CacheError(f"an instruction refers to map descriptor {fd}, not a table")
        _set_imm(out, at, index_of_fd[fd])
    return bytes(out)


def indices_to_fds(insns: bytes, fds: list[int]) -> bytearray:
    out = bytearray(insns)
    for at in map_refs(insns):
        index = _imm(insns, at)
        if not 0 <= index < len(fds):
            raise CacheError(f"an instruction refers to table {index} of {len(fds)}")
        _set_imm(out, at, fds[index])
    return out


def param_sites(insns: bytes | bytearray, sentinel: int) -> list[int]:
    """Byte offsets of the immediates to patch for a parameter compiled as ``sentinel``:
    each 32-bit immediate equal to it outside map references, and the high half of a
    64-bit constant ``sentinel << 32`` (the compiler's form of ``(x >> 32) == PARAM``:
    it becomes ``value << 32``). CacheError when it shows up in a 64-bit constant in a
    form a patch cannot reach."""
    skip = set(map_refs(insns))
    for near in (sentinel - 1, sentinel + 1):  # PARAM <= x compiled as PARAM - 1 < x...
        if any(at not in skip for at in _aligned(insns, near.to_bytes(4, "little"), 4)):
            raise CacheError(f"a parameter's sentinel {sentinel:#x} was compiled into "
                             f"{near:#x}, a value derived from it")
    out = []
    for at in _aligned(insns, sentinel.to_bytes(4, "little", signed=True), 4):
        slot = at - 4
        if at in skip:
            continue
        if slot >= _INSN and insns[slot - _INSN] == _LD_IMM64 and insns[slot] == 0:
            if _imm(insns, at - _INSN) != 0:  # the high half of a wider constant
                raise CacheError(f"a parameter's sentinel {sentinel:#x} was compiled into a "
                                 "64-bit constant with other low bits")
        elif insns[slot] == _LD_IMM64 and _imm(insns, slot + _INSN + 4) != 0:
            raise CacheError(f"a parameter's sentinel {sentinel:#x} was compiled into a "
                             "64-bit constant with other high bits")
        out.append(at)
    return out


def patch_params(insns: bytearray, values: dict[int, int]) -> None:
    """Each sentinel's immediates -> the start's value (both fit 31 bits: a positive
    immediate, whatever instruction holds it, and the same shift in a 64-bit one)."""
    for sentinel, value in values.items():
        for at in param_sites(insns, sentinel):
            _set_imm(insns, at, value)


# ---- files --------------------------------------------------------------------------------

def entry_dir(cache: Path) -> Path:
    """``<cache>/bpf``, private to this user (``cache`` was checked when it was named)."""
    return private_dir(cache / "bpf", base=cache, what="BPF program cache",
                       hint="remove it; fleetd recreates it (0700) on the next start")


def encode(key: str, entry: Entry) -> bytes:
    doc: _EntryJSON = {
        "key": key, "license": entry.license, "kern_version": entry.kern_version,
        "route": list(entry.route),
        "tables": list(entry.tables),
        "funcs": {n: base64.b64encode(b).decode() for n, b in entry.funcs.items()},
    }
    payload = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def decode(key: str, data: bytes) -> Entry:
    """The entry in ``data``; CacheError when it is not an intact entry for ``key``."""
    if not data.startswith(MAGIC):
        raise CacheError("not a fleetd program cache file of this format")
    digest, _, payload = data[len(MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CacheError("its checksum does not match its content (corrupt or truncated)")
    try:
        doc: _EntryJSON = json.loads(payload)
        if doc["key"] != key:
            raise CacheError("it was written for another key")
        name, source, detail = doc["route"]
        tables = tuple(_table(t) for t in doc["tables"])
        funcs = {n: base64.b64decode(b, validate=True) for n, b in doc["funcs"].items()}
        for insns in funcs.values():
            for at in map_refs(insns):
                if not 0 <= _imm(insns, at) < len(tables):
                    raise CacheError(f"an instruction refers to table {_imm(insns, at)}")
        return Entry(str(doc["license"]), int(doc["kern_version"]),
                     (str(name), source, str(detail)), tables, funcs)
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"its content is not a valid entry ({exc})") from None


def _table(doc: TableSpec) -> TableSpec:
    texts = ("name", "key_desc", "leaf_desc")
    raw: dict[str, object] = dict(doc)
    if set(raw) != set(TableSpec.__annotations__) or not all(
            isinstance(v, str if k in texts else int) for k, v in raw.items()):
        raise CacheError(f"a table description is not valid ({str(doc)[:80]})")
    return doc


def load(cache: Path, key: str) -> Entry | None:
    """The verified entry for ``key``, or None (missing; or unusable: logged, removed)."""
    path = entry_dir(cache) / f"{key}.prog"
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        return None
    except (OSError, UnsafePathError) as exc:
        _discard(path, str(exc))
        return None
    try:
        why = _not_private(st)
        if why is None and st.st_size > MAX_BYTES:
            why = f"{st.st_size} bytes, over the limit of {MAX_BYTES}"
        if why is None:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if why is None:
            return decode(key, data)
    except CacheError as exc:
        why = str(exc)
    _discard(path, why or "unreadable")
    return None


def discard(cache: Path, key: str, why: str) -> None:
    """Remove the entry for ``key`` (it failed after it was read), with a log line."""
    _discard(entry_dir(cache) / f"{key}.prog", why)


def _not_private(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"group or others may read or write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _discard(path: Path, why: str) -> None:
    log.warning("compiled-program cache entry %s not used: %s; removed, compiling instead",
                path, why)
    with contextlib.suppress(OSError):
        path.unlink()


def store(cache: Path, key: str, entry: Entry) -> Path:
    """Write the entry (0600, through a new file renamed into place: a reader sees the
    old file or the whole new one). OSError/UnsafePathError when it cannot."""
    directory = entry_dir(cache)
    path = directory / f"{key}.prog"
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = create_file(tmp, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(key, entry))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path
