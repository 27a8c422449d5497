"""Which symbol each probe attaches to, and the attach ladder.

Each op has one or more symbol groups. A group is a fallback list: the first symbol
the library exports is attached (``cuMemAlloc_v2``, else the old ``cuMemAlloc``).
Several groups are separate entry points for the same op, all attached: the
per-thread-default-stream variants (``cudaLaunchKernel_ptsz``) are distinct
functions that applications compiled with ``--default-stream per-thread`` call.

The ladder, per library: (1) one uprobe_multi link for all entry points and one for
all returns (kernel 6.6+), with the op in each offset's cookie; detaching it costs
one RCU grace period instead of one per probe (~0.1 s each here), so a trace of 56
probes stops in a fraction of a second instead of six. (2) Per-symbol uprobes
through libbcc, at the file offset read from the library's own symbol tables (the
offsets uprobe_multi takes), with no reference counter (:func:`attach_uprobe_at`).
Everything is counted: the caller fails loudly when nothing attached and warns when
only part did.

Both read and attach through the library's very file, opened and checked once
(:func:`fleetd.trace.host.libs.verified_file`): the symbols are read and every probe
attached by that descriptor's ``/proc/self/fd/N`` path, which the kernel's lookup follows
to the open file itself. A library is never attached by a path the kernel resolves again
(``/proc/PID/root/...``: a container could swap another file in there, and an absolute
link inside it would resolve against the host's root). ``Library.path`` only names it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fleetd.store.catalog import BY_NAME, ENQUEUES, NCCL
from fleetd.trace.host.libs import ElfExports, Library, exported_functions, verified_file

log = logging.getLogger("fleetd.trace.bpf.probes")

# FL_C_LOST_* in bpf/fleetd.h double as ring numbers.
RING_NUMBER = {"cuda": 0, "driver": 1, "nccl": 2}


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    op: str  # catalog name
    kind: str  # library kind: cudart | cuda | nccl
    groups: tuple[tuple[str, ...], ...]
    always: bool = False  # every call becomes a record (syncs, allocations, graphs, NCCL)

    @property
    def entry_only(self) -> bool:
        """A launch-type call (it enqueues work and returns): traced at its entry, its
        return sampled (a uprobe session, bpf/common.bpf.c's fl_launch_entry), unless
        --launch-returns. Graph launches stay whole: every one is a record, once a step."""
        return self.op in _SAMPLED

    @property
    def entry_fn(self) -> str:
        return "fl_in_" + self.op.upper()

    @property
    def return_fn(self) -> str:
        return "fl_out_" + self.op.upper()

    @property
    def layer(self) -> str:
        return {"cudart": "cuda", "cuda": "driver", "nccl": "nccl"}[self.kind]

    @property
    def cookie(self) -> int:
        """What a uprobe_multi link hands the dispatchers: op | always << 32 | ring << 40."""
        ring = RING_NUMBER[self.layer]
        return BY_NAME[self.op].code | (int(self.always) << 32) | (ring << 40)


# Ordinary high-rate calls: histogram always, records only for anomalies + the sample.
# All are launch-type (kernel launches, async copies): ProbeSpec.entry_only.
_SAMPLED = ENQUEUES.name_set


def _rt(op: str, *variants: str) -> ProbeSpec:
    return ProbeSpec(op, "cudart", ((op,), *((v,) for v in variants)), op not in _SAMPLED)


def _drv(op: str, *groups: tuple[str, ...]) -> ProbeSpec:
    return ProbeSpec(op, "cuda", groups or ((op,),), op not in _SAMPLED)


SPECS: tuple[ProbeSpec, ...] = (
    # CUDA runtime
    _rt("cudaLaunchKernel", "cudaLaunchKernel_ptsz"),
    _rt("cudaMemcpy", "cudaMemcpy_ptds"),
    _rt("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz"),
    _rt("cudaMalloc"),
    _rt("cudaFree"),
    _rt("cudaMallocManaged"),
    _rt("cudaStreamSynchronize", "cudaStreamSynchronize_ptsz"),
    _rt("cudaDeviceSynchronize"),
    _rt("cudaEventSynchronize"),
    _rt("cudaStreamWaitEvent", "cudaStreamWaitEvent_ptsz"),
    _rt("cudaMallocAsync", "cudaMallocAsync_ptsz"),
    _rt("cudaFreeAsync", "cudaFreeAsync_ptsz"),
    # CUDA graphs (runtime)
    _rt("cudaStreamBeginCapture", "cudaStreamBeginCapture_ptsz"),
    _rt("cudaStreamEndCapture", "cudaStreamEndCapture_ptsz"),
    _rt("cudaGraphInstantiate"),
    _rt("cudaGraphLaunch", "cudaGraphLaunch_ptsz"),
    _rt("cudaGraphExecUpdate"),
    _rt("cudaGraphExecDestroy"),
    # CUDA driver
    _drv("cuLaunchKernel", ("cuLaunchKernel",), ("cuLaunchKernel_ptsz",)),
    _drv("cuLaunchKernelEx", ("cuLaunchKernelEx",), ("cuLaunchKernelEx_ptsz",)),
    _drv("cuMemAlloc_v2", ("cuMemAlloc_v2", "cuMemAlloc")),
    _drv("cuMemcpyHtoD_v2", ("cuMemcpyHtoD_v2", "cuMemcpyHtoD"), ("cuMemcpyHtoD_v2_ptds",)),
    _drv("cuMemcpyDtoH_v2", ("cuMemcpyDtoH_v2", "cuMemcpyDtoH"), ("cuMemcpyDtoH_v2_ptds",)),
    _drv("cuMemcpyHtoDAsync_v2", ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"),
         ("cuMemcpyHtoDAsync_v2_ptsz",)),
    _drv("cuMemcpyDtoHAsync_v2", ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"),
         ("cuMemcpyDtoHAsync_v2_ptsz",)),
    _drv("cuCtxSynchronize"),
    _drv("cuStreamSynchronize", ("cuStreamSynchronize",), ("cuStreamSynchronize_ptsz",)),
    _drv("cuGraphLaunch", ("cuGraphLaunch",), ("cuGraphLaunch_ptsz",)),
    # NCCL: every call is a record (collectives are compared rank by rank, failed
    # ones included; communicator and group calls are rare).
    *(ProbeSpec(name, "nccl", ((name,),), True) for name in NCCL.names),
)
assert all(s.op in BY_NAME for s in SPECS), "probe spec names must be catalog ops"

# Driver calls that name kernels (not ops: no records, no histograms): their return
# probe files each handle's name for cuLaunchKernel records (bpf/driver.bpf.c).
NAME_PROBES: tuple[tuple[str, str], ...] = (
    ("cuModuleGetFunction", "fl_kn_in_module"),
    ("cuLibraryGetKernel", "fl_kn_in_module"),  # same arguments: (out, owner, name)
    ("cuKernelGetFunction", "fl_kn_in_kernel"),
)
NAME_RETURN_FN = "fl_kn_out"

# Every symbol a probe may attach to: what a library's symbol tables are searched for.
PROBE_SYMBOLS: frozenset[str] = frozenset(
    {sym for s in SPECS for group in s.groups for sym in group}
    | {sym for sym, _ in NAME_PROBES})


def library_symbols(path: str | Library) -> ElfExports:
    """The probed entry points a file defines (.dynsym and .symtab), with offsets; a
    library's are read through its verified file (OSError where it is not there)."""
    if isinstance(path, Library):
        with verified_file(path) as opened:
            return exported_functions(opened, PROBE_SYMBOLS)
    return exported_functions(path, PROBE_SYMBOLS)


SPECS_BY_KIND: dict[str, tuple[ProbeSpec, ...]] = {
    k: tuple(s for s in SPECS if s.kind == k) for k in ("cudart", "cuda", "nccl")
}


def planned_symbols(spec: ProbeSpec, exports: Iterable[str]) -> list[str]:
    """The symbols this spec attaches to in a library exporting ``exports``."""
    names = set(exports)
    out = []
    for group in spec.groups:
        for sym in group:
            if sym in names:
                out.append(sym)
                break
    return out


@dataclass
class AttachReport:
    """What attached where: feeds warnings, ``fleetd check`` and the session record."""

    attached: dict[str, list[str]] = field(default_factory=dict)  # lib path -> "op:sym"
    missing: dict[str, list[str]] = field(default_factory=dict)  # lib path -> ops absent
    failed: dict[str, list[str]] = field(default_factory=dict)  # lib path -> "sym: error"
    uprobes: int = 0  # entry + return probe points attached
    mechanism: dict[str, str] = field(default_factory=dict)  # lib path -> multi | perf
    named: dict[str, list[str]] = field(default_factory=dict)  # lib path -> kernel-name probes
    # lib path -> ops traced at entry, their returns sampled (uprobe session)
    entry_only: dict[str, list[str]] = field(default_factory=dict)

    def ops_attached(self) -> set[str]:
        return {a.split(":", 1)[0] for v in self.attached.values() for a in v}

    def merge(self, other: AttachReport) -> None:
        for mine, theirs in ((self.attached, other.attached), (self.missing, other.missing),
                             (self.failed, other.failed)):
            for k, v in theirs.items():
                mine.setdefault(k, []).extend(v)
        self.uprobes += other.uprobes
        self.mechanism.update(other.mechanism)
        self.entry_only.update(other.entry_only)
        for k, v in other.named.items():
            self.named.setdefault(k, []).extend(v)


SessionKey = tuple[str, int, int]  # a library's shown path, device and inode


class Attacher:
    """Attaches libraries to one loaded BPF module and owns the links it made."""

    def __init__(self, bpf: Any, *, allow_multi: bool = True, launch_entry: bool = False
                 ) -> None:
        self.bpf = bpf
        self.links: list[int] = []
        self._multi: tuple[int, int] | None = None
        # Entry-only launches (ProbeSpec.entry_only) through a uprobe session link; where
        # the kernel has none (before 6.13) or per-symbol probes are used, they keep
        # their return probes (AttachReport.entry_only says which libraries did not).
        self.launch_entry = launch_entry
        self._session: int | None = None
        self._session_error: str | None = None
        # (lib path, dev, inode) -> [session link fd (-1: paused), offsets, cookies,
        # file]: the entry-only launches' links, which the always-on mode closes and makes
        # again (set_launches) on the verified file, kept open for that (never its path
        # again). By inode too: a library mapped again at a path shown before (replaced
        # on disk, then loaded again) is another file whose links are kept beside the
        # first's, not over them (the first's stayed open and attached, uncounted).
        self._sessions: dict[SessionKey, tuple[int, list[int], list[int], int]] = {}
        self.launches_on = True
        self._multi_error: str | None = None if allow_multi else "disabled"
        if allow_multi and os.environ.get("FLEETD_NO_UPROBE_MULTI"):
            self._multi_error = "disabled by FLEETD_NO_UPROBE_MULTI"

    def attach(self, lib: Library, layers: Iterable[str]) -> AttachReport:
        """Attach every probe of ``lib``'s kind whose layer is enabled; never raises.
        Read and attached through its verified file, which is closed after (a uprobe
        holds its inode)."""
        report = AttachReport()
        specs = [s for s in SPECS_BY_KIND.get(lib.kind, ()) if s.layer in set(layers)]
        if not specs:
            return report
        try:
            with verified_file(lib) as opened:
                self._attach_file(lib, _File(opened, lib.path, lib.dev, lib.ino), specs, report)
        except OSError as exc:  # verified_file: not that file any more
            report.failed[lib.path] = [f"*: not attached: {exc.strerror or exc}"]
        return report

    def _attach_file(self, lib: Library, file: _File, specs: list[ProbeSpec],
                     report: AttachReport) -> None:
        try:
            exports = exported_functions(file.opened, PROBE_SYMBOLS)
        except (OSError, ValueError) as exc:
            report.failed[lib.path] = [f"*: cannot read symbols: {exc}"]
            return
        plan: list[tuple[ProbeSpec, str]] = []
        for spec in specs:
            syms = planned_symbols(spec, exports.offsets)
            if not syms:
                report.missing.setdefault(lib.path, []).append(spec.op)
            plan += [(spec, sym) for sym in syms]
        if lib.kind == "cuda":
            _attach_name_probes(self.bpf, file, exports.offsets, report)
        if not plan:
            return
        if self._attach_multi(file, plan, exports.offsets, report):
            return
        _attach_each(self.bpf, file, plan, exports.offsets, report)

    def _attach_multi(self, lib: _File, plan: list[tuple[ProbeSpec, str]],
                      offsets: dict[str, int], report: AttachReport) -> bool:
        progs = self._multi_programs()
        if progs is None:
            return False
        fds: list[int] = []
        entry_only = [p for p in plan if self.launch_entry and p[0].entry_only]
        session_fd = -1
        if entry_only:
            session_fd = self._link_session(lib.opened, entry_only, offsets)
            if session_fd < 0:
                entry_only = []  # they go with the pairs below, returns and all
            else:
                fds.append(session_fd)
        pairs = [p for p in plan if p not in entry_only]
        offs = [offsets[sym] for _, sym in pairs]
        cookies = [spec.cookie for spec, _ in pairs]
        for prog_fd, ret in zip(progs, (False, True), strict=True):
            if not pairs:
                break
            fd, err = link_uprobe_multi(prog_fd, lib.opened, offs, cookies, retprobe=ret)
            if fd < 0:
                log.info("uprobe_multi on %s failed (%s); attaching per symbol", lib.path, err)
                for f in fds:
                    os.close(f)
                return False
            fds.append(fd)
        self.links += [f for f in fds if f != session_fd]
        if entry_only:
            key = (lib.path, lib.dev, lib.ino)
            self._forget_session(key)  # the same file attached twice: the new link only
            self._sessions[key] = (session_fd, [offsets[s] for _, s in entry_only],
                                   [spec.cookie for spec, _ in entry_only],
                                   os.open(lib.opened, os.O_RDONLY | os.O_CLOEXEC))
            if not self.launches_on:
                self._set_session(key, False)
        report.attached[lib.path] = [f"{spec.op}:{sym}" for spec, sym in plan]
        report.uprobes += 2 * len(pairs) + len(entry_only)
        report.mechanism[lib.path] = "uprobe_multi" + ("+session" if entry_only else "")
        if entry_only:
            report.entry_only[lib.path] = sorted({spec.op for spec, _ in entry_only})
        return True

    def _link_session(self, path: str, plan: list[tuple[ProbeSpec, str]],
                      offsets: dict[str, int]) -> int:
        """One uprobe session link for the entry-only launches of a library: its fd, or
        -1 (logged) where the kernel or the program cannot have one."""
        if self._session is None and self._session_error is None:
            try:
                fn = self.bpf.load_func(b"fl_sess_multi", _BPF_PROG_KPROBE, None,
                                        _BPF_TRACE_UPROBE_SESSION)
                self._session = int(fn.fd)
            except Exception as exc:  # before Linux 6.13: no uprobe sessions
                self._session_error = str(exc)
                log.info("uprobe session program not loadable (%s); launches keep their "
                         "return probes", exc)
        if self._session is None:
            return -1
        fd, err = link_uprobe_multi(self._session, path, [offsets[s] for _, s in plan],
                                    [spec.cookie for spec, _ in plan], retprobe=False,
                                    attach_type=_BPF_TRACE_UPROBE_SESSION)
        if fd < 0:
            log.info("uprobe session link on %s failed (%s); launches keep their return "
                     "probes", path, err)
        return fd

    def _multi_programs(self) -> tuple[int, int] | None:
        if self._multi is not None or self._multi_error is not None:
            return self._multi
        try:
            fn_in = self.bpf.load_func(b"fl_in_multi", _BPF_PROG_KPROBE, None,
                                       _BPF_TRACE_UPROBE_MULTI)
            fn_out = self.bpf.load_func(b"fl_out_multi", _BPF_PROG_KPROBE, None,
                                        _BPF_TRACE_UPROBE_MULTI)
        except Exception as exc:  # old kernel: the attach type is unknown
            self._multi_error = str(exc)
            log.info("uprobe_multi programs not loadable (%s); per-symbol uprobes", exc)
            return None
        self._multi = (int(fn_in.fd), int(fn_out.fd))
        return self._multi

    def set_launches(self, on: bool) -> bool:
        """Entry-only launch probes on or off (the always-on mode's duty cycle); every
        other probe stays. Whether any library has such probes to switch."""
        self.launches_on = on
        for path in list(self._sessions):
            self._set_session(path, on)
        return bool(self._sessions)

    def _set_session(self, key: SessionKey, on: bool) -> None:
        path = key[0]
        fd, offs, cookies, file = self._sessions[key]
        if on and fd < 0 and self._session is not None:
            fd, err = link_uprobe_multi(self._session, f"/proc/self/fd/{file}", offs,
                                        cookies, retprobe=False,
                                        attach_type=_BPF_TRACE_UPROBE_SESSION)
            if fd < 0:
                log.warning("launch probes on %s not attached again: %s", path, err)
        elif not on and fd >= 0:
            os.close(fd)
            fd = -1
        self._sessions[key] = (fd, offs, cookies, file)

    def _forget_session(self, key: SessionKey) -> None:
        """Close a library's session link and kept file, if it has them."""
        if key in self._sessions:
            self._set_session(key, False)
            os.close(self._sessions.pop(key)[3])

    @property
    def session_count(self) -> int:
        """Libraries whose launches have a session link (open or paused)."""
        return len(self._sessions)

    def close(self) -> None:
        """Detach the links (the per-symbol probes go with the BPF module's cleanup)."""
        for key in list(self._sessions):
            self._forget_session(key)
        for fd in self.links:
            try:
                os.close(fd)
            except OSError as exc:
                log.debug("closing link fd %d: %s", fd, exc)
        self.links.clear()


_BPF_PROG_KPROBE = 2
_BPF_LINK_CREATE = 28
_BPF_TRACE_UPROBE_MULTI = 48
_BPF_TRACE_UPROBE_SESSION = 57  # Linux 6.13+
_BPF_F_UPROBE_MULTI_RETURN = 1
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


class _LinkCreateUprobeMulti(ctypes.Structure):
    # union bpf_attr, link_create variant with the uprobe_multi member (uapi/linux/bpf.h).
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("_zero", ctypes.c_uint8 * 68),
    ]


def link_uprobe_multi(prog_fd: int, path: str, offsets: list[int], cookies: list[int], *,
                      retprobe: bool, attach_type: int = _BPF_TRACE_UPROBE_MULTI
                      ) -> tuple[int, str]:
    """BPF_LINK_CREATE of a uprobe_multi (or uprobe session) link: (fd, "") or
    (-1, why)."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return -1, f"unknown bpf syscall on {platform.machine()}"
    n = len(offsets)
    path_buf = ctypes.create_string_buffer(os.fsencode(path))
    offs = (ctypes.c_uint64 * n)(*offsets)
    cks = (ctypes.c_uint64 * n)(*cookies)
    attr = _LinkCreateUprobeMulti()
    attr.prog_fd = prog_fd
    attr.attach_type = attach_type
    attr.path = ctypes.addressof(path_buf)
    attr.offsets = ctypes.addressof(offs)
    attr.cookies = ctypes.addressof(cks)
    attr.cnt = n
    attr.multi_flags = _BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(nr, _BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr)))
    if fd < 0:
        return -1, os.strerror(ctypes.get_errno())
    return fd, ""


@dataclass(frozen=True, slots=True)
class _File:
    """A library being attached: its verified file's ``/proc/self/fd/N`` path (read and
    probed through), the name it is shown and reported by, and the file's identity."""

    opened: str
    path: str
    dev: int
    ino: int


def attach_library(bpf: Any, lib: Library, layers: Iterable[str]) -> AttachReport:
    """Per-symbol attach only (no links to own); for one-off checks."""
    return Attacher(bpf, allow_multi=False).attach(lib, layers)


def _attach_each(bpf: Any, lib: _File, plan: list[tuple[ProbeSpec, str]],
                 offsets: dict[str, int], report: AttachReport) -> None:
    report.mechanism[lib.path] = "perf"
    for spec, sym in plan:
        err = _attach_pair(bpf, lib, offsets[sym], spec)
        if err is None:
            report.attached.setdefault(lib.path, []).append(f"{spec.op}:{sym}")
            report.uprobes += 2
        else:
            report.failed.setdefault(lib.path, []).append(f"{sym}: {err}")


def _attach_name_probes(bpf: Any, lib: _File, offsets: dict[str, int],
                        report: AttachReport) -> None:
    """The kernel-naming probes of a driver library, per symbol (a handful, attached
    once): a failure costs only names, so it is reported and tracing goes on."""
    for sym, entry in NAME_PROBES:
        if sym not in offsets:
            continue
        err = _attach_pair(bpf, lib, offsets[sym], entry_fn=entry,
                           return_fn=NAME_RETURN_FN)
        if err is None:
            report.named.setdefault(lib.path, []).append(sym)
        else:
            report.failed.setdefault(lib.path, []).append(f"{sym}: {err}")


def _attach_pair(bpf: Any, lib: _File, offset: int, spec: ProbeSpec | None = None, *,
                 entry_fn: str = "", return_fn: str = "") -> str | None:
    """Entry + return probe on one symbol at its file offset (from the library's own
    symbol tables, as for uprobe_multi); None, or why not."""
    if spec is not None:
        entry_fn, return_fn = spec.entry_fn, spec.return_fn
    name = os.fsencode(lib.opened)
    # Named by the library's shown path: descriptor numbers are reused, and two files
    # probed at one offset through one number would share BCC's event name.
    label = os.fsencode(lib.path)
    try:
        entry = attach_uprobe_at(bpf, name, offset, entry_fn.encode(), label=label)
    except OSError as exc:
        return f"offset {offset:#x}: {exc.strerror or exc}"
    try:
        attach_uprobe_at(bpf, name, offset, return_fn.encode(), retprobe=True, label=label)
    except OSError as exc:
        _detach_quietly(bpf, entry)
        return f"offset {offset:#x} (return): {exc.strerror or exc}"
    return None


# libbcc's bpf_attach_uprobe(prog_fd, attach_type, ev_name, path, offset, pid,
# ref_ctr_offset). BCC's Python binding (python3-bpfcc 0.26) declares the first six only,
# so bcc.BPF.attach_uprobe left the seventh, a USDT semaphore's file offset that x86-64
# passes on the stack, to whatever was there (6 here). The kernel keeps one counter
# offset per probed instruction: where another tracer (or fleetd's own uprobe_multi
# links) had a probe with the right one, 0, it refused ours with EINVAL; where it took
# ours, it would count that "semaphore" in the traced process's memory. Passing all seven
# suits any libbcc: one whose function has six never reads the seventh.
_ATTACH_ARGS = (ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32)
_attach_fn: Any = None


def _bpf_attach_uprobe() -> Any:
    global _attach_fn
    if _attach_fn is None:
        from bcc.libbcc import lib

        # A function object of our own: BCC's keeps its six-argument prototype.
        address = ctypes.cast(lib.bpf_attach_uprobe, ctypes.c_void_p).value or 0
        _attach_fn = ctypes.CFUNCTYPE(ctypes.c_int, *_ATTACH_ARGS, use_errno=True)(address)
    return _attach_fn


def attach_uprobe_at(bpf: Any, path: bytes, offset: int, fn_name: bytes, *,
                     retprobe: bool = False, pid: int = -1, label: bytes | None = None
                     ) -> bytes:
    """A uprobe (uretprobe) running ``fn_name`` at file ``offset`` of ``path``, through
    libbcc with no reference counter, kept in BCC's own table so that its cleanup
    detaches it; the event's name (made from ``label``, default ``path``). Raises
    OSError where the kernel refuses it."""
    fn = bpf.load_func(fn_name, _BPF_PROG_KPROBE)
    ev_name = bytes(bpf._get_uprobe_evname(b"r" if retprobe else b"p", label or path,
                                           offset, pid))
    ctypes.set_errno(0)
    fd = _bpf_attach_uprobe()(fn.fd, int(retprobe), ev_name, path, offset, pid, 0)
    if fd < 0:
        err = ctypes.get_errno() or errno.EINVAL
        raise OSError(err, os.strerror(err))
    bpf._add_uprobe_fd(ev_name, fd)
    return ev_name


def _detach_quietly(bpf: Any, ev_name: bytes) -> None:
    try:
        bpf.detach_uprobe_event(ev_name)
    except Exception as exc:  # bcc raises bare Exception
        log.debug("detach of a half-attached probe %r failed: %s", ev_name, exc)
