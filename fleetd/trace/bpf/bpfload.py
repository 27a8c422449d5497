"""Programs from the compiled-program cache, used through BCC's own ``BPF`` interface.

:func:`capture` reads an entry (``bpfcache.Entry``) out of a freshly compiled BCC
module; :class:`CachedBPF` is a ``bcc.BPF`` built from an entry without a compile: it
creates the maps with the kernel's ``bpf(BPF_MAP_CREATE)`` (no BTF, as BCC creates ours
when the module has none), patches their descriptors and the start's parameters into
the instructions and loads a program with ``bpf(BPF_PROG_LOAD)`` when it is first
attached, as ``BPF.load_func`` does. Everything else (attach/detach of uprobes,
tracepoints and perf events, ring buffers, tables, cleanup) is BCC's own code, which
only needs the program and map descriptors: the tracer uses both objects the same way.

This module imports ``bcc``: import it only once that is known to work.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcc
from bcc import BPF
from bcc import table as bcc_table
from bcc.libbcc import lib as bcc_lib

from fleetd import __version__
from fleetd.errors import FleetdError
from fleetd.trace.bpf import bpfcache
from fleetd.trace.bpf.bpfcache import (
    CacheError,
    Entry,
    TableSpec,
    fds_to_indices,
    indices_to_fds,
    param_sites,
    patch_params,
)
from fleetd.trace.host.headers import HeaderRoute, cache_dir, candidate_routes

log = logging.getLogger("fleetd.trace.bpf.bpfload")

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_MAP_CREATE, _PROG_LOAD, _OBJ_GET_INFO_BY_FD = 0, 5, 15
_LOG_SIZE = 1 << 22  # verifier log on a failed load (what BCC prints with the error)

# The map types BCC's tables wrap that need nothing but a descriptor (no programs or
# other maps inside, no pinning), by their BCC table class.
_TABLE_CLASSES: dict[int, type] = {
    1: bcc_table.HashTable, 2: bcc_table.Array, 5: bcc_table.PerCpuHash,
    6: bcc_table.PerCpuArray, 7: bcc_table.StackTrace, 9: bcc_table.LruHash,
    10: bcc_table.LruPerCpuHash, 27: bcc_table.RingBuf,
}
# Functions BPF() attaches by their name's prefix (BPF._trace_autoload), as far as an
# entry can carry them (kfunc/lsm programs need BTF ids at load).
_AUTOLOAD = ("kprobe__", "kretprobe__", "tracepoint__", "raw_tracepoint__")
_NO_ENTRY = ("kfunc__", "kretfunc__", "lsm__")

_libc = ctypes.CDLL(None, use_errno=True)
# A handle of our own on libbcc: declaring these functions' types here leaves the
# declarations on BCC's handle as BCC made them.
_bcc = ctypes.CDLL(bcc_lib._name)
for _fn, _res, _args in (
        ("bpf_num_tables", ctypes.c_size_t, [ctypes.c_void_p]),
        ("bpf_table_name", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        ("bpf_table_fd_id", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
        ("bpf_table_key_desc_id", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        ("bpf_table_leaf_desc_id", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        ("bpf_num_functions", ctypes.c_size_t, [ctypes.c_void_p]),
        ("bpf_function_name", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        ("bpf_module_license", ctypes.c_char_p, [ctypes.c_void_p]),
        ("bpf_module_kern_version", ctypes.c_uint, [ctypes.c_void_p])):
    getattr(_bcc, _fn).restype = _res
    getattr(_bcc, _fn).argtypes = _args


class _MapCreate(ctypes.Structure):  # union bpf_attr, BPF_MAP_CREATE (uapi/linux/bpf.h)
    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * 16),
                ("_zero", ctypes.c_uint8 * 84)]


class _ProgLoad(ctypes.Structure):  # union bpf_attr, BPF_PROG_LOAD
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * 16),
                ("prog_ifindex", ctypes.c_uint32), ("expected_attach_type", ctypes.c_uint32),
                ("_zero", ctypes.c_uint8 * 72)]


class _InfoByFd(ctypes.Structure):  # union bpf_attr, BPF_OBJ_GET_INFO_BY_FD
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32),
                ("info", ctypes.c_uint64), ("_zero", ctypes.c_uint8 * 112)]


class _MapInfo(ctypes.Structure):  # struct bpf_map_info, the part we read
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16)]


def bpf_syscall(cmd: int, attr: ctypes.Structure) -> int:
    """bpf(cmd, attr): the result, or -errno."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return -38  # ENOSYS
    ret = int(_libc.syscall(nr, cmd, ctypes.byref(attr), ctypes.sizeof(attr)))
    return ret if ret >= 0 else -ctypes.get_errno()


# ---- load or compile -----------------------------------------------------------------------

Compiler = Callable[[], tuple[Any, HeaderRoute]]


def key_inputs(text: str, flags: list[str]) -> bpfcache.KeyInputs:
    release, version, kconfig = bpfcache.kernel_inputs()
    first = next(candidate_routes(), None)
    try:
        st = os.stat(bcc_lib._name)
        libbcc = f"{os.path.realpath(bcc_lib._name)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        libbcc = str(bcc_lib._name)
    return bpfcache.KeyInputs(
        format=bpfcache.FORMAT, fleetd=__version__, bcc=str(bcc.__version__), libbcc=libbcc,
        machine=platform.machine(), release=release, proc_version=version, kconfig=kconfig,
        headers=first.describe() if first else "", source=text, cflags=list(flags))


def load_or_compile(text: str, flags: list[str], params: dict[str, int], values: dict[int, int],
                    compile_only: Compiler, compile_with_values: Compiler,
                    stage: Callable[[bool], None] = lambda _cached: None,
                    more: Callable[[], Entry] | None = None) -> tuple[Any, HeaderRoute]:
    """The loaded module for ``text`` compiled with ``flags``, whose ``params`` (name ->
    sentinel) take ``values`` (sentinel -> value) at load: from the cache, else from
    ``compile_only()`` (BCC, nothing loaded), kept for the next start. When the compiled
    module cannot be kept, ``compile_with_values()`` is what is returned. ``stage``
    hears True before a load from the cache, False before a compile. ``more``: the
    entry of a module with the same maps and more programs, asked for when a program
    this one lacks is first loaded (CachedBPF.load_func)."""
    cache = cache_dir()
    key = bpfcache.cache_key(key_inputs(text, flags))
    t0 = time.perf_counter()
    entry = bpfcache.load(cache, key)
    if entry is not None:
        stage(True)
        try:
            obj = CachedBPF(entry, values, more)
        except Exception as exc:  # bcc-style bare Exception from a load or an attach
            # What the key does not cover (a tracepoint gone with a module) fails here
            # once: the entry goes, and the compile says what is wrong, if anything.
            bpfcache.discard(cache, key, f"loading it failed ({str(exc).splitlines()[0]})")
        else:
            log.info("BPF programs loaded from the compiled-program cache (entry %s) in "
                     "%.2f s", key[:16], time.perf_counter() - t0)
            return obj, HeaderRoute(*entry.route)
    stage(False)
    try:
        entry, route = _compiled_entry(text, params, compile_only)
    except CacheError as exc:
        log.warning("the compiled BPF programs cannot be cached (%s): compiling them again "
                    "with this start's values", exc)
        return compile_with_values()
    _keep(cache, key, entry)
    return CachedBPF(entry, values, more), route


def kept_entry(text: str, flags: list[str], params: dict[str, int], compile_only: Compiler,
               stage: Callable[[bool], None] = lambda _cached: None) -> Entry:
    """The entry for ``text`` compiled with ``flags`` (``params`` as in load_or_compile):
    from the cache, else compiled and kept; CacheError when it cannot be captured."""
    cache = cache_dir()
    key = bpfcache.cache_key(key_inputs(text, flags))
    entry = bpfcache.load(cache, key)
    stage(entry is not None)
    if entry is None:
        entry, _route = _compiled_entry(text, params, compile_only)
        _keep(cache, key, entry)
    return entry


def _compiled_entry(text: str, params: dict[str, int], compile_only: Compiler
                    ) -> tuple[Entry, HeaderRoute]:
    bpf, route = compile_only()
    try:
        return capture(bpf, (route.name, route.source, route.detail),
                       {s: n for n, s in params.items()}, text), route
    finally:
        bpf.cleanup()  # nothing of it was loaded or attached; its maps go


def _keep(cache: Path, key: str, entry: Entry) -> None:
    try:
        path = bpfcache.store(cache, key, entry)
        log.info("compiled BPF programs kept in %s", path)
    except (OSError, FleetdError) as exc:
        log.warning("the compiled BPF programs could not be kept in %s: %s", cache, exc)


# ---- capture ------------------------------------------------------------------------------

def capture(bpf: Any, route: tuple[str, str | None, str], params: dict[int, str],
            source: str) -> Entry:
    """The entry of a compiled (not yet loaded) BCC module; CacheError when it holds
    something an entry cannot carry. ``params``: sentinel -> name of a parameter
    compiled as that sentinel (it must show up, and only where a patch reaches it)."""
    module = bpf.module
    tables: list[TableSpec] = []
    index_of_fd: dict[int, int] = {}
    for i in range(_bcc.bpf_num_tables(module)):
        name = _bcc.bpf_table_name(module, i).decode()
        fd = _bcc.bpf_table_fd_id(module, i)
        spec = _table_spec(name, fd, module, i)
        index_of_fd[fd] = len(tables)
        tables.append(spec)
    funcs: dict[str, bytes] = {}
    for i in range(_bcc.bpf_num_functions(module)):
        name = _bcc.bpf_function_name(module, i).decode()
        if name.startswith(_NO_ENTRY):
            raise CacheError(f"program {name} needs BTF at load")
        funcs[name] = fds_to_indices(bpf.dump_func(name.encode()), index_of_fd)
    for sentinel, pname in params.items():
        found = sum(len(param_sites(insns, sentinel)) for insns in funcs.values())
        if pname in source and not found:
            raise CacheError(f"{pname} is used by the source but its sentinel was compiled "
                             "into no instruction a patch can reach")
    return Entry(_bcc.bpf_module_license(module).decode(), _bcc.bpf_module_kern_version(module),
                 route, tuple(tables), funcs)


def _table_spec(name: str, fd: int, module: Any, i: int) -> TableSpec:
    info = _MapInfo()
    attr = _InfoByFd(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    err = bpf_syscall(_OBJ_GET_INFO_BY_FD, attr)
    if err < 0:
        raise CacheError(f"map {name}: its attributes cannot be read ({os.strerror(-err)})")
    if info.type not in _TABLE_CLASSES:
        raise CacheError(f"map {name} is of type {info.type}, which an entry cannot carry")
    key = _bcc.bpf_table_key_desc_id(module, i) or b""
    leaf = _bcc.bpf_table_leaf_desc_id(module, i) or b""
    return TableSpec(name=name, map_type=info.type, key_size=info.key_size,
                     value_size=info.value_size, max_entries=info.max_entries,
                     flags=info.map_flags, key_desc=key.decode(), leaf_desc=leaf.decode())


# ---- the object -------------------------------------------------------------------------

class _SpecTable(bcc_table.TableBase):  # type: ignore[misc]  # bcc is untyped
    """Sits under BCC's table class (see _table_class): what TableBase reads from the
    compiled module, read from the entry instead. BCC's subclasses run as they are."""

    def __init__(self, bpf: CachedBPF, map_id: int, map_fd: int, keytype: Any,
                 leaftype: Any, name: bytes | None = None) -> None:
        spec = bpf.entry.tables[map_id]
        self.bpf, self.map_id, self.map_fd = bpf, map_id, map_fd
        self.Key, self.Leaf = keytype, leaftype
        self.ttype, self.flags, self.max_entries = (spec["map_type"], spec["flags"],
                                                    spec["max_entries"])
        self._cbs: dict[int, Any] = {}
        self._name = name


_CLASSES: dict[int, type] = {}


def _table_class(map_type: int) -> type:
    if map_type not in _CLASSES:
        base = _TABLE_CLASSES[map_type]
        # MRO: the BCC class and its parents down to TableBase's level, then _SpecTable.
        _CLASSES[map_type] = type(f"Cached{base.__name__}", (base, _SpecTable), {})
    return _CLASSES[map_type]


class CachedBPF(BPF):  # type: ignore[misc]  # bcc has no type information
    """A loaded module from a cache entry; see the module's docstring. ``more``: the
    entry of a module with the same maps and more programs, read the first time a
    program this one lacks is loaded (its programs join this one's, on its maps)."""

    def __init__(self, entry: Entry, params: dict[int, int],
                 more: Callable[[], Entry] | None = None) -> None:
        # What BPF.__init__ sets up, without a module (self.module stays None).
        self.kprobe_fds: dict[Any, Any] = {}
        self.uprobe_fds: dict[Any, Any] = {}
        self.tracepoint_fds: dict[Any, Any] = {}
        self.raw_tracepoint_fds: dict[Any, Any] = {}
        self.kfunc_entry_fds: dict[Any, Any] = {}
        self.kfunc_exit_fds: dict[Any, Any] = {}
        self.lsm_fds: dict[Any, Any] = {}
        self.perf_buffers: dict[Any, Any] = {}
        self.open_perf_events: dict[Any, Any] = {}
        self._ringbuf_manager = None
        self.tracefile = None
        self.debug = 0
        self.funcs: dict[bytes, Any] = {}
        self.tables: dict[bytes, Any] = {}
        self.module = None
        self.entry = entry
        self.map_fds: list[int] = []
        self._params = params
        self._more = more
        self._more_failed: Exception | None = None
        self._more_lock = threading.Lock()
        self._license = ctypes.create_string_buffer(entry.license.encode())
        atexit.register(self.cleanup)
        try:
            for spec in entry.tables:
                self.map_fds.append(_create_map(spec))
            self._insns: dict[bytes, bytearray] = {}
            self._adopt(entry, self.map_fds)
            self._trace_autoload()
        except BaseException:
            self.cleanup()
            raise

    def _adopt(self, entry: Entry, fds: list[int]) -> None:
        """``entry``'s programs this module lacks, with ``fds`` for its table indices."""
        for name, insns in entry.funcs.items():
            if name.encode() not in self._insns:
                patched = indices_to_fds(insns, fds)
                patch_params(patched, self._params)
                self._insns[name.encode()] = patched

    def _adopt_more(self) -> None:
        """The programs of ``more`` (once; a failure is kept and raised again)."""
        with self._more_lock:
            if self._more_failed is not None:
                raise self._more_failed
            if self._more is None:
                return
            try:
                other = self._more()
                self._adopt(other, self._same_maps(other))
            except Exception as exc:  # TraceError from a compile, CacheError, OSError
                self._more_failed = Exception(f"the programs this module leaves out could "
                                              f"not be made ready: {exc}")
                raise self._more_failed from exc
            self._more = None

    def _same_maps(self, other: Entry) -> list[int]:
        """This module's map descriptors for ``other``'s tables, by name; CacheError
        when one is not a map of this module, as this module made it."""
        mine = {t["name"]: i for i, t in enumerate(self.entry.tables)}
        fds = []
        for spec in other.tables:
            i = mine.get(spec["name"])
            if i is None or self.entry.tables[i] != spec:
                raise CacheError(f"its map {spec['name']} is not one of this module's")
            fds.append(self.map_fds[i])
        return fds

    def _function_names(self) -> list[bytes]:
        return list(self._insns)

    def _trace_autoload(self) -> None:
        for name in self._function_names():
            if name.decode().startswith(_AUTOLOAD):
                self._autoload_one(name)

    def _autoload_one(self, name: bytes) -> None:
        # The same prefixes and attach calls as BPF._trace_autoload.
        if name.startswith(b"kprobe__"):
            self.attach_kprobe(event=self.fix_syscall_fnname(name[8:]),
                               fn_name=self.load_func(name, BPF.KPROBE).name)
        elif name.startswith(b"kretprobe__"):
            self.attach_kretprobe(event=self.fix_syscall_fnname(name[11:]),
                                  fn_name=self.load_func(name, BPF.KPROBE).name)
        elif name.startswith(b"tracepoint__"):
            fn = self.load_func(name, BPF.TRACEPOINT)
            self.attach_tracepoint(tp=name[len(b"tracepoint__"):].replace(b"__", b":"),
                                   fn_name=fn.name)
        else:
            fn = self.load_func(name, BPF.RAW_TRACEPOINT)
            self.attach_raw_tracepoint(tp=name[len(b"raw_tracepoint__"):], fn_name=fn.name)

    def load_func(self, func_name: bytes | str, prog_type: int, device: Any = None,
                  attach_type: int = -1) -> Any:
        name = func_name.encode() if isinstance(func_name, str) else func_name
        if name in self.funcs:
            return self.funcs[name]
        if name not in self._insns and device is None:
            self._adopt_more()
        if name not in self._insns or device is not None:
            raise Exception(f"Unknown program {name!r}" if name not in self._insns
                            else "offloaded programs are not loaded from the cache")
        fd = _load_prog(prog_type, name, self._insns[name], self._license,
                        self.entry.kern_version, attach_type)
        fn = BPF.Function(self, name, fd)
        self.funcs[name] = fn
        return fn

    def dump_func(self, func_name: bytes | str) -> bytes:
        name = func_name.encode() if isinstance(func_name, str) else func_name
        if name not in self._insns:
            raise Exception(f"Unknown program {name!r}")
        return bytes(self._insns[name])

    def get_table(self, name: bytes | str, keytype: Any = None, leaftype: Any = None,
                  reducer: Any = None) -> Any:
        text = name.decode() if isinstance(name, bytes) else name
        map_id = next((i for i, t in enumerate(self.entry.tables) if t["name"] == text), None)
        if map_id is None:
            raise KeyError(name)
        spec = self.entry.tables[map_id]
        if keytype is None and spec["key_desc"]:
            keytype = BPF._decode_table_type(json.loads(spec["key_desc"]))
        if leaftype is None and spec["leaf_desc"]:
            leaftype = BPF._decode_table_type(json.loads(spec["leaf_desc"]))
        cls = _table_class(spec["map_type"])
        kwargs = {"reducer": reducer} if spec["map_type"] in (5, 6, 10) else {}
        return cls(self, map_id, self.map_fds[map_id], keytype, leaftype, text.encode(),
                   **kwargs)

    def close(self) -> None:
        super().close()  # the programs' descriptors (no module to destroy)
        for fd in self.map_fds:
            try:
                os.close(fd)
            except OSError as exc:
                log.debug("closing map fd %d: %s", fd, exc)
        self.map_fds = []


def _create_map(spec: TableSpec) -> int:
    attr = _MapCreate(map_type=spec["map_type"], key_size=spec["key_size"],
                      value_size=spec["value_size"], max_entries=spec["max_entries"],
                      map_flags=spec["flags"], map_name=spec["name"].encode()[:15])
    fd = bpf_syscall(_MAP_CREATE, attr)
    if fd < 0:
        raise CacheError(f"map {spec['name']} could not be created ({os.strerror(-fd)})")
    return fd


def _load_prog(prog_type: int, name: bytes, insns: bytearray, licence: Any,
               kern_version: int, attach_type: int) -> int:
    buf = (ctypes.c_uint8 * len(insns)).from_buffer(insns)
    attr = _ProgLoad(prog_type=prog_type, insn_cnt=len(insns) // 8,
                     insns=ctypes.addressof(buf), license=ctypes.addressof(licence),
                     kern_version=kern_version, prog_name=name[:15],
                     expected_attach_type=max(attach_type, 0))
    fd = bpf_syscall(_PROG_LOAD, attr)
    if fd >= 0:
        return fd
    err = -fd
    if err == 1:  # the message BPF.load_func gives
        raise Exception("Need super-user privileges to run")
    # Again with the verifier's log, for the error (as BCC shows it).
    logbuf = ctypes.create_string_buffer(_LOG_SIZE)
    attr.log_level, attr.log_size, attr.log_buf = 1, _LOG_SIZE, ctypes.addressof(logbuf)
    again = bpf_syscall(_PROG_LOAD, attr)
    if again >= 0:  # passed with a log (a transient failure): use it
        return again
    verifier = logbuf.value.decode(errors="replace").strip()
    raise Exception(f"Failed to load BPF program {name.decode()}: {os.strerror(err)}"
                    + (f"\n{verifier}" if verifier else ""))
